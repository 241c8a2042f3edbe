"""plugintrain's own checkpoints as a weight source: a single ``.ckpt`` file (memory-mapped)
or a sharded DCP directory (read one tensor at a time, whatever layout wrote it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from plugintrain.checkpoints.dcp import ChunkByChunkReader, ShardBoxes, load_dcp, read_hparams
from plugintrain.checkpoints.files import LIGHTNING_METADATA, load_torch_file
from plugintrain.core.tensor_boxes import Box, select
from plugintrain.formats.base import WeightFormatError
from plugintrain.formats.model_card import RUN_RECORD_KEY
from plugintrain.model_zoo import TransformerConfig
from plugintrain.model_zoo.lora import RECORD_KEY as LORA_RECORD

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


class CheckpointReader:
    """A CausalLM checkpoint's weights under our names (without the ``model.`` prefix),
    its hyperparameters, a LoRA run's record (``lora``) and the run's record (``run``, what
    a model card tells; None in a checkpoint of an older plugintrain).

    Args:
        path: A ``.ckpt`` file or a DCP checkpoint directory.
    """

    def __init__(self, path: Path) -> None:

        self.path = path
        if path.is_dir():
            hparams = read_hparams(path)
            metadata = load_torch_file(path / LIGHTNING_METADATA)
            self.lora, self.run = metadata.get(LORA_RECORD), metadata.get(RUN_RECORD_KEY)
            self._dcp = ChunkByChunkReader(path)
            saved = self._dcp.read_metadata().state_dict_metadata
            key = f"state_dict.{PREFIX}"
            self._shapes = {
                k[len(key) :]: (tuple(m.size), m.properties.dtype)
                for k, m in saved.items()
                if k.startswith(key)
            }
            self._file = None
        else:
            checkpoint = load_torch_file(path, map_location="cpu", mmap=True)
            hparams = checkpoint.get("hyper_parameters", {})
            self.lora, self.run = checkpoint.get(LORA_RECORD), checkpoint.get(RUN_RECORD_KEY)
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

        shape, dtype = self._shapes[name]
        out = torch.empty(box[1], dtype=dtype)
        wanted = ShardBoxes(torch.Size(shape), [(torch.Size(box[0]), out)])
        load_dcp({"state_dict": {f"{PREFIX}{name}": wanted}}, self._dcp, alone=True)
        return out
