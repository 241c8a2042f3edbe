"""``--ckpt_path`` says what it does: `last`, conflicting model options, bad files.

Each CLI case calls ``plugintrain.cli.main`` in-process; every error is raised while the
command is parsed, so it is one line, printed last, with exit status 2, and nothing runs.
"""

from __future__ import annotations

import pathlib
from pathlib import Path

import pytest
import torch
from test_checkpoint_files import Payload
from test_cli_errors import GPT2_RECIPE, _token_dir

from plugintrain.checkpoints.portable import (
    check_weight_shapes,
    group_names,
    is_position_keyed,
    to_positions,
)
from plugintrain.checkpoints.resume import reconcile, resolve_ckpt_path
from plugintrain.cli import main
from plugintrain.core.atomic_files import PARTIAL_SUFFIX, RETIRED_SUFFIX
from plugintrain.model_zoo import CausalLM

HPARAMS = {"_class_path": "plugintrain.model_zoo.CausalLM", "config": "gpt2-debug"}


def _fit(capfd, tmp_path: Path, *overrides: str) -> tuple[int, str]:
    data = _token_dir(tmp_path / "tokens")
    runs = tmp_path / "runs"
    code = main(
        [
            "fit", "--config", str(GPT2_RECIPE), f"--data.init_args.data_dir={data}",
            f"--trainer.logger.init_args.save_dir={runs}", *overrides,
        ]
    )  # fmt: skip
    err = capfd.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def test_a_model_option_that_contradicts_the_checkpoint_is_an_error(capfd, tmp_path) -> None:
    ckpt = tmp_path / "gpt2.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": HPARAMS}, ckpt)
    code, line = _fit(
        capfd, tmp_path, "--model.init_args.config", "llama3-debug", "--ckpt_path", str(ckpt)
    )
    assert code == 2
    assert f"{ckpt} was trained with model config='gpt2-debug'" in line
    assert "sets config='llama3-debug'" in line and "--resume_overrides [config]" in line


def test_a_missing_checkpoint_is_named(capfd, tmp_path) -> None:
    code, line = _fit(capfd, tmp_path, "--ckpt_path", str(tmp_path / "nope.ckpt"))
    assert code == 2 and f"--ckpt_path {tmp_path / 'nope.ckpt'} does not exist" in line


def test_a_planted_payload_never_runs_and_is_named(capfd, tmp_path) -> None:
    marker, ckpt = tmp_path / "ran", tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"x": Payload(marker)}}, ckpt)
    code, line = _fit(capfd, tmp_path, "--ckpt_path", str(ckpt))
    assert code == 2 and f"{ckpt} holds objects that loading would have to run code" in line
    code = main(["generate", "--ckpt_path", str(ckpt), "--prompt", "ROMEO:"])
    line = capfd.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and str(ckpt) in line and "GLOBAL getattr" in line
    assert not marker.exists()


def test_a_truncated_checkpoint_is_named(capfd, tmp_path) -> None:
    ckpt = tmp_path / "cut.ckpt"
    torch.save({"state_dict": {"w": torch.ones(1000)}, "hyper_parameters": HPARAMS}, ckpt)
    ckpt.write_bytes(ckpt.read_bytes()[:300])
    code, line = _fit(capfd, tmp_path, "--ckpt_path", str(ckpt))
    assert code == 2 and f"{ckpt} is truncated or not a torch checkpoint" in line


def test_last_without_a_checkpoint_starts_from_scratch(capsys, tmp_path) -> None:
    assert resolve_ckpt_path("last", str(tmp_path / "checkpoints")) is None
    assert "starting from scratch" in capsys.readouterr().out


def test_last_is_the_newest_complete_checkpoint_and_leftovers_go(capsys, tmp_path) -> None:
    older, newer = tmp_path / "last.ckpt", tmp_path / "epoch=0-step=4.ckpt"
    torch.save({"global_step": 2}, older)
    torch.save({"global_step": 4}, newer)
    (tmp_path / f"last.ckpt{PARTIAL_SUFFIX}").write_bytes(b"half")
    (tmp_path / f"x.ckpt{RETIRED_SUFFIX}").mkdir()
    older.touch()  # an older last.ckpt written after: still the newest complete one
    assert resolve_ckpt_path("last", str(tmp_path)) == str(older)
    assert sorted(p.name for p in tmp_path.iterdir()) == [newer.name, "last.ckpt", "x.ckpt"]
    assert "restored" in capsys.readouterr().out


def test_an_elastic_restart_resumes_last_by_itself(monkeypatch, tmp_path) -> None:
    torch.save({"global_step": 2}, tmp_path / "last.ckpt")
    assert resolve_ckpt_path(None, str(tmp_path)) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert resolve_ckpt_path(None, str(tmp_path)) == str(tmp_path / "last.ckpt")


def test_options_left_at_their_defaults_take_the_checkpoints() -> None:
    saved = {**HPARAMS, "config": "llama3-debug", "warmup_steps": 7}
    given = {"config": None, "warmup_steps": 100}  # both CausalLM's defaults
    assert reconcile("c.ckpt", saved, given, CausalLM, []) == {
        "config": "llama3-debug",
        "warmup_steps": 7,
    }
    given = {"config": None, "warmup_steps": 3}
    with pytest.raises(ValueError, match="warmup_steps=7, but this run sets warmup_steps=3"):
        reconcile("c.ckpt", saved, given, CausalLM, [])
    kept = reconcile("c.ckpt", saved, given, CausalLM, ["warmup_steps"])
    assert kept["warmup_steps"] == 3


def test_a_shape_mismatch_is_one_line_naming_file_tensor_and_shapes() -> None:
    checkpoint = {"state_dict": {"w": torch.zeros(4, 3)}, "plugintrain_loaded_from": "a.ckpt"}
    with pytest.raises(ValueError, match=r"a.ckpt: w has shape \(4, 3\) .* and \(4, 5\) in"):
        check_weight_shapes(checkpoint, {"w": torch.zeros(4, 5)})


def test_name_keyed_optimizer_state_goes_back_to_positions_as_torch_expects() -> None:
    """The reference is torch's own: a state dict saved by one AdamW, re-keyed by name and
    back, loads into a fresh AdamW and steps exactly like the original."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    groups = [
        {"params": [model[0].weight], "weight_decay": 0.1},
        {"params": [model[0].bias, model[1].weight, model[1].bias], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=0.1)
    model(torch.randn(2, 3)).square().sum().backward()
    optimizer.step()
    state = optimizer.state_dict()
    names = group_names(model, optimizer)
    flat = [n for group in names for n in group]
    by_name = {
        "state": {flat[i]: v for i, v in state["state"].items()},
        "param_groups": [{**g, "params": []} for g in state["param_groups"]],
    }
    assert not is_position_keyed(by_name)
    back = to_positions(by_name, names)
    assert is_position_keyed(back)
    assert back["param_groups"] == state["param_groups"]
    for i, entry in state["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(back["state"][i][key], value)


def test_the_payload_class_is_what_weights_only_refuses(tmp_path) -> None:
    """The planted payload does run under a plain unpickler (so the tests above can fail)."""
    marker, path = tmp_path / "ran", tmp_path / "p.ckpt"
    torch.save({"x": Payload(marker)}, path)
    torch.load(path, weights_only=False)
    assert pathlib.Path(marker).exists()


def test_a_stateless_optimizer_s_name_keyed_state_is_not_taken_for_torch_s() -> None:
    """SGD without momentum keeps no state: a sharded checkpoint's name-keyed state lists no
    parameter at all, and must still be mapped to the optimizer's positions (it was taken
    for torch's own, and a resume in one process failed on the groups' sizes)."""
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    by_name = {"state": {}, "param_groups": [{**optimizer.param_groups[0], "params": []}]}
    assert not is_position_keyed(by_name)
    back = to_positions(by_name, group_names(model, optimizer))
    optimizer.load_state_dict(back)  # the sizes match
    assert is_position_keyed(optimizer.state_dict())
