"""llm.c GPT-2 model files (``gpt2_124M.bin``, ``gpt2_124M_bf16.bin``).

A header of 256 int32 (magic 20240326, version 3 for fp32 or 5 for bf16, then max
sequence length, vocabulary size V, layers L, heads, channels C and the padded vocabulary
Vp), then every parameter kind stacked across layers in a fixed order, Linear weights as
``(out, in)`` (llm.c's ``train_gpt2.py`` ``write_model``). The token embedding has Vp
rows: the padding rows are zeros and never read. llm.c ties the head to the embedding.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from torch import Tensor

from plugintrain.formats.base import TORCH_DTYPES, WeightFormatError
from plugintrain.model_zoo import gpt2
from plugintrain.model_zoo.config import TransformerConfig

MAGIC = 20240326
VERSIONS = {3: torch.float32, 5: torch.bfloat16}
HEADER_INTS = 256
PAD_VOCAB_TO = 128

_LAYER_KINDS = (
    # (llm.c kind, Hugging Face GPT-2 name inside block i, per-layer shape, transposed in HF)
    ("ln1w", "ln_1.weight", lambda c: (c,), False),
    ("ln1b", "ln_1.bias", lambda c: (c,), False),
    ("qkvw", "attn.c_attn.weight", lambda c: (3 * c, c), True),
    ("qkvb", "attn.c_attn.bias", lambda c: (3 * c,), False),
    ("attprojw", "attn.c_proj.weight", lambda c: (c, c), True),
    ("attprojb", "attn.c_proj.bias", lambda c: (c,), False),
    ("ln2w", "ln_2.weight", lambda c: (c,), False),
    ("ln2b", "ln_2.bias", lambda c: (c,), False),
    ("fcw", "mlp.c_fc.weight", lambda c: (4 * c, c), True),
    ("fcb", "mlp.c_fc.bias", lambda c: (4 * c,), False),
    ("fcprojw", "mlp.c_proj.weight", lambda c: (c, 4 * c), True),
    ("fcprojb", "mlp.c_proj.bias", lambda c: (c,), False),
)


def is_llmc_file(path: Path) -> bool:
    """Whether ``path`` starts with llm.c's model magic."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        head = f.read(4)
    return len(head) == 4 and int.from_bytes(head, "little") == MAGIC


def _padded(vocab_size: int) -> int:
    return math.ceil(vocab_size / PAD_VOCAB_TO) * PAD_VOCAB_TO


class LlmcReader:
    """An llm.c model file's tensors under Hugging Face ``GPT2LMHeadModel`` names and
    layouts (views of one memory map; nothing is read until used).

    Args:
        path: The ``.bin`` file.
    """

    tokenizer = "gpt2"

    def __init__(self, path: Path) -> None:
        self.path = path
        header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
        if header.size < HEADER_INTS or header[0] != MAGIC:
            found = int(header[0]) if header.size else None
            raise WeightFormatError(
                f"{path}: not an llm.c model file (magic {found}, expected {MAGIC}); token"
                " files (magic 20240520) hold data, not weights."
            )
        version = int(header[1])
        if version not in VERSIONS:
            raise WeightFormatError(
                f"{path}: llm.c model version {version} is not supported; plugintrain reads"
                " version 3 (fp32) and 5 (bf16): re-export it with llm.c's train_gpt2.py."
            )
        max_t, vocab, layers, heads, channels, padded = (int(x) for x in header[2:8])
        self.stored_dtype = VERSIONS[version]
        hf_config = {
            "vocab_size": vocab,
            "n_positions": max_t,
            "n_layer": layers,
            "n_head": heads,
            "n_embd": channels,
            "tie_word_embeddings": True,
        }
        self.config = gpt2.from_hf_config(hf_config, path.stem)
        self._tensors = self._map(padded)

    def _map(self, padded: int) -> dict[str, Tensor]:
        """Hugging Face name -> view of the memory map."""
        c, layers = self.config.n_embd, self.config.n_layer
        shapes = {"wte": (padded, c), "wpe": (self.config.block_size, c)}
        shapes |= {kind: (layers, *shape(c)) for kind, _, shape, _ in _LAYER_KINDS}
        shapes |= {"lnfw": (c,), "lnfb": (c,)}
        width = torch.empty((), dtype=self.stored_dtype).element_size()
        needed = HEADER_INTS * 4 + sum(math.prod(s) for s in shapes.values()) * width
        size = self.path.stat().st_size
        if size < needed:
            raise WeightFormatError(
                f"{self.path}: truncated: {size} bytes, but its header describes {needed};"
                " copy or export the file again."
            )
        stored = np.uint16 if width == 2 else np.float32
        raw = np.memmap(self.path, dtype=stored, mode="r", offset=HEADER_INTS * 4)
        with warnings.catch_warnings():  # a read-only map: torch warns, and never writes it
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(raw)
        if width == 2:
            flat = flat.view(torch.bfloat16)
        kinds, start = {}, 0
        for kind, shape in shapes.items():
            kinds[kind] = flat[start : start + math.prod(shape)].view(shape)
            start += math.prod(shape)
        return self._hf_names(kinds)

    def _hf_names(self, kinds: dict[str, Tensor]) -> dict[str, Tensor]:
        hf = "transformer."
        tensors = {
            f"{hf}wte.weight": kinds["wte"][: self.config.vocab_size],
            f"{hf}wpe.weight": kinds["wpe"],
            f"{hf}ln_f.weight": kinds["lnfw"],
            f"{hf}ln_f.bias": kinds["lnfb"],
        }
        for i in range(self.config.n_layer):
            for kind, name, _, transpose in _LAYER_KINDS:
                tensors[f"{hf}h.{i}.{name}"] = kinds[kind][i].t() if transpose else kinds[kind][i]
        return tensors

    def names(self) -> list[str]:
        """Hugging Face GPT-2 tensor names."""
        return list(self._tensors)

    def dtype(self, name: str) -> torch.dtype:
        """fp32 (version 3) or bf16 (version 5)."""
        return self._tensors[name].dtype

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of ``name``."""
        return tuple(self._tensors[name].shape)

    def read(self, name: str) -> Tensor:
        """Tensor ``name`` (a copy: the map is read-only)."""
        return self._tensors[name].clone()


def write_llmc(weights: Any, out: Path, dtype: str) -> None:
    """Write ``weights`` (our names; a GPT-2 with a tied head) as an llm.c model file in
    ``dtype`` (``float32`` or ``bfloat16``).

    Raises:
        WeightFormatError: For a model llm.c cannot run (not GPT-2, untied head, FFN width
            other than 4C) or a dtype other than fp32/bf16.
    """
    config = weights.config
    torch_dtype = TORCH_DTYPES.get(dtype)
    version = {v: k for k, v in VERSIONS.items()}.get(torch_dtype)
    problems = {
        "family": config.family if config.family != gpt2.SPEC.name else None,
        "tie_embeddings": None if config.tie_embeddings else False,
        "intermediate_size": config.ffn_dim if config.ffn_dim != 4 * config.n_embd else None,
        "dtype": None if version else dtype,
    }
    bad = {k: v for k, v in problems.items() if v is not None}
    if bad:
        raise WeightFormatError(
            f"llm.c files hold GPT-2 models with a tied head, a 4C feed-forward and fp32 or"
            f" bf16 weights; {config.name} has {bad}: export it with --format hf or gguf."
        )
    plan = gpt2.hf_export_plan(config)

    def read(name: str) -> Tensor:
        rule = plan[name]
        return rule.build(*(weights.read(s) for s in rule.sources)).to(torch_dtype)

    with open(out, "wb") as stream:
        _write_header(stream, config, version)
        _write_tensors(stream, read, config)


def _write_header(stream: IO[bytes], config: TransformerConfig, version: int) -> None:
    header = np.zeros(HEADER_INTS, dtype="<i4")
    shape = (config.block_size, config.vocab_size, config.n_layer, config.n_head, config.n_embd)
    header[:8] = (MAGIC, version, *shape, _padded(config.vocab_size))
    stream.write(header.tobytes())


def _write_tensors(stream: IO[bytes], read: Any, config: TransformerConfig) -> None:
    """llm.c's order: wte (padded with zero rows), wpe, each layer kind for every layer,
    then the final norm; one layer's tensor in memory at a time."""
    hf = "transformer."
    wte = read(f"{hf}wte.weight")
    padding = _padded(config.vocab_size) - config.vocab_size
    _write(stream, torch.cat([wte, wte.new_zeros(padding, wte.size(1))]))
    del wte
    _write(stream, read(f"{hf}wpe.weight"))
    for _, name, _, transpose in _LAYER_KINDS:
        for i in range(config.n_layer):
            tensor = read(f"{hf}h.{i}.{name}")
            _write(stream, tensor.t() if transpose else tensor)
    _write(stream, read(f"{hf}ln_f.weight"))
    _write(stream, read(f"{hf}ln_f.bias"))


def _write(stream: IO[bytes], tensor: Tensor) -> None:
    stream.write(tensor.contiguous().view(-1).view(torch.uint8).numpy().data)
