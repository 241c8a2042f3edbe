"""Weights from anywhere: the format detected from the path, a pretrained name fetched, our
own checkpoints (a LoRA run's merged into its base) read by the same names as a foreign
file's. What :class:`~plugintrain.model_zoo.CausalLM` starts from (its ``weights``)."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

from plugintrain.data.assets import PRETRAINED_MODELS, resolve_model_path
from plugintrain.formats.base import TensorReader, WeightFormatError, Weights, model_shapes
from plugintrain.formats.lora_checkpoints import MergedAdapterReader, check_named_base
from plugintrain.formats.registry import FORMATS, detect, weight_formats
from plugintrain.model_zoo.config import TransformerConfig
from plugintrain.model_zoo.lora import is_adapter_name
from plugintrain.model_zoo.weight_plans import renamed


def detect_format(path: Path) -> str:
    """The registered whole-model format (:func:`~plugintrain.formats.registry.
    weight_formats`: ``hf``, ``checkpoint``, ``gguf``, ``llmc``, ...) of what is at ``path``.

    Raises:
        WeightFormatError: If ``path`` is none of them.
    """

    if not path.exists():
        raise WeightFormatError(
            f"{path}: no such file or directory; pass the path of a model (a Hugging Face"
            f" directory, .bin, .gguf or checkpoint) or one of {list(PRETRAINED_MODELS)}."
        )
    found = detect(path)
    if found is None:
        kinds = "; ".join(FORMATS[name].what for name in weight_formats())
        raise WeightFormatError(
            f"{path}: not a weight file plugintrain reads; pass one of: {kinds}."
        )
    return found


def detect_adapters(path: Path) -> str | None:
    """The registered format holding a LoRA run's adapters alone (``peft``) that ``path``
    is; None if it is none of them (a LoRA run's checkpoint holds its adapters too)."""
    return detect(path, adapters=True)


def read_adapters(path: str | Path, config: TransformerConfig) -> tuple[Any, dict[str, Any]]:
    """The LoRA spec and adapter tensors (``layers.0.attention.wq.lora_A`` -> tensor) of
    the adapter at ``path``, in any registered adapter format, for a model of ``config``.

    Raises:
        WeightFormatError: If ``path`` is no adapter plugintrain reads, or not this model's.
    """
    kind = detect_adapters(Path(path))
    if kind is None:
        kinds = "; ".join(s.what for s in FORMATS.values() if s.read_adapters is not None)
        raise WeightFormatError(f"{path}: not a LoRA adapter plugintrain reads; pass {kinds}.")
    return FORMATS[kind].adapter_reader()(path, config)


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
    kind = FORMATS[detect_format(path)]
    if not kind.own_names:
        return Weights(_foreign_reader(kind.name, path.resolve(), path.stat().st_mtime_ns))
    reader = kind.reader()(path)
    if reader.lora is not None:
        return _merged_adapters(reader)
    held = set(reader.names())
    names = {n: n if n in held else _tied_alias(n) for n in model_shapes(reader.config)}
    return Weights(reader, renamed(names))


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

    return FORMATS[kind].reader()(path)


def resolve(spec: str | Path) -> Path:
    """The path of ``spec``: a pretrained name's fetched file, else ``spec`` itself."""

    return resolve_model_path(spec)


def _tied_alias(name: str) -> str:
    """A tied head saved once, under the embedding's name."""
    return "tok_embeddings.weight" if name == "output.weight" else name
