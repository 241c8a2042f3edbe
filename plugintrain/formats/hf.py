"""Hugging Face model directories: ``config.json`` plus safetensors (one file or sharded
with an index), read tensor by tensor from memory maps and written the same way.

Legacy ``pytorch_model.bin`` weights are read with ``torch.load(weights_only=True)``
(tensors and plain containers only), never unpickled freely.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from plugintrain.checkpoints.files import consecutive_groups, load_torch_file
from plugintrain.data.tokenizers.registry import TOKENIZER_NAMES, family_tokenizer, get_tokenizer
from plugintrain.formats.base import TORCH_DTYPES, WeightFormatError
from plugintrain.formats.safetensors_io import DTYPES, write_safetensors
from plugintrain.formats.tokenizer_files import write_hf_tokenizer
from plugintrain.model_zoo.families import FAMILIES, by_hf_model_type, family_of

CONFIG = "config.json"
SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
MAX_SHARD_BYTES = 5 * 2**30
"""Hugging Face's default shard size: larger exports are split, with an index."""


def is_hf_dir(path: Path) -> bool:
    """Whether ``path`` is a Hugging Face model directory."""
    return path.is_dir() and (path / CONFIG).is_file()


class HFReader:
    """The tensors of a Hugging Face model directory, by the model's state-dict names.

    Args:
        path: The directory (``config.json`` and the weights).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        hf_config = _read_json(path / CONFIG)
        model_type = hf_config.get("model_type")
        family = by_hf_model_type(model_type)
        if family is None:
            supported = sorted(spec.hf_model_type for spec in FAMILIES.values())
            raise WeightFormatError(
                f"{path / CONFIG}: model_type {model_type!r} is not supported; plugintrain"
                f" imports {supported}."
            )
        try:
            self.config = family.from_hf_config(hf_config, path.name)
        except (KeyError, TypeError, ValueError) as error:
            raise WeightFormatError(f"{path / CONFIG}: {error}") from None
        self.tokenizer = str(path) if (path / "tokenizer.json").is_file() else None
        self._normalize = family.hf_key
        self._open: dict[Path, Any] = {}
        self._files = self._locate()

    def _locate(self) -> dict[str, Path]:
        """Our (normalized) tensor name -> the file holding it."""
        if (self.path / INDEX).is_file():
            weight_map = _read_json(self.path / INDEX).get("weight_map", {})
            return {self._normalize(k): self.path / f for k, f in weight_map.items()}
        if (self.path / SAFETENSORS).is_file():
            return {
                self._normalize(k): self.path / SAFETENSORS
                for k in self._keys(self.path / SAFETENSORS)
            }
        if (self.path / TORCH_BIN).is_file():
            self._bin = load_torch_file(self.path / TORCH_BIN, map_location="cpu", mmap=True)
            return {self._normalize(k): self.path / TORCH_BIN for k in self._bin}
        raise WeightFormatError(
            f"{self.path}: no {SAFETENSORS}, {INDEX} or {TORCH_BIN} beside {CONFIG}; pass a"
            " directory written by save_pretrained (or `plugintrain export --format hf`)."
        )

    def release(self) -> None:
        """Close the open safetensors files (their memory maps); reopened on the next read."""
        self._open.clear()

    def _keys(self, file: Path) -> list[str]:
        return list(self._handle(file).keys())

    def _handle(self, file: Path) -> Any:
        if file not in self._open:
            if not file.is_file():
                raise WeightFormatError(f"{file}: missing, but {self.path / INDEX} names it.")
            try:
                self._open[file] = safe_open(str(file), framework="pt")
            except (SafetensorError, OSError) as error:
                raise WeightFormatError(
                    f"{file}: truncated or not a safetensors file ({error}); download or export"
                    " it again."
                ) from None
        return self._open[file]

    def names(self) -> list[str]:
        """Tensor names, as ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` /
        ``Qwen3ForCausalLM`` state dicts have them."""
        return list(self._files)

    def _raw_name(self, file: Path, name: str) -> str:
        """The name as stored (a ``GPT2Model`` file has no ``transformer.`` prefix)."""
        keys = self._bin if file.name == TORCH_BIN else self._handle(file).keys()
        return name if name in keys else name.removeprefix("transformer.")

    def dtype(self, name: str) -> torch.dtype:
        """Type of tensor ``name`` from the file's header."""
        file = self._files[name]
        if file.name == TORCH_BIN:
            return self._bin[self._raw_name(file, name)].dtype
        stored = self._handle(file).get_slice(self._raw_name(file, name)).get_dtype()
        return {code: dtype for dtype, code in DTYPES.items()}[stored]

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor ``name`` from the file's header."""
        file = self._files[name]
        if file.name == TORCH_BIN:
            return tuple(self._bin[self._raw_name(file, name)].shape)
        return tuple(self._handle(file).get_slice(self._raw_name(file, name)).get_shape())

    def read(self, name: str) -> Tensor:
        """Tensor ``name``."""
        file = self._files[name]
        if file.name == TORCH_BIN:
            return self._bin[self._raw_name(file, name)]
        return self._handle(file).get_tensor(self._raw_name(file, name))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise WeightFormatError(f"{path}: not readable JSON ({error}).") from None


def write_hf(weights: Any, out: Path, dtype: str, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Write ``weights`` (our names) as a Hugging Face model directory ``out`` (which must
    not exist yet) in ``dtype`` (``float32``, ``bfloat16`` or ``float16``):
    ``config.json``, safetensors shards of at most ``max_shard_bytes`` (with an index when
    there are several) and the tokenizer files of the tokenizer the model reads
    (:func:`write_hf_tokenizer`: ``AutoTokenizer`` gives plugintrain's ids). Tensors are
    built and written one at a time."""
    torch_dtype = TORCH_DTYPES[dtype]
    family = family_of(weights.config)
    spec = weights.tokenizer or family_tokenizer(weights.config.family)
    if spec is not None and spec in TOKENIZER_NAMES:  # a debug model's smaller vocabulary
        spec = spec if get_tokenizer(spec).vocab_size <= weights.config.vocab_size else None
    tokenizer = _tokenizer(spec)  # resolved before anything is written
    plan = family.hf_export_plan(weights.config)
    shapes = {name: _planned_shape(weights, rule) for name, rule in plan.items()}

    last: dict[str, Tensor] = {}  # the source read last: one stacked expert tensor feeds
    # its experts' consecutive outputs, so it is read once, not once per expert

    def read(name: str) -> Tensor:
        rule = plan[name]
        return rule.build(*(source_of(source) for source in rule.sources))

    def source_of(source: str) -> Tensor:
        if source not in last:
            last.clear()
            last[source] = weights.read(source)
        return last[source]

    width = torch.empty((), dtype=torch_dtype).element_size()
    nbytes = {name: math.prod(shape) * width for name, shape in shapes.items()}
    out.mkdir(parents=True)
    shards = consecutive_groups(shapes, nbytes.__getitem__, max_shard_bytes)
    weight_map = {}
    for i, names in enumerate(shards):
        file = (
            SAFETENSORS
            if len(shards) == 1
            else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        with open(out / file, "wb") as stream:
            write_safetensors(stream, ((n, shapes[n]) for n in names), torch_dtype, read)
        weight_map.update(dict.fromkeys(names, file))
    if len(shards) > 1:
        metadata = {"total_size": sum(nbytes.values())}
        _write_json(out / INDEX, {"metadata": metadata, "weight_map": weight_map})
    hf_config = {
        **family.to_hf_config(weights.config),
        "torch_dtype": dtype,
    }
    if tokenizer is not None:
        hf_config |= {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
    _write_json(out / CONFIG, hf_config)
    if tokenizer is not None:
        write_hf_tokenizer(spec, tokenizer, out, weights.config.block_size)


def _planned_shape(weights: Any, rule: Any) -> tuple[int, ...]:
    sources = (torch.empty(weights.shape(s), device="meta") for s in rule.sources)
    return tuple(rule.build(*sources).shape)


def _tokenizer(spec: str | None) -> Any:
    """The tokenizer the weights came with (None when they name none)."""

    return None if spec is None else get_tokenizer(spec)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
