"""plugintrain's own checkpoints as a weight source: a single ``.ckpt`` file (memory-mapped)
or a sharded DCP directory (read one tensor at a time, whatever layout wrote it)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from plugintrain.checkpoint_files import LIGHTNING_METADATA, load_torch_file
from plugintrain.formats.base import WeightFormatError
from plugintrain.lora import RECORD_KEY as LORA_RECORD
from plugintrain.model_zoo import CausalLM, TransformerConfig
from plugintrain.tensor_boxes import Box, select

PREFIX = "model."
"""``CausalLM`` holds its transformer as ``self.model``."""


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a checkpoint ``plugintrain fit`` wrote (file or DCP directory)."""
    if path.is_dir():
        return (path / LIGHTNING_METADATA).is_file() or (path / ".metadata").is_file()
    return path.is_file() and path.suffix == ".ckpt"


def config_from_hparams(hparams: dict[str, Any], where: Path) -> TransformerConfig:
    """The architecture a CausalLM checkpoint's hyperparameters describe."""
    config = hparams.get("config", "gpt2-debug")
    if isinstance(config, TransformerConfig):
        return config
    if isinstance(config, dict):
        return TransformerConfig.from_dict(config)
    if isinstance(config, str):
        return TransformerConfig.from_name(config)
    raise WeightFormatError(
        f"{where}: its hyper_parameters hold no model config: not a CausalLM checkpoint."
    )


def module_hparams(hparams: dict[str, Any]) -> dict[str, Any]:
    """The hyperparameters ``CausalLM`` accepts (LightningCLI adds its own entries), with
    the weights it was started from left out: the checkpoint holds newer ones."""
    accepted = inspect.signature(CausalLM).parameters
    return {k: v for k, v in hparams.items() if k in accepted and k != "weights"}


class CheckpointReader:
    """A CausalLM checkpoint's weights under our names (without the ``model.`` prefix).

    Args:
        path: A ``.ckpt`` file or a DCP checkpoint directory.
    """

    def __init__(self, path: Path) -> None:
        from plugintrain.strategies.checkpoint import ChunkByChunkReader, read_hparams

        self.path = path
        if path.is_dir():
            hparams = read_hparams(path)
            self.lora = load_torch_file(path / LIGHTNING_METADATA).get(LORA_RECORD)
            self._dcp = ChunkByChunkReader(path)
            saved = self._dcp.read_metadata().state_dict_metadata
            key = f"state_dict.{PREFIX}"
            self._shapes = {k[len(key) :]: (tuple(m.size), m.properties.dtype)
                            for k, m in saved.items() if k.startswith(key)}  # fmt: skip
            self._file = None
        else:
            checkpoint = load_torch_file(path, map_location="cpu", mmap=True)
            hparams = checkpoint.get("hyper_parameters", {})
            self.lora = checkpoint.get(LORA_RECORD)
            state = checkpoint.get("state_dict", {})
            self._file = {k[len(PREFIX) :]: v for k, v in state.items() if k.startswith(PREFIX)}
            self._shapes = {k: (tuple(v.shape), v.dtype) for k, v in self._file.items()}
        self.hparams = hparams
        self.config = config_from_hparams(hparams, path)
        self.tokenizer = self.config.tokenizer

    def names(self) -> list[str]:
        """Our tensor names."""
        return list(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of ``name``."""
        return self._shapes[name][0]

    def dtype(self, name: str) -> torch.dtype:
        """Type of ``name``."""
        return self._shapes[name][1]

    def read(self, name: str) -> Tensor:
        """Tensor ``name`` (only its own bytes are read)."""
        if self._file is not None:
            return self._file[name]
        shape = self._shapes[name][0]
        return self.read_box(name, ((0,) * len(shape), shape))

    def read_box(self, name: str, box: Box) -> Tensor:
        """The ``box`` of tensor ``name``: of a sharded checkpoint only the saved chunks
        that overlap it are read (an expert-parallel rank's experts, a tp rank's rows).
        Each process reads on its own, so ranks may read different tensors."""
        if self._file is not None:
            return select(self._file[name], box, (0,) * len(box[0]))
        from plugintrain.strategies.checkpoint import ShardBoxes, load_dcp

        shape, dtype = self._shapes[name]
        out = torch.empty(box[1], dtype=dtype)
        wanted = ShardBoxes(torch.Size(shape), [(torch.Size(box[0]), out)])
        load_dcp({"state_dict": {f"{PREFIX}{name}": wanted}}, self._dcp, alone=True)
        return out


class MergedAdapterReader:
    """An adapter checkpoint (a LoRA run's: adapters and other trained tensors only) as the
    whole model it describes: its base weights with every adapter merged in, one tensor
    at a time (``W + alpha / r * B A``, in fp32, stored in the base weight's dtype).

    Args:
        adapters: The adapter checkpoint.
        base: The base weights it names (checked against its sha256 by the caller).
    """

    def __init__(self, adapters: CheckpointReader, base: Any) -> None:
        from plugintrain.lora import LoRASpec

        self.path = adapters.path
        self.adapters, self.base = adapters, base
        self.config, self.tokenizer = base.config, base.tokenizer
        self.hparams = adapters.hparams
        spec = LoRASpec.from_record(adapters.lora["spec"])
        self.scaling = spec.alpha / spec.r
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
        weight = self.adapters.read(name) if name in self._held else self.base.read(name)
        stem = name.removesuffix(".weight")
        if f"{stem}.lora_A" not in self._held:
            return weight
        a, b = self.adapters.read(f"{stem}.lora_A"), self.adapters.read(f"{stem}.lora_B")
        return (weight.float() + (b.float() @ a.float()) * self.scaling).to(weight.dtype)
