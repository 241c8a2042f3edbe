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
from plugintrain.model_zoo import CausalLM, TransformerConfig

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
            self._dcp = ChunkByChunkReader(path)
            saved = self._dcp.read_metadata().state_dict_metadata
            key = f"state_dict.{PREFIX}"
            self._shapes = {k[len(key) :]: (tuple(m.size), m.properties.dtype)
                            for k, m in saved.items() if k.startswith(key)}  # fmt: skip
            self._file = None
        else:
            checkpoint = load_torch_file(path, map_location="cpu", mmap=True)
            hparams = checkpoint.get("hyper_parameters", {})
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
        from plugintrain.strategies.checkpoint import load_dcp

        shape, dtype = self._shapes[name]
        state = {"state_dict": {f"{PREFIX}{name}": torch.empty(shape, dtype=dtype)}}
        load_dcp(state, self._dcp)
        return state["state_dict"][f"{PREFIX}{name}"]
