"""lm-evaluation-harness with plugintrain's model type (issue 29), against lm-eval's own
``hf`` model on the same weights exported to a Hugging Face directory: the same scores on
local tasks (nothing downloaded) of each request type: multiple choice (loglikelihood),
generate-until and rolling loglikelihood (perplexity). GPT-2's vocabulary (no BOS) and
Llama 3's (BOS first), through ``plugintrain evaluate --tasks`` and ``plugintrain
lm-eval``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from plugintrain.cli import main

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.tasks import TaskManager  # noqa: E402
from test_tokenizer_files import _fit  # noqa: E402

from plugintrain.tools.lm_eval_model import PluginTrainLM  # noqa: E402

QUESTIONS = [
    ("What is the capital of France?", ["Paris", "Rome", "Berlin", "Madrid"], 0),
    ("2 + 2 =", ["3", "4", "5", "22"], 1),
    ("The opposite of hot is", ["cold", "warm", "sunny", "wet"], 0),
    ("Which animal barks?", ["cat", "dog", "cow", "fish"], 1),
    ("The color of the sky on a clear day is", ["green", "blue", "red", "black"], 1),
    ("Water freezes at", ["0 degrees", "50 degrees", "100 degrees", "20 degrees"], 0),
]
TEXTS = [
    "It was the best of times, it was the worst of times, it was the age of wisdom.",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer"
    " the slings and arrows of outrageous fortune, or to take arms against a sea of troubles.",
]


def _tasks(root: Path) -> Path:
    """Three local tasks, one per request type, as YAML and JSON lines."""
    root.mkdir(parents=True, exist_ok=True)
    mc = [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS]
    gen = [{"question": q, "answer": c[a]} for q, c, a in QUESTIONS]
    for name, rows in (("mc", mc), ("gen", gen), ("ppl", [{"text": t} for t in TEXTS])):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = "dataset_path: json\ntest_split: train\n"
    files = "dataset_kwargs:\n  data_files:\n    train: {}\n"
    (root / "mc.yaml").write_text(
        f"task: pt_mc\n{common}{files.format(root / 'mc.jsonl')}output_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_choice: "{{choices}}"\n'
        "doc_to_target: answer\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (root / "gen.yaml").write_text(
        f"task: pt_gen\n{common}{files.format(root / 'gen.jsonl')}output_type: generate_until\n"
        'doc_to_text: "Q: {{question}}\\nA:"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n", "Q:"]\n  max_gen_toks: 6\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )
    (root / "ppl.yaml").write_text(
        f"task: pt_ppl\n{common}{files.format(root / 'ppl.jsonl')}"
        'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
        "  - metric: bits_per_byte\n"
    )
    return root


TASKS = ["pt_mc", "pt_gen", "pt_ppl"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("lm_eval")
    out = {"tasks": _tasks(root / "tasks")}
    for preset in ("gpt2-debug", "llama3-debug"):
        ckpt = _fit(preset, root)
        assert main(["export", str(ckpt), str(root / f"{preset}_hf"), "--format", "hf"]) == 0
        out[preset] = (ckpt, root / f"{preset}_hf")
    return out


def _scores(results: dict) -> dict[str, float]:
    return {f"{task}/{key}": value for task, metrics in results["results"].items()
            for key, value in metrics.items()
            if isinstance(value, float) and "stderr" not in key}  # fmt: skip


def _samples(results: dict) -> dict[str, list]:
    return {task: [s["filtered_resps"] for s in samples]
            for task, samples in results["samples"].items()}  # fmt: skip


@pytest.mark.parametrize("preset", ["gpt2-debug", "llama3-debug"])
def test_same_scores_as_lm_eval_hf_model(setup: dict, preset: str) -> None:
    ckpt, exported = setup[preset]
    manager = TaskManager(include_path=str(setup["tasks"]))
    ours = lm_eval.simple_evaluate(
        model=PluginTrainLM(weights=str(ckpt), batch_size=4), tasks=TASKS,
        task_manager=manager, log_samples=True,
    )  # fmt: skip
    theirs = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={exported},dtype=float32", tasks=TASKS,
        task_manager=manager, log_samples=True, batch_size=4, device="cpu",
    )  # fmt: skip
    a, b = _scores(ours), _scores(theirs)
    assert a.keys() == b.keys() and len(a) >= 6
    for key in a:
        assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-6), (key, a[key], b[key])
    samples_a, samples_b = _samples(ours), _samples(theirs)
    assert samples_a["pt_gen"] == samples_b["pt_gen"]  # the same greedy answers, as text
    for x, y in zip(samples_a["pt_mc"], samples_b["pt_mc"], strict=True):
        for (lp_x, greedy_x), (lp_y, greedy_y) in zip(x, y, strict=True):
            assert math.isclose(float(lp_x), float(lp_y), rel_tol=1e-4, abs_tol=1e-4)
            assert greedy_x == greedy_y


def test_evaluate_tasks_and_lm_eval_command(setup: dict, tmp_path: Path, capsys) -> None:
    """``plugintrain evaluate --tasks`` prints lm-eval's results; ``plugintrain lm-eval``
    is lm-eval's own command line with ``--model plugintrain``; an unknown task is one
    line naming it."""
    ckpt = str(setup["gpt2-debug"][0])
    scores_file = str(tmp_path / "scores.json")
    argv = ["evaluate", "--weights", ckpt, "--tasks", "pt_mc",
            "--include_path", str(setup["tasks"]), "--json", scores_file]  # fmt: skip
    assert main(argv) == 0
    scores = json.loads((tmp_path / "scores.json").read_text())["tasks"]["pt_mc"]
    assert 0.0 <= scores["acc,none"] <= 1.0
    out = tmp_path / "lm_eval_out"
    argv = ["lm-eval", "run", "--model", "plugintrain", "--model_args", f"weights={ckpt}",
            "--tasks", "pt_mc", "--include_path", str(setup["tasks"]),
            "--output_path", str(out)]  # fmt: skip
    assert main(argv) == 0
    written = list(out.rglob("results_*.json"))
    assert written and "pt_mc" in json.loads(written[0].read_text())["results"]
    assert main(["evaluate", "--weights", ckpt, "--tasks", "no_such_task"]) == 2
    assert "--tasks no_such_task: lm-eval knows no such task" in capsys.readouterr().err
