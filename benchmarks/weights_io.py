"""Time and peak memory of importing and exporting pretrained weights, each against the
usual way, on random GPT-2 124M (fp32) and Llama 3.2 1B (bf16) checkpoints::

    .venv/bin/python benchmarks/weights_io.py [--models gpt2-124m llama3.2-1b] [--keep] [--tmp DIR]

The source of each model is a Hugging Face directory (``config.json`` and one
``model.safetensors`` of random tensors) written once into a temporary directory. Every
operation then runs in a fresh ``python benchmarks/weights_io.py --child ...`` process, so
its peak RSS is its own: the high-water mark is reset after the imports (Linux
``/proc/self/clear_refs``) and the peak ``ru_maxrss`` is reported less the RSS at that
point. Sources are read from a warm page cache; memory-mapped pages a process touches
count in its RSS.

1. **Import** into a model of the checkpoint's dtype, every weight then read once (see
   ``_touch``). Baseline: ``transformers``'
   ``AutoModelForCausalLM.from_pretrained(dir, dtype=...)``. Ours: ``open_weights`` and
   ``load_into`` a :class:`~plugintrain.model_zoo.Transformer` built on the meta device and
   allocated with ``to_empty`` (no random init), one tensor copied at a time.
2. **Export.** Baseline: what a gather-then-save converter does, the whole state dict in
   memory (``safetensors.torch.load_file``, each tensor cloned) then written at once
   (``save_file``). Also shown: ``load_file`` then ``save_file`` as they are, which in
   safetensors 0.8 copy nothing (a memory-mapped state dict, written in place), the floor
   for an unchanged safetensors file. Ours: ``convert`` to a Hugging Face directory (same
   dtype), to GGUF (bf16) and, for GPT-2, to an llm.c ``.bin`` (source dtype), each
   writing one tensor at a time.

Prints a markdown table per model: seconds; peak RSS growth, and the sampled peak growth
of its anonymous part (RSS counts the pages of a memory-mapped file a process has read,
which the kernel can drop; anonymous memory it must keep); the peak of live tensor
storage seen by :class:`~plugintrain.core.memory.LiveTensorMemory` (ours only, from a second
run, as the mode slows every op; the baselines allocate in native code it does not see);
and the ratios of each to the first baseline of the same kind (below 1 is better).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from plugintrain.formats.base import model_shapes
from plugintrain.formats.safetensors_io import write_safetensors
from plugintrain.model_zoo import TransformerConfig
from plugintrain.model_zoo.families import family_of

SOURCE_DTYPES = {"gpt2-124m": torch.float32, "llama3.2-1b": torch.bfloat16}
"""Each model's source checkpoint dtype, as it is published."""
IMPORTS = ("import, transformers from_pretrained", "import, ours")
EXPORTS = (
    "export, gathered + save_file",
    "export, load_file + save_file",
    "export, ours -> hf",
    "export, ours -> gguf bf16",
    "export, ours -> llmc",
)
OUTPUTS = {EXPORTS[3]: "out.gguf", EXPORTS[4]: "out.bin"}
"""File name of an operation's output (others write a directory ``out``)."""
MiB = 2**20


def _hf_shapes(config: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape, from the family's export plan on the meta device."""
    ours = model_shapes(config)
    plan = family_of(config).hf_export_plan(config)
    return {
        name: tuple(rule.build(*(torch.empty(ours[s], device="meta") for s in rule.sources)).shape)
        for name, rule in plan.items()
    }


def _make_source(model: str, out: Path) -> None:
    """A Hugging Face directory of random weights, generated and written one at a time."""
    config = TransformerConfig.from_name(model)
    dtype = SOURCE_DTYPES[model]
    shapes = _hf_shapes(config)
    generator = torch.Generator().manual_seed(0)
    out.mkdir(parents=True)
    hf_config = family_of(config).to_hf_config(config)
    hf_config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")

    def read(name: str) -> torch.Tensor:
        return torch.empty(shapes[name], dtype=dtype).normal_(0, 0.02, generator=generator)

    with open(out / "model.safetensors", "wb") as stream:
        write_safetensors(stream, shapes.items(), dtype, read)


def _import_transformers(source: Path, out: Path, dtype: torch.dtype) -> None:
    from transformers import AutoModelForCausalLM

    _touch(AutoModelForCausalLM.from_pretrained(source, dtype=dtype))


def _import_ours(source: Path, out: Path, dtype: torch.dtype) -> None:
    from plugintrain.formats import load_into, open_weights
    from plugintrain.model_zoo import Transformer

    weights = open_weights(source)
    with torch.device("meta"):
        model = Transformer(weights.config).to(dtype)
    model.to_empty(device="cpu")
    model.init_buffers()
    load_into(model, weights)
    _touch(model)


def _touch(model: torch.nn.Module) -> None:
    """Read every weight once. ``from_pretrained`` leaves weights of the file's dtype as
    views of its memory map, read on first use; the first forward would read them all."""
    for tensor in model.state_dict().values():
        tensor.sum()


def _export_gathered(source: Path, out: Path, dtype: torch.dtype) -> None:
    """The whole state dict in memory, then written at once: a gather-then-save converter
    (its tensors gathered from shards, or transformed, are its own memory)."""
    from safetensors.torch import load_file

    _save_whole({k: v.clone() for k, v in load_file(source / "model.safetensors").items()},
                source, out)  # fmt: skip


def _export_mapped(source: Path, out: Path, dtype: torch.dtype) -> None:
    """``load_file`` then ``save_file``: both zero-copy in safetensors 0.8 (the state dict
    is views of the file's memory map; the writer reads the tensors' memory in place)."""
    from safetensors.torch import load_file

    _save_whole(load_file(source / "model.safetensors"), source, out)


def _save_whole(state_dict: dict[str, torch.Tensor], source: Path, out: Path) -> None:
    from safetensors.torch import save_file

    out.mkdir()
    save_file(state_dict, out / "model.safetensors", metadata={"format": "pt"})
    shutil.copyfile(source / "config.json", out / "config.json")


def _converter(fmt: str, dtype: str | None = None) -> Callable[[Path, Path, torch.dtype], None]:
    def run(source: Path, out: Path, _: torch.dtype) -> None:
        from plugintrain.formats import convert

        convert(source, out, fmt, dtype=dtype)

    return run


OPERATIONS: dict[str, Callable[[Path, Path, torch.dtype], None]] = {
    IMPORTS[0]: _import_transformers,
    IMPORTS[1]: _import_ours,
    EXPORTS[0]: _export_gathered,
    EXPORTS[1]: _export_mapped,
    EXPORTS[2]: _converter("hf"),
    EXPORTS[3]: _converter("gguf", "bfloat16"),
    EXPORTS[4]: _converter("llmc"),
}
"""Operation -> run(source, out, the source's dtype)."""
BASELINES = (IMPORTS[0], EXPORTS[0], EXPORTS[1])


class _AnonymousPeak:
    """Peak anonymous RSS (resident less file-backed and shared pages, from
    ``/proc/self/statm``) above its value on entry, sampled every millisecond by a thread
    (torch's copies and file writes release the GIL)."""

    def __init__(self) -> None:
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.start = self.peak = self._sample()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _sample(self) -> int:
        with open("/proc/self/statm") as statm:
            resident, shared = (int(x) for x in statm.read().split()[1:3])
        return (resident - shared) * self.page

    def _watch(self) -> None:
        while not self._done.wait(0.001):
            self.peak = max(self.peak, self._sample())

    def __enter__(self) -> _AnonymousPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, self._sample())

    @property
    def growth_mib(self) -> float:
        return (self.peak - self.start) / MiB


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1])


def _child(operation: str, model: str, source: Path, out: Path, trace: bool) -> dict[str, Any]:
    """Run one operation in this (fresh) process and measure it: time and RSS, or (with
    ``trace``, whose dispatch mode slows every op) the peak of live tensor storage."""
    # Every module any operation uses is imported before the measurement starts.
    import safetensors.torch  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    from plugintrain.core.memory import LiveTensorMemory
    from plugintrain.formats import gguf, hf, llmc  # noqa: F401

    run = OPERATIONS[operation]
    if trace:
        with LiveTensorMemory() as mode:
            run(source, out, SOURCE_DTYPES[model])
        return {"tensor_mib": mode.peak_bytes / MiB}
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset the RSS high-water mark (and so ru_maxrss) to the RSS now
    start_kib = _rss_kib()
    start = time.perf_counter()
    with _AnonymousPeak() as anonymous:
        run(source, out, SOURCE_DTYPES[model])
    seconds = time.perf_counter() - start
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "seconds": seconds,
        "rss_mib": (peak_kib - start_kib) / 2**10,
        "anon_mib": anonymous.growth_mib,
    }


def _spawn(args: list[str]) -> dict[str, Any]:
    """Run this script with ``args`` in a fresh process; the JSON it prints last."""
    done = subprocess.run(
        [sys.executable, __file__, *args], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1]) if done.stdout else {}


def _measure(model: str, root: Path) -> dict[str, dict[str, Any]]:
    """Every operation on ``model``'s source, each in its own processes (one timed, one
    traced for ours), outputs removed after each."""
    source = root / model / "source"
    if not source.exists():
        _spawn(["--make-source", model, "--source", str(source)])
    results = {}
    for operation in IMPORTS + EXPORTS:
        if operation == EXPORTS[4] and TransformerConfig.from_name(model).family != "gpt2":
            continue  # llm.c runs GPT-2 only
        out = root / model / OUTPUTS.get(operation, "out")
        args = ["--child", operation, "--model", model, "--source", str(source), "--out", str(out)]
        results[operation] = {"tensor_mib": None}
        for extra in [[]] if operation in BASELINES else [[], ["--trace"]]:
            results[operation] |= _spawn(args + extra)
            _remove(out)
        print(f"{model} | {operation} | {results[operation]}", flush=True)
    return results


def _remove(out: Path) -> None:
    if out.is_dir():
        shutil.rmtree(out)
    else:
        out.unlink(missing_ok=True)


def _table(model: str, results: dict[str, dict[str, Any]]) -> str:
    lines = [
        f"{model} ({SOURCE_DTYPES[model]}, {_source_mib(model):.0f} MiB of weights)",
        "",
        "| operation | s | peak RSS growth MiB | of it anonymous MiB | tensor peak MiB"
        " | time vs baseline | RSS vs baseline | anonymous vs baseline |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for operation, r in results.items():
        base = results[BASELINES[0] if operation in IMPORTS else BASELINES[1]]
        tensors = "-" if r["tensor_mib"] is None else f"{r['tensor_mib']:.0f}"
        lines.append(
            f"| {operation} | {r['seconds']:.2f} | {r['rss_mib']:.0f} | {r['anon_mib']:.0f} |"
            f" {tensors} | {r['seconds'] / base['seconds']:.2f}x"
            f" | {r['rss_mib'] / base['rss_mib']:.2f}x | {r['anon_mib'] / base['anon_mib']:.2f}x |"
        )
    return "\n".join(lines)


def _source_mib(model: str) -> float:
    config = TransformerConfig.from_name(model)
    width = torch.empty((), dtype=SOURCE_DTYPES[model]).element_size()
    return sum(torch.Size(s).numel() for s in _hf_shapes(config).values()) * width / MiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(SOURCE_DTYPES), choices=SOURCE_DTYPES)
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument("--tmp", type=Path, help="where the temporary directory goes")
    parser.add_argument("--child", choices=OPERATIONS, help=argparse.SUPPRESS)
    parser.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--make-source", choices=SOURCE_DTYPES, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--source", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make_source:
        _make_source(args.make_source, args.source)
        return
    if args.child:
        print(json.dumps(_child(args.child, args.model, args.source, args.out, args.trace)))
        return
    print("$", " ".join(sys.argv))
    print(f"{os.cpu_count()} CPUs, torch {torch.__version__}, {sys.platform}\n", flush=True)
    root = Path(tempfile.mkdtemp(prefix="weights_io-", dir=args.tmp))
    try:
        tables = [_table(model, _measure(model, root)) for model in args.models]
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root)
    print("\n\n".join(["", *tables]))


if __name__ == "__main__":
    main()
