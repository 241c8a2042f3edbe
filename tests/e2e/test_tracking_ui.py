"""The MLflow UI draws a run's loss curve. A short ``plugintrain fit`` logs to TensorBoard
and to MLflow (a SQLite store) at once; ``mlflow server`` serves that store, and Debian's
Chromium, headless and driven by Playwright, opens the run's ``train_loss`` page. The
chart's points must be the losses the run logged, step by step, and the screenshot must
show the curve in the chart's own colour.

Chromium is Debian's (``make setup-dev`` installs it where it runs as root with apt-get);
Playwright's own browser downloads are never used. Without ``/usr/bin/chromium`` the test
skips and names the install command. Nothing leaves the machine: the browser resolves no
host but 127.0.0.1 and the server's telemetry is off.

``PLUGINTRAIN_UPDATE_SCREENSHOT=1`` also copies the screenshot to :data:`DOCS_SHOT`, the
picture the tracking guide shows.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml
from _processes import kill_group
from matplotlib.image import imread
from playwright.sync_api import sync_playwright

from _cli import RECIPES, REPO, run_cli

CHROMIUM = Path("/usr/bin/chromium")
INSTALL = "apt-get install -y --no-install-recommends chromium"
# Without the background-networking flags Chromium tries to reach Google's update and sync
# services and stalls; the resolver rule makes any other host fail at once.
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
]  # fmt: skip
DOCS_SHOT = REPO / "docs" / "guides" / "assets" / "mlflow_loss_curve.png"
STEPS = 10
EXPERIMENT, RUN_NAME = "llama3_debug_shakespeare_cpu", "tracking-ui"
# MLflow 3.17 opens its assistant panel over the right of the page on a first visit; these
# are the keys it remembers that in (with other keys, the panel only covers the picture's
# edge, and the colour check below fails if it hides the curve).
CLOSED_ASSISTANT = (
    "localStorage.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', 'true');"
    "localStorage.setItem('mlflow.assistant.panelOpen_v1', 'false');"
)


pytestmark = pytest.mark.skipif(
    not CHROMIUM.is_file(), reason=f"Chromium is not installed ({CHROMIUM}): {INSTALL} (as root)"
)


def test_mlflow_ui_draws_the_loss_curve(shakespeare_llama3: Path, tmp_path: Path) -> None:
    store, shot = tmp_path / "mlflow.db", tmp_path / "mlflow_loss_curve.png"
    # The server first: it makes the store's tables (MLflow's migrations, seconds of CPU),
    # and the run then logs straight into the SQLite file, as without a server.
    with _mlflow_server(store, tmp_path / "server.log") as url:
        _fit(shakespeare_llama3, tmp_path, store)
        experiment_id, run_id, losses = _logged_losses(url)
        traces, color, box = _draw(_metric_page(url, experiment_id, run_id), shot)
    assert sorted(losses) == list(range(STEPS))
    assert traces, "the train_loss chart has no trace"
    for trace in traces:  # the curve, and MLflow's faint unsmoothed copy of it
        assert trace["x"] == list(range(STEPS))
        assert trace["y"] == pytest.approx([losses[step] for step in range(STEPS)])
    assert _pixels_of(color, shot, box) >= 200, f"no {color} curve in {shot}"
    if os.environ.get("PLUGINTRAIN_UPDATE_SCREENSHOT") == "1":
        DOCS_SHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, DOCS_SHOT)


def _fit(data: Path, work: Path, store: Path) -> None:
    """Train the Llama debug recipe for :data:`STEPS` small steps in ``work``, logging
    every step to TensorBoard and to the MLflow store ``store`` (a SQLite file)."""
    # TensorBoard first: Lightning's CLI saves the resolved config in the first logger's
    # directory, and an MLflow store in a database has none.
    loggers = [
        {
            "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
            "init_args": {"save_dir": str(work / "runs"), "name": EXPERIMENT},
        },
        {
            "class_path": "lightning.pytorch.loggers.MLFlowLogger",
            "init_args": {
                "experiment_name": EXPERIMENT,
                "run_name": RUN_NAME,
                "tracking_uri": f"sqlite:///{store}",
            },
        },
    ]
    config = work / "loggers.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"logger": loggers}}))
    run_cli(
        "fit", "--config", str(RECIPES / "llama3_debug_shakespeare_cpu.yaml"),
        "--config", str(config), "--data.init_args.data_dir", str(data),
        "--data.init_args.seq_len", "32", "--data.init_args.batch_size", "2",
        "--trainer.max_steps", str(STEPS), "--trainer.log_every_n_steps", "1",
        "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--model.init_args.warmup_steps", "2",
        "--model.init_args.lr_decay_steps", str(STEPS),
        cwd=work, fresh_interpreter=False,
    )  # fmt: skip


@contextlib.contextmanager
def _mlflow_server(store: Path, log: Path) -> Iterator[str]:
    """``mlflow server`` on ``store`` at a free port, in a session of its own; its URL once
    it answers. The whole session is killed on the way out."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{store}",
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
    ]  # fmt: skip
    # One worker and no job runner (its consumers are processes of their own): the UI needs
    # neither, and the machine's two cores are shared with the other tests.
    env = {
        **os.environ,
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "true",
    }
    with log.open("w") as out:
        server = subprocess.Popen(
            command, cwd=log.parent, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_until_serving(url, server, log)
        yield url
    finally:
        kill_group(server.pid)
        server.wait()


def _wait_until_serving(url: str, server: subprocess.Popen, log: Path) -> None:
    """Return once ``url``'s health check answers; fail with the server's log if it exits
    or takes longer than two minutes."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"mlflow server exited {server.returncode}:\n{log.read_text()}")
        with contextlib.suppress(OSError), _OPENER.open(f"{url}/health", timeout=5) as answer:
            if answer.status == 200:
                return
        time.sleep(0.3)
    pytest.fail(f"mlflow server did not answer at {url} within 120 s:\n{log.read_text()}")


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""Requests to the local server never go through a proxy the environment names."""


def _rest(url: str, path: str, body: dict | None = None) -> dict:
    """The JSON answer of the server's REST API at ``path`` (a POST of ``body`` if given)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{url}/api/2.0/mlflow/{path}", data=data, headers={"Content-Type": "application/json"}
    )
    with _OPENER.open(request, timeout=30) as response:
        return json.load(response)


def _logged_losses(url: str) -> tuple[str, str, dict[int, float]]:
    """The experiment id, run id and step -> ``train_loss`` of the one run, as the server
    reads them from the store."""
    query = urllib.parse.urlencode({"experiment_name": EXPERIMENT})
    experiment_id = _rest(url, f"experiments/get-by-name?{query}")["experiment"]["experiment_id"]
    (run,) = _rest(url, "runs/search", {"experiment_ids": [experiment_id]})["runs"]
    run_id = run["info"]["run_id"]
    query = urllib.parse.urlencode({"run_id": run_id, "metric_key": "train_loss"})
    history = _rest(url, f"metrics/get-history?{query}")["metrics"]
    return experiment_id, run_id, {int(m["step"]): m["value"] for m in history}


def _metric_page(url: str, experiment_id: str, run_id: str) -> str:
    """The UI's page of ``train_loss`` against step for one run (the address the run page's
    metric links open), without smoothing and with each logged point marked."""
    query = {
        "runs": json.dumps([run_id]),
        "metric": json.dumps("train_loss"),
        "experiments": json.dumps([experiment_id]),
        "plot_metric_keys": json.dumps(["train_loss"]),
        "x_axis": "step",
        "y_axis_scale": "linear",
        "line_smoothness": "1",
        "show_point": "true",
    }
    return f"{url}/#/metric?{urllib.parse.urlencode(query)}"


def _draw(page_url: str, shot: Path) -> tuple[list[dict], str, dict]:
    """Open ``page_url`` in headless Chromium, wait until plotly has drawn the chart's
    line, and save a screenshot to ``shot``: the chart's traces (x and y as plotted), the
    first trace's line colour and the chart's box on the page (CSS pixels)."""
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 720})
            page.add_init_script(CLOSED_ASSISTANT)
            page.goto(page_url)
            page.wait_for_selector(".js-plotly-plot .scatterlayer path.js-line", timeout=60_000)
            plot = page.query_selector(".js-plotly-plot")
            traces = plot.evaluate(
                "plot => plot._fullData.filter(t => t.visible === true)"
                ".map(t => ({x: Array.from(t.x), y: Array.from(t.y), color: t.line.color}))"
            )
            box = plot.bounding_box()
            page.screenshot(path=str(shot))
        finally:
            browser.close()
    return traces, traces[0]["color"] if traces else "", box


def _pixels_of(color: str, shot: Path, box: dict) -> int:
    """How many pixels of ``shot`` inside ``box`` are within a few levels of ``color``
    (``#rrggbb``, plotly's form), at the page's 1:1 scale."""
    if not (color.startswith("#") and len(color) >= 7):
        pytest.fail(f"the chart's line colour {color!r} is not #rrggbb")
    rgb = np.array([int(color[i : i + 2], 16) for i in (1, 3, 5)], dtype=float)
    image = imread(shot)[..., :3] * 255.0  # PNG: floats in [0, 1]
    x0, y0 = int(box["x"]), int(box["y"])
    chart = image[y0 : y0 + int(box["height"]), x0 : x0 + int(box["width"])]
    return int((np.abs(chart - rgb).max(axis=-1) <= 8).sum())
