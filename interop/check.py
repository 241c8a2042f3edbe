"""``make interop-check``: every GGUF export checked with llama.cpp's own loader.

For each family plugintrain writes to llama.cpp (GPT-2, Llama 3 and Qwen3 debug models
trained two steps and saved by ``fit``, SmolLM2-135M-Instruct as it ships, and a SmolLM2
LoRA fine-tune on the chat demo's dates, merged) and each GGUF type (f32, f16, bf16,
q8_0), ``plugintrain export``/``convert`` writes the file and llama.cpp
(``llama-cpp-python``, built from source in its own virtual environment by the Makefile)
loads it and reports, with an f32 KV cache:

* the token ids of a set of texts, against plugintrain's tokenizer (with BOS where the
  family's tokenizer adds it);
* the logits of every position of a sequence, against plugintrain's model *of the same
  file* (read back by plugintrain's GGUF reader, so a quantized file is compared with its
  own dequantized weights: what is left is how the two compute), and against the f32
  source model (what the type itself costs);
* for the LoRA fine-tune, the greedy answer to a held-out question, against plugintrain's
  greedy answer from the run's checkpoint (adapters unmerged).

DeepSeek-V3, which plugintrain does not write as GGUF, must be refused in one line (exit 2)
with nothing written. Prints a Markdown table, writes ``runs/interop/interop.json``, and
exits 1 if a check fails.

    .venv/bin/python interop/check.py --llama-python ~/.cache/plugintrain/interop/venv/bin/python
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "  two leading spaces,\ttabs,\n\nand blank lines\n",
    "Numbers 1234567 and 3.14159; dates 2031-03-03 and 4/1/2038.",
    "Ünïcödé, 日本語のテキスト, emoji 😀🚀 and Ελληνικά.",
    "def f(x):\n    return x ** 2  # code\n",
    "it's they'll I'M we've DON'T",
]
TYPES = ("float32", "float16", "bfloat16", "q8_0")
# Largest |llama.cpp - plugintrain| over all logits of the sequence, on the same file, as
# a fraction of the largest |logit|. llama.cpp rounds activations to the weights' type in
# its f16/bf16 matmuls and to 8 bits in q8_0's (ggml's vec_dot), plugintrain computes in
# f32 from the dequantized weights: the tolerance grows with that rounding (and with
# depth: SmolLM2's 30 layers). GPT-2 in f32: ggml's CPU GELU reads an fp16 lookup table
# (GGML_GELU_FP16), ~1e-4 of the logits; the RoPE families agree to ~1e-6.
TOLERANCE = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 3e-2, "q8_0": 6e-2}
GELU_TABLE_F32 = 5e-4  # GPT-2's f32 tolerance


def _tolerance(model: str, dtype: str) -> float:
    return GELU_TABLE_F32 if model == "gpt2" and dtype == "float32" else TOLERANCE[dtype]


QUESTION = "Write this date in ISO 8601 format (YYYY-MM-DD), and nothing else: Sunday, 9 Nov 2087"


def _cli(*argv: str) -> tuple[int, str]:
    """``plugintrain ARGV`` in this process: exit status and stderr."""
    from plugintrain.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(list(argv))
        except SystemExit as exit_:
            code = exit_.code
    return int(code or 0), err.getvalue()


def _trained_checkpoint(preset: str, out: Path) -> Path:
    """``preset`` trained two steps on random tokens and saved by Lightning, as ``fit``
    saves it."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from plugintrain.model_zoo import CausalLM, TransformerConfig

    path = out / f"{preset}.ckpt"
    if path.is_file():
        return path
    L.seed_everything(0, verbose=False)
    module = CausalLM(TransformerConfig.from_name(preset), warmup_steps=0, lr_decay_steps=2)
    config = module.config
    tokens = torch.randint(
        0, config.vocab_size, (4, 33), generator=torch.Generator().manual_seed(0)
    )
    trainer = L.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=out,
    )  # fmt: skip
    trainer.fit(module, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2))
    trainer.save_checkpoint(path)
    return path


def _lora_run(work: Path, steps: int) -> Path:
    """A short LoRA fine-tune of SmolLM2 on the chat demo's dates; its checkpoint."""
    run = work / "lora_run"
    found = sorted(run.glob("**/last.ckpt"))
    if found:
        return found[0]
    data = work / "dates_chat"
    if not (work / "dates.jsonl").is_file():
        code, err = _cli("prepare", "dates", "--out", str(work / "dates.jsonl"))
        assert code == 0, err
    code, err = _cli("prepare", "chat", str(work / "dates.jsonl"), "--tokenizer", "smollm2-135m",
                     "--out", str(data), "--seq_len", "256", "--val_examples", "100",
                     "--overwrite")  # fmt: skip
    assert code == 0, err
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "smollm2_lora_chat_cpu.yaml"
    subprocess.run(
        [sys.executable, "-m", "plugintrain", "fit", "--config", str(recipe),
         f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={steps}",
         "--trainer.limit_val_batches=1",
         f"--trainer.logger.init_args.save_dir={run}", f"--data.init_args.data_dir={data}",
         "--trainer.enable_progress_bar=false", f"--checkpoint.every_n_train_steps={steps}"],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return sorted(run.glob("**/last.ckpt"))[0]


def _export(source: str, out: Path, dtype: str, merge: bool = False) -> None:
    if out.is_file():
        return
    command = "export" if source.endswith(".ckpt") else "convert"
    extra = ("--merge-lora",) if merge else ()
    code, err = _cli(command, source, str(out), "--format", "gguf", "--dtype", dtype, *extra)
    assert code == 0, f"{command} {source} -> {out}: {err.strip().splitlines()[-1:]}"


def _cases(work: Path, lora_steps: int) -> list[dict]:
    """(name, source, tokenizer spec, merge) for every family written to GGUF."""
    cases = [
        {"name": p.split("-")[0], "preset": p, "source": str(_trained_checkpoint(p, work))}
        for p in ("gpt2-debug", "llama3-debug", "qwen3-debug")
    ]
    cases.append({"name": "smollm2", "preset": "SmolLM2-135M-Instruct", "source": "smollm2-135m"})
    lora = _lora_run(work, lora_steps)
    cases.append({"name": "smollm2 LoRA (merged)", "preset": "SmolLM2-135M-Instruct + LoRA",
                  "source": str(lora), "merge": True, "greedy": True})  # fmt: skip
    return cases


def _ours(path: str, adapter: str | None = None):
    from plugintrain.tools._models import load_causal_lm, load_with_adapter

    model = load_causal_lm(path) if adapter is None else load_with_adapter(None, adapter, False)
    return model.eval()


def _logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].float().numpy()


def _greedy_ours(adapter: str) -> tuple[list[int], list[int], list[int]]:
    from plugintrain.data.tokenizers.chat_templates import ChatEncoder, load_chat_template
    from plugintrain.data.tokenizers.registry import get_tokenizer
    from plugintrain.model_zoo.generation import generate_tokens

    model = _ours("", adapter)
    tokenizer = get_tokenizer("smollm2-135m")
    encoder = ChatEncoder(tokenizer, load_chat_template("smollm2-135m"))
    prompt = encoder.encode_prompt([{"role": "user", "content": QUESTION}])
    stops = list(encoder.stop_ids)
    idx = torch.tensor([prompt])
    with torch.no_grad():
        answer = []
        for step in generate_tokens(model.model, idx, 16, temperature=0.0, stop_ids=stops):
            answer.append(int(step[0, 0]))
            if answer[-1] in stops:
                break
    return prompt, answer, stops


def _deepseek_refused(work: Path) -> dict:
    ckpt = _trained_checkpoint("deepseek-v3-debug", work)
    out = work / "deepseek.gguf"
    code, err = _cli("export", str(ckpt), str(out), "--format", "gguf")
    lines = err.strip().splitlines()
    ok = code == 2 and len(lines) >= 1 and "Traceback" not in err and not out.exists()
    return {"ok": ok, "exit": code, "message": lines[-1] if lines else ""}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-python", required=True, help="python of the llama-cpp-python venv")
    parser.add_argument("--work", default=str(Path.home() / ".cache/plugintrain/interop/work"))
    parser.add_argument("--out", default="runs/interop")
    parser.add_argument("--lora-steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(2)
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    from plugintrain.data.tokenizers.registry import get_tokenizer

    cases = _cases(work, args.lora_steps)
    jobs, meta = [], []
    for case in cases:
        model = _ours(case["source"]) if not case.get("merge") else _ours("", case["source"])
        spec = model.config.tokenizer or model.config.family
        tokenizer = get_tokenizer(spec)
        ids = tokenizer.encode(TEXTS[0] + " " + TEXTS[2], bos=tokenizer.add_bos)[:48]
        reference = _logits(model, ids)
        greedy = _greedy_ours(case["source"]) if case.get("greedy") else None
        for dtype in TYPES:
            gguf = (
                work
                / f"{case['name'].split()[0]}{'_lora' if case.get('merge') else ''}.{dtype}.gguf"
            )
            _export(case["source"], gguf, dtype, bool(case.get("merge")))
            job = {"gguf": str(gguf), "texts": TEXTS, "ids": ids}
            if greedy is not None:
                job["greedy"] = {"ids": greedy[0], "n": 16, "stop": greedy[2]}
            jobs.append(job)
            expected = [tokenizer.encode(t, bos=tokenizer.add_bos) for t in TEXTS]
            meta.append({"case": case, "dtype": dtype, "expected": expected, "ids": ids,
                         "reference": reference, "greedy": greedy})  # fmt: skip
    request = out / "request.json"
    request.write_text(json.dumps({"jobs": jobs}))
    runner = Path(__file__).with_name("llama_cpp_runner.py")
    subprocess.run([args.llama_python, str(runner), str(request), str(out)], check=True)
    result = json.loads((out / "result.json").read_text())
    rows, failed = [], False
    for m, r in zip(meta, result["results"], strict=True):
        theirs = np.load(out / r["logits"], allow_pickle=False)
        same_file = _logits(_ours(r["gguf"]), m["ids"])
        scale = float(np.abs(same_file).max())
        diff = float(np.abs(theirs - same_file).max()) / scale
        drift = float(np.abs(theirs - m["reference"]).max()) / float(np.abs(m["reference"]).max())
        argmax = float((theirs.argmax(-1) == m["reference"].argmax(-1)).mean())
        tokens_ok = r["tokens"] == m["expected"]
        row = {"model": m["case"]["name"], "type": m["dtype"], "loads": True,
               "tokens_equal": tokens_ok, "logits_rel_diff_same_file": diff,
               "logits_rel_diff_f32_source": drift, "argmax_agreement_f32_source": argmax,
               "tolerance": _tolerance(m["case"]["name"], m["dtype"])}  # fmt: skip
        ok = tokens_ok and diff <= row["tolerance"]
        if m["greedy"] is not None:
            row["greedy_equal"] = r["greedy"] == m["greedy"][1]
            row["greedy_llama_cpp"] = r["greedy"]
            row["greedy_plugintrain"] = m["greedy"][1]
            ok = ok and (row["greedy_equal"] or m["dtype"] != "float32")
        row["ok"] = ok
        failed |= not ok
        rows.append(row)
    deepseek = _deepseek_refused(work)
    failed |= not deepseek["ok"]
    report = {"llama_cpp_python": result["llama_cpp"], "seconds": round(time.time() - started),
              "date": time.strftime("%Y-%m-%d"), "rows": rows, "deepseek_v3": deepseek}  # fmt: skip
    (out / "interop.json").write_text(json.dumps(report, indent=2))
    print(_table(report))
    return 1 if failed else 0


def _table(report: dict) -> str:
    lines = [
        f"llama.cpp via llama-cpp-python {report['llama_cpp_python']}, {report['date']},"
        f" {report['seconds']} s",
        "",
        "| model | GGUF type | loads | token ids equal | max rel. logit diff, same file |"
        " tolerance | max rel. diff vs f32 source | argmax agreement vs f32 source |"
        " greedy answer equal | ok |",
        "|---|---|---|---|---:|---:|---:|---:|---|---|",
    ]
    for row in report["rows"]:
        greedy = {True: "yes", False: "no"}.get(row.get("greedy_equal"), "")
        lines.append(
            f"| {row['model']} | {row['type']} | yes | {'yes' if row['tokens_equal'] else 'NO'} |"
            f" {row['logits_rel_diff_same_file']:.1e} | {row['tolerance']:.0e} |"
            f" {row['logits_rel_diff_f32_source']:.1e} |"
            f" {row['argmax_agreement_f32_source']:.0%} | {greedy} |"
            f" {'yes' if row['ok'] else 'NO'} |"
        )
    ds = report["deepseek_v3"]
    lines.append(f'\nDeepSeek-V3 export to GGUF: exit {ds["exit"]}, "{ds["message"]}"')
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
