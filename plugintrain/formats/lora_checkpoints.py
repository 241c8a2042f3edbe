"""LoRA adapter checkpoints on the file side: adapters put back into a model, the sha256
of the base weights an adapter checkpoint names (and the check against it), and an
adapter checkpoint read as the whole model it describes (its base with the adapters
merged, one tensor at a time). The layer itself is :mod:`plugintrain.model_zoo.lora`.

A QLoRA run (``quantize: nf4`` or ``int8``) trained its adapters on the base as it held
it: each adapted layer's frozen weight quantized, dequantized per matmul. Whatever reads
such a run back (a merged export, ``generate --adapter``) starts from that same base:
those weights quantized and dequantized again (:func:`fake_quantize_base`, the same
bytes, so the same values), then the adapters; nothing is held quantized, so they merge.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from plugintrain.data.assets import resolve_model_path
from plugintrain.formats.checkpoint import PREFIX, CheckpointReader
from plugintrain.model_zoo.lora import LoRASpec, adapted_layers, inject, kept_unquantized
from plugintrain.model_zoo.quantization import (
    QuantizedWeight,
    dequantize,
    fake_quantize,
    quantize,
)


def read_lora_run(path: str | Path, fix: str) -> tuple[CheckpointReader, LoRASpec]:
    """The reader of a LoRA run's checkpoint at ``path`` and its adapters' spec.

    Raises:
        ValueError: One line ending in ``fix``, if ``path`` holds a whole model instead.
    """
    reader = CheckpointReader(Path(path))
    if reader.lora is None:
        raise ValueError(f"{path} holds no LoRA adapters (a whole model's checkpoint); {fix}")
    return reader, LoRASpec.from_record(reader.lora["spec"])


@torch.no_grad()
def load_adapter(module: nn.Module, path: str | Path) -> LoRASpec:
    """Put the adapters of the adapter checkpoint at ``path`` (a LoRA run's ``.ckpt`` file
    or DCP directory) into ``module`` (the LightningModule holding the base model, its
    base weights loaded; unmerged), with the tensors the run trained; returns their spec.
    A QLoRA run's base is dequantized as it trained (:func:`inject_dequantized`). The
    caller checks the base (:func:`check_base`).

    Raises:
        ValueError: If ``path`` holds no adapters, or not those of this model.
    """

    reader, spec = read_lora_run(path, "pass it as the model's weights instead")
    inject_dequantized(module, spec)
    params = dict(module.named_parameters())
    saved = set(reader.names())
    missing = sorted(
        n for n, p in params.items() if p.requires_grad and n.removeprefix(PREFIX) not in saved
    )
    if missing:
        raise ValueError(
            f"{path} lacks {missing[0]} (and {len(missing) - 1} more) of the tensors its LoRA"
            " spec trains: a damaged checkpoint; pass the one its run wrote last"
        )
    for name in saved:
        params[f"{PREFIX}{name}"].copy_(reader.read(name))
    return spec


def inject_dequantized(module: nn.Module, spec: LoRASpec) -> list[str]:
    """:func:`~plugintrain.model_zoo.lora.inject` ``spec`` into ``module`` for inference:
    a QLoRA spec's base is not held quantized (the adapters could not merge into it), but
    fake-quantized in place (:func:`fake_quantize_base`), so the model computes what the
    run computed; returns the adapted paths."""
    adapted = inject(module, dataclasses.replace(spec, quantize=None))
    if spec.quantize is not None:
        fake_quantize_base(module, spec.quantize)
    return adapted


@torch.no_grad()
def fake_quantize_base(module: nn.Module, kind: str) -> list[str]:
    """Replace, in place, each adapted layer's base weight that a QLoRA run of ``kind``
    holds quantized by its values as that run computes with them (quantized, then
    dequantized in the weight's dtype); returns their layers' paths. The rule is
    :func:`~plugintrain.model_zoo.lora.quantize_frozen`'s: a frozen matrix the
    quantization's block divides (a weight that trains, or one of another size, is kept)."""
    done = []
    for path, layer in adapted_layers(module):
        weight = layer.weight
        if isinstance(weight, QuantizedWeight) or kept_unquantized(weight, kind) is not None:
            continue
        weight.copy_(fake_quantize(weight.detach(), kind))
        done.append(path)
    return done


_DIGESTS: dict[tuple, str] = {}


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".json", ".ckpt", ".pt", ".distcp", ".metadata")
"""What :func:`weights_sha256` reads of a directory: its weight, config and tokenizer files
(not a README, and nothing in subdirectories, such as a download tool's cache)."""


def weights_sha256(path: str | Path) -> str:
    """sha256 of a weights file, or of a directory's top-level weight, config and tokenizer
    files (:data:`WEIGHT_SUFFIXES`; each one's name, then its bytes, in sorted order): what
    an adapter checkpoint records of the base it was trained on. Remembered per process
    while no file changes.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
    """
    root = Path(path).resolve()
    if not root.exists():
        raise FileNotFoundError(f"{path}: no such file or directory (the LoRA base weights)")
    if root.is_file():
        files = [root]
    else:
        files = sorted(
            p for p in root.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)
        )
    key = (root, *((f, f.stat().st_size, f.stat().st_mtime_ns) for f in files))
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        for file in files:
            if file != root:
                digest.update(file.name.encode() + b"\0")
            with file.open("rb") as handle:
                while chunk := handle.read(1 << 23):
                    digest.update(chunk)
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]


def check_base(record: dict, base: str | None, digest: str, option: str | None) -> None:
    """Raise unless ``digest`` (of the base weights ``base``) is the sha256 that the adapter
    checkpoint's ``record`` was trained on; ``option`` is where the user names the base
    (``model.init_args.weights``, ``--weights``), None where only the record names it."""
    if record.get("sha256") is None:
        raise ValueError(
            f"the adapter checkpoint records no sha256 of its base {record.get('base')}; pass"
            " one written by a LoRA run of this plugintrain"
        )
    if record["sha256"] != digest:
        raise ValueError(
            f"the adapters were trained on base weights {record['base']} (sha256"
            f" {record['sha256'][:12]}...), but {base} has sha256 {digest[:12]}...; "
            + (
                f"set {option} to {record['base']}"
                if option is not None
                else f"put the base they were trained on back at {record['base']}"
            )
        )


def check_named_base(record: dict, base: str, option: str | None) -> None:
    """:func:`check_base` of the base weights ``base`` names (a path or a pretrained name,
    fetched on first use), hashed here."""
    check_base(record, base, weights_sha256(resolve_model_path(base)), option)


def spec_difference(record: dict, spec: LoRASpec) -> str | None:
    """The first field in which ``spec`` differs from the spec an adapter checkpoint's
    ``record`` was trained with, as ``field: saved (this run: value)``; None if none."""
    saved = LoRASpec.from_record(record["spec"]).record()
    for field, value in spec.record().items():
        if saved[field] != value:
            return f"{field}: {json.dumps(saved[field])} (this run: {json.dumps(value)})"
    return None


class MergedAdapterReader:
    """An adapter checkpoint (a LoRA run's: adapters and other trained tensors only) as the
    whole model it describes: its base weights with every adapter merged in, one tensor
    at a time (``W + alpha / r * B A``, in fp32, stored in the base weight's dtype). A
    QLoRA run's ``W`` is the base weight as the run held it: quantized and dequantized
    (:func:`~plugintrain.model_zoo.quantization.fake_quantize`), for each adapted layer
    whose frozen weight the quantization's block divides.

    Args:
        adapters: The adapter checkpoint.
        base: The base weights it names (checked against its sha256 by the caller).
    """

    def __init__(self, adapters: CheckpointReader, base: Any) -> None:

        self.path = adapters.path
        self.adapters, self.base = adapters, base
        self.config, self.tokenizer = base.config, base.tokenizer
        self.hparams = adapters.hparams
        spec = LoRASpec.from_record(adapters.lora["spec"])
        self.scaling, self.quantize = spec.alpha / spec.r, spec.quantize
        self._held = set(adapters.names())

    def names(self) -> list[str]:
        """Our tensor names: the base model's."""
        return self.base.names()

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of ``name``."""
        return self.base.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        """Type of ``name``: the trained tensor's, else the base's."""
        if name == "output.weight" and self.config.tie_embeddings:
            name = "tok_embeddings.weight"
        if name in self._held:
            return self.adapters.dtype(name)
        return self.base.reader.dtype(self.base.plan[name].sources[0])

    def read(self, name: str) -> Tensor:
        """Tensor ``name``: the run's (trained, or the base's), its adapter merged in."""
        if name == "output.weight" and self.config.tie_embeddings:
            name = "tok_embeddings.weight"  # one tensor, saved under the embedding's name
        trained = name in self._held
        weight = self.adapters.read(name) if trained else self.base.read(name)
        stem = name.removesuffix(".weight")
        if f"{stem}.lora_A" not in self._held:
            return weight
        dtype = weight.dtype
        held = self.quantize is not None and kept_unquantized(weight, self.quantize) is None
        if held and not trained:
            # Dequantized in fp32 and rounded to the stored dtype once, after the merge.
            packed = quantize(weight, self.quantize)
            weight = dequantize(packed, self.quantize, tuple(weight.shape), torch.float32)
        a, b = self.adapters.read(f"{stem}.lora_A"), self.adapters.read(f"{stem}.lora_B")
        return (weight.float() + (b.float() @ a.float()) * self.scaling).to(dtype)
