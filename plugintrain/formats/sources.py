"""Weights from anywhere: the format detected from the path, a pretrained name fetched, our
own checkpoints (a LoRA run's merged into its base) read by the same names as a foreign
file's. What :class:`~plugintrain.model_zoo.CausalLM` starts from (its ``weights``)."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

from plugintrain.data.assets import PRETRAINED_MODELS, resolve_model_path
from plugintrain.data.tokenizers.gguf_metadata import is_gguf
from plugintrain.formats import checkpoint, gguf_file, hf, llmc
from plugintrain.formats.base import TensorReader, WeightFormatError, Weights, model_shapes
from plugintrain.formats.lora_checkpoints import MergedAdapterReader, check_named_base
from plugintrain.model_zoo.lora import is_adapter_name
from plugintrain.model_zoo.weight_plans import renamed


def detect_format(path: Path) -> str:
    """``checkpoint``, ``hf``, ``llmc`` or ``gguf``, from what is at ``path``.

    Raises:
        WeightFormatError: If ``path`` is none of them.
    """

    if not path.exists():
        raise WeightFormatError(
            f"{path}: no such file or directory; pass the path of a model (a Hugging Face"
            f" directory, .bin, .gguf or checkpoint) or one of {list(PRETRAINED_MODELS)}."
        )
    for name, test in (
        ("hf", hf.is_hf_dir),
        ("checkpoint", checkpoint.is_checkpoint),
        ("gguf", is_gguf),
        ("llmc", llmc.is_llmc_file),
    ):
        if test(path):
            return name
    raise WeightFormatError(
        f"{path}: not a weight file plugintrain reads; pass a Hugging Face model directory"
        " (config.json + safetensors), an llm.c model .bin, a .gguf file, a .ckpt or a"
        " checkpoint directory written by `plugintrain fit`."
    )


def open_pretrained(source: str) -> Weights:
    """:func:`open_weights`, with a config naming the tokenizer that came with the weights
    (a pretrained name's own): what :class:`~plugintrain.model_zoo.CausalLM` starts from,
    through :mod:`plugintrain.core.pretrained`."""
    weights = open_weights(source)
    tokenizer = source if source in PRETRAINED_MODELS else weights.tokenizer
    weights.config = dataclasses.replace(weights.config, tokenizer=tokenizer)
    return weights


def open_weights(spec: str | Path) -> Weights:
    """The weights at ``spec`` (a path, or a pretrained name such as ``smollm2-135m``,
    fetched and checked on first use) under our tensor names, with their architecture.

    Raises:
        WeightFormatError: If the file is not a supported format or is damaged.
    """

    path = resolve(spec)
    kind = detect_format(path)
    if kind == "checkpoint":
        reader = checkpoint.CheckpointReader(path)
        if reader.lora is not None:
            return _merged_adapters(reader)
        held = set(reader.names())
        names = {n: n if n in held else _tied_alias(n) for n in model_shapes(reader.config)}
        return Weights(reader, renamed(names))
    return Weights(_foreign_reader(kind, path.resolve(), path.stat().st_mtime_ns))


def _merged_adapters(adapters: Any) -> Weights:
    """A LoRA run's checkpoint as the whole model: its base (checked by sha256; the
    checkpoint's own tensors for a base trained from scratch) with the adapters merged,
    tensor by tensor."""

    record = adapters.lora
    if record["base"] is None:  # the checkpoint holds every weight itself
        held = {n for n in adapters.names() if not is_adapter_name(n)}
        names = {n: n if n in held else _tied_alias(n) for n in model_shapes(adapters.config)}
        base = Weights(adapters, renamed(names))
    else:
        check_named_base(record, record["base"], option=None)
        base = open_weights(record["base"])
    merged = MergedAdapterReader(adapters, base)
    return Weights(merged, renamed({name: name for name in base.names()}))


@functools.lru_cache(maxsize=4)
def _foreign_reader(kind: str, path: Path, mtime_ns: int) -> TensorReader:
    """One reader per file version and process: a model is opened for its config, then for
    its weights, and a reader's memory maps and parsed header serve both."""

    readers = {"hf": hf.HFReader, "gguf": gguf_file.GGUFFileReader, "llmc": llmc.LlmcReader}
    return readers[kind](path)


def resolve(spec: str | Path) -> Path:
    """The path of ``spec``: a pretrained name's fetched file, else ``spec`` itself."""

    return resolve_model_path(spec)


def _tied_alias(name: str) -> str:
    """A tied head saved once, under the embedding's name."""
    return "tok_embeddings.weight" if name == "output.weight" else name
