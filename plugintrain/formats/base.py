"""What every weight format reader gives, and loading it into a model of any layout.

A format reader (:class:`TensorReader`) exposes a file's tensors under the names and
layouts of the matching Hugging Face model (the lingua franca: llm.c and GGUF readers
translate to it), read one at a time from a memory map. :class:`Weights` turns a reader
into our tensor names through the family's import plan; :func:`load_into` copies them into
a model that may be a pipeline stage or hold DTensor shards: each rank reads one tensor
at a time (of stacked experts, only the ones it holds) and keeps only its own box of it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from plugintrain.checkpoints.files import shape_mismatch
from plugintrain.core.tensor_boxes import Box, local_box, select
from plugintrain.model_zoo.config import TransformerConfig
from plugintrain.model_zoo.families import family_of
from plugintrain.model_zoo.lora import is_adapter_name, quantized_weights
from plugintrain.model_zoo.transformer import Transformer
from plugintrain.model_zoo.weight_plans import Plan

IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")
"""Buffers some Hugging Face checkpoints hold that are derived, not learned."""
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The floating-point weight types by the names ``--dtype`` and the registry use."""


class WeightFormatError(ValueError):
    """A weight file that cannot be read as the model it claims to be (one-line message)."""


@runtime_checkable
class TensorReader(Protocol):
    """A weight file's tensors, named and laid out as in the matching Hugging Face model."""

    path: Path
    config: TransformerConfig
    """The architecture the file describes."""
    tokenizer: str | None
    """The tokenizer that ships with the weights (a path), if any."""

    def names(self) -> list[str]:
        """The tensors the file holds."""
        ...

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name`` (without reading it)."""
        ...

    def dtype(self, name: str) -> torch.dtype:
        """The type :meth:`read` returns tensor ``name`` in (without reading it)."""
        ...

    def read(self, name: str) -> Tensor:
        """Tensor ``name`` on the CPU (a memory-mapped view where the format allows)."""
        ...


class Weights:
    """A model's tensors under our names, from any source: a foreign format's reader through
    the family's Hugging Face import plan, or one of our checkpoints (a plan of renames).

    Args:
        reader: The file.
        plan: Our tensor name -> how it is built from the reader's tensors; None means the
            family's Hugging Face import plan.
    """

    def __init__(self, reader: TensorReader, plan: Plan | None = None) -> None:
        self.reader = reader
        self.config = reader.config
        self.tokenizer = reader.tokenizer
        self.plan = (
            plan if plan is not None else family_of(reader.config).hf_import_plan(reader.config)
        )

    @property
    def path(self) -> Path:
        """The file or directory read."""
        return self.reader.path

    def check_architecture(self, config: TransformerConfig) -> None:
        """See :func:`check_architecture`."""
        check_architecture(config, self)

    def load_into(self, model: nn.Module, config: TransformerConfig | None = None) -> None:
        """See :func:`load_into`. Then lets go of the file's memory maps (a reader that has
        them reopens them on its next read): pages of a mapped file count in the resident
        memory while they stay mapped, a second copy of the model beside the loaded one."""
        load_into(model, self, config)
        release = getattr(self.reader, "release", None)
        if release is not None:
            release()

    def names(self) -> list[str]:
        """Our tensor names, in the model's order."""
        return list(self.plan)

    def read(self, name: str) -> Tensor:
        """Our tensor ``name``, built from the file's (one output tensor in memory at a time)."""
        rule = self.plan[name]
        return rule.build(*(self.reader.read(source) for source in rule.sources))

    def read_box(self, name: str, box: Box) -> Tensor:
        """The ``box`` of our tensor ``name``, reading only the sources it needs where the
        plan says how the tensor lies in them: a stacked expert tensor's box reads and
        stacks only the experts whose rows it covers (an expert-parallel rank never holds
        all of a layer's experts at once); other tensors are built whole (a memory-mapped
        view where the format allows) and the box is cut from them."""
        rule = self.plan[name]
        if rule.layout == "same":
            return self._source_box(rule.sources[0], box)
        if rule.layout != "stack":
            return select(self.read(name), box, (0,) * len(box[0]))
        (first, *offsets), (rows, *sizes) = box
        inner = (tuple(offsets), tuple(sizes))
        out = torch.empty((rows, *sizes), dtype=self.reader.dtype(rule.sources[0]))
        for row, source in enumerate(rule.sources[first : first + rows]):
            out[row].copy_(self._source_box(source, inner))
        return out

    def _source_box(self, source: str, box: Box) -> Tensor:
        """The ``box`` of the reader's tensor ``source``: read alone where the reader can
        (a sharded checkpoint), else cut from the whole (a memory-mapped view)."""
        if hasattr(self.reader, "read_box"):
            return self.reader.read_box(source, box)
        return select(self.reader.read(source), box, (0,) * len(box[0]))

    def shape(self, name: str) -> tuple[int, ...]:
        """Our tensor ``name``'s shape, worked out on the meta device (nothing is read)."""
        rule = self.plan[name]
        sources = (torch.empty(self.reader.shape(s), device="meta") for s in rule.sources)
        return tuple(rule.build(*sources).shape)

    def check(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Raise a one-line :class:`WeightFormatError` unless the file holds exactly the
        tensors of a model whose tensor shapes are ``expected`` (missing and unexpected
        tensors listed, a wrong shape named with both shapes)."""
        unplanned = [name for name in expected if name not in self.plan]
        if unplanned:
            raise WeightFormatError(
                f"{self.path}: holds no {_listed(unplanned)} of the model being built; leave"
                " the model's config unset to build the architecture the file holds."
            )
        held = set(self.reader.names())
        needed = {s for name in expected for s in self.plan[name].sources}
        missing = sorted(needed - held)
        # A tied head saved anyway (as `state_dict()` does) is the embedding under its name.
        aliases = {"lm_head.weight"} if self.config.tie_embeddings else set()
        extra = held - needed - aliases
        unexpected = sorted(n for n in extra if not n.endswith(IGNORED_SUFFIXES))
        if missing or unexpected:
            raise WeightFormatError(
                f"{self.path}: does not hold the weights of {self.config.name}:"
                f" missing {_listed(missing)}, unexpected {_listed(unexpected)}; pass the"
                " model's whole checkpoint, and a config that matches it (or none)."
            )
        for name, shape in expected.items():
            if self.shape(name) != shape:
                sources = ", ".join(self.plan[name].sources)
                label = name if sources == name else f"{sources} (as {name})"
                raise shape_mismatch(self.path, label, self.shape(name), shape)


def _listed(names: list[str], limit: int = 6) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{len(names)} ({', '.join(names[:limit])}{more})"


def model_shapes(config: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the whole model ``config`` describes, with its shape (built on the
    meta device: nothing is allocated)."""
    with torch.device("meta"):
        model = Transformer(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


@torch.no_grad()
def load_into(model: nn.Module, weights: Weights, config: TransformerConfig | None = None) -> None:
    """Copy ``weights`` into ``model``: a whole :class:`Transformer` of ``config`` (default:
    the file's), a pipeline stage of one, or one holding DTensor shards (tp, FSDP2). Each
    tensor this rank holds is read once and only its local box is copied (a tied pair is
    one tensor, written once); a stacked expert tensor reads only the experts in the box
    (:meth:`Weights.read_box`). LoRA adapters in ``model`` are left alone; a base weight
    held quantized (QLoRA) is read whole and quantized as it arrives, one at a time, each
    rank keeping its shard of the packed bytes.

    Raises:
        WeightFormatError: Before anything is copied, if the file does not hold exactly the
            tensors of the whole model ``config`` describes.
        ValueError: On a shape mismatch (both shapes named).
    """
    weights.check(model_shapes(config or weights.config))
    seen: set[int] = set()
    for name, quantized in quantized_weights(model):  # QLoRA: quantized as they are read
        quantized.quantize_(weights.read(name))
        seen.add(id(quantized.packed))
    for name, param in model.state_dict(keep_vars=True).items():
        if id(param) in seen or is_adapter_name(name):  # adapters are not the base's
            continue
        seen.add(id(param))
        local, box = local_box(param)
        local.copy_(weights.read_box(name, box))


ARCHITECTURE_FIELDS = ("family", "vocab_size", "n_layer", "n_head", "kv_heads", "n_embd",
                       "head_dim", "ffn_dim", "bias", "norm", "mlp", "position", "rope_theta",
                       "rope_scaling", "qk_norm", "tie_embeddings", "attention", "mla",
                       "moe")  # fmt: skip
"""What must agree between a model's config and the weights loaded into it. The rest a run
may choose: ``dropout``, a RoPE model's ``block_size`` (a learned position table's size is
checked as a shape when the weights load), and how a mixture of experts is trained
(:data:`MOE_TRAINING_FIELDS`). Routing settings that leave every shape alone (``top_k``,
``score_func``, groups, scaling) are architecture: other values compute another function."""

MOE_TRAINING_FIELDS = {"bias_update_rate": 0.0, "aux_loss_coeff": 0.0, "capacity_factor": None}
"""``MoEConfig`` fields a run may set apart from the weights' (with their neutral values)."""


def _architecture(config: TransformerConfig, field: str) -> object:
    """``config``'s ``field``, a mixture of experts without its training settings."""
    value = getattr(config, field)
    if field == "moe" and value is not None:
        return dataclasses.replace(value, **MOE_TRAINING_FIELDS)
    return value


def check_architecture(model: TransformerConfig, weights: Weights) -> None:
    """Raise a one-line :class:`WeightFormatError` naming each field in which ``model``
    differs from the architecture the weights file holds."""
    held = weights.config
    differ = [f for f in ARCHITECTURE_FIELDS if _architecture(model, f) != _architecture(held, f)]
    if differ:
        values = [(f, _architecture(held, f), _architecture(model, f)) for f in differ]
        both = ", ".join(f"{f}={theirs!r} (config: {ours!r})" for f, theirs, ours in values)
        raise WeightFormatError(
            f"{weights.path}: holds a model with {both}; leave the model's config unset to"
            " build the architecture the file holds."
        )
