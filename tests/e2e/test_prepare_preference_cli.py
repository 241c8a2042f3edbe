"""The DPO demo's data from the command line, in a fresh interpreter as a user runs it:
`prepare dates --preference`, `prepare preference` with SmolLM2's own template, a bad row
refused in one line with exit 2 and nothing written, and the folder batched by
`PreferenceDataModule` as the objective reads it."""

from __future__ import annotations

import datetime
import json

import torch

from plugintrain.core.preference_batch import unpack_reference
from plugintrain.data import PreferenceDataModule, get_tokenizer

from _cli import run_cli


def test_dates_pairs_prepared_and_batched(tmp_path) -> None:
    pairs = tmp_path / "pairs.jsonl"
    run_cli("prepare", "dates", "--preference", "--count", "40", "--out", str(pairs), cwd=tmp_path)
    out = tmp_path / "dates_dpo"
    prepare = ["prepare", "preference", str(pairs), "--tokenizer", "smollm2-135m"]
    bad = tmp_path / "bad.jsonl"
    rows = pairs.read_text().splitlines()
    same = json.loads(rows[0]) | {"rejected": json.loads(rows[0])["chosen"]}
    bad.write_text("\n".join([rows[1], json.dumps(same)]) + "\n")
    refused = [*prepare[:2], str(bad), *prepare[3:], "--out", str(out)]
    proc = run_cli(*refused, cwd=tmp_path, exit_code=2)
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith(f"plugintrain prepare preference: error: {bad}:2: chosen equals rejected")
    )
    assert not list(tmp_path.glob("dates_dpo*"))

    run_cli(*prepare, "--val_examples", "8", "--out", str(out), cwd=tmp_path)
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["splits"]["train"]["pairs"], meta["splits"]["val"]["pairs"]) == (32, 8)
    data = PreferenceDataModule(str(out), batch_size=4, tokenizer="smollm2-135m")
    data.setup("fit")
    x, y = next(iter(data.train_dataloader()))
    targets, ref = unpack_reference(y)
    assert x.shape == targets.shape and x.shape[0] == 8 and x.shape[1] % 8 == 0
    assert torch.isnan(ref).all()  # no --reference
    tokenizer = get_tokenizer("smollm2-135m")
    for chosen, rejected in zip(targets[::2], targets[1::2], strict=True):
        answer = tokenizer.decode(chosen[chosen != -100].tolist())
        datetime.date.fromisoformat(answer.removesuffix("<|im_end|>"))  # the ISO date alone
        assert rejected[rejected != -100].tolist() != chosen[chosen != -100].tolist()
