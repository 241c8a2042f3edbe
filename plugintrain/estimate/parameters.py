"""The model's parameters as the strategies cut them, built once on the meta device.

Names, shapes, tied weights and LoRA adapters are the real ones (the zoo's model with
LoRA put in as the LoRA callback does, a QLoRA base as the packed ``uint8`` parameters of
its :class:`~plugintrain.model_zoo.quantization.QuantizedWeight` layers, block scales and
padding included); each parameter is cut as the family's
tensor-parallel plan cuts it (a mixture of experts' stacked experts over ``ep``) and kept on
the pipeline stages that hold it. Nothing is allocated.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass

import torch

from plugintrain.core.contracts import TensorParallelExtras
from plugintrain.estimate.layout import Layout
from plugintrain.model_zoo.config import TransformerConfig
from plugintrain.model_zoo.families import tp_plan
from plugintrain.model_zoo.lora import LoRASpec, inject
from plugintrain.model_zoo.quantization import QuantizedWeight
from plugintrain.model_zoo.transformer import Transformer
from plugintrain.strategies.expert_parallel import expert_layers
from plugintrain.strategies.pipeline_stages import rank_stages, stage_layer_keys
from plugintrain.strategies.tensor_parallel import expand_plan


@dataclass(frozen=True)
class Param:
    """One parameter of the whole model (a tied weight once, with both places)."""

    index: int
    """Its place in ``named_parameters(remove_duplicate=False)``: the engine's order."""
    ident: int
    """The same for every name of one tied ``Parameter``."""
    name: str
    shape: tuple[int, ...]
    trainable: bool
    tp_dim: int | None
    """The dim tensor parallelism splits; None: replicated on every tp rank."""
    expert: bool
    """A stacked expert weight: expert parallelism splits its dim 0."""
    dtype: torch.dtype | None = None
    """A dtype no precision changes (a quantized weight's packed ``uint8`` bytes: the
    precision plugins and FSDP2's policy cast floating parameters only); None: the
    precision's."""
    packs: int = 0
    """For a quantized weight's packed bytes: the weights they hold (0: not packed)."""


def config_key(config: TransformerConfig) -> tuple:
    """The config's field values (hashable: the config itself is not), for the cache."""
    return tuple(getattr(config, f.name) for f in dataclasses.fields(config))


def layout_params(config: TransformerConfig, layout: Layout) -> tuple[Param, ...]:
    """:func:`model_params` of ``config`` with ``layout``'s adapters and plan."""
    return model_params(config_key(config), layout.lora, layout.dims.tp > 1)


@functools.lru_cache(maxsize=16)
def model_params(key: tuple, adapters: LoRASpec | None, tensor_parallel: bool) -> tuple[Param, ...]:
    """The zoo model's parameters, built on the meta device, with LoRA put in as the LoRA
    callback does, and the dim the family's tensor-parallel plan splits each along (the
    plan is read, as the strategies read it, only with ``tensor_parallel``)."""
    config = _config_from_key(key)
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        module = torch.nn.Module()  # what CausalLM trains: its transformer as `model`
        module.model = Transformer(config)
    if adapters is not None:
        inject(module, adapters)
    plan = {f"model.{pattern}": style for pattern, style in tp_plan(config).items()}
    styles = expand_plan(module, plan, False) if tensor_parallel else {}
    modules = dict(module.named_modules())
    experts = {f"{path}.experts" for path, _ in expert_layers(module)}
    idents: dict[int, int] = {}
    params = []
    for index, (name, param) in enumerate(module.named_parameters(remove_duplicate=False)):
        path, _, leaf = name.rpartition(".")
        dim = _tp_dim(modules[path], leaf, styles.get(path))
        ident = idents.setdefault(id(param), len(idents))
        shape, trains = tuple(param.shape), param.requires_grad
        fixed = None if param.dtype.is_floating_point else param.dtype
        packs = modules[path].numel() if isinstance(modules[path], QuantizedWeight) else 0
        expert = path in experts
        params.append(Param(index, ident, name, shape, trains, dim, expert, fixed, packs))
    return tuple(params)


def _config_from_key(key: tuple) -> TransformerConfig:
    fields = dict(zip([f.name for f in dataclasses.fields(TransformerConfig)], key, strict=True))
    return TransformerConfig.from_dict(fields)


def _tp_dim(module: torch.nn.Module, leaf: str, style: str | None) -> int | None:
    """The dim of ``module.<leaf>`` that ``style`` splits (torch's Colwise/RowwiseParallel:
    a Linear's weight on dim 0 / 1, its bias on 0 / not at all; an embedding's rows), or
    what a layer with extra parameters (a LoRA adapter) declares."""

    kind = {"colwise": "colwise", "vocab_head": "colwise", "rowwise": "rowwise"}.get(style or "")
    if style == "vocab_embedding":
        return 0
    if kind is None:
        return None
    if isinstance(module, TensorParallelExtras) and leaf in module.tp_placements(kind):
        return module.tp_placements(kind)[leaf]
    if leaf == "bias":
        return 0 if kind == "colwise" else None
    return 0 if kind == "colwise" else 1


def stage_of(name: str) -> int | str:
    """A parameter's place for the pipeline split: its block index, ``first`` or ``last``."""
    match = re.match(r"model\.layers\.(\d+)\.", name)
    if match:
        return int(match.group(1))
    first = name.startswith(("model.tok_embeddings.", "model.pos_embeddings."))
    return "first" if first else "last"


@dataclass(frozen=True)
class Local:
    """One parameter as a rank holds it: duck-types what ``assign_buckets`` reads of a
    tensor, so the estimate buckets with the engine's own code (no tensor is made)."""

    size: int
    dtype: torch.dtype
    trainable: bool
    shape: tuple[int, ...]
    expert: bool = False
    """Reduced over the ranks holding the same experts (dp / ep of them), not over dp."""
    block: int | None = None
    """The transformer block it belongs to (FSDP2's unit); None: outside the blocks."""

    def numel(self) -> int:
        return self.size

    def element_size(self) -> int:
        return self.dtype.itemsize


def stage_params(
    params: tuple[Param, ...], config: TransformerConfig, layout: Layout, pp_rank: int
) -> list[Local]:
    """The parameters pipeline rank ``pp_rank`` holds, in ``named_parameters`` order (a
    tied weight where it first appears on this rank), as one tp rank's shards."""

    stages = layout.dims.pp * layout.dims.vpp
    keys = stage_layer_keys(config.n_layer, stages, layout.pipeline.layers_per_stage)
    mine = rank_stages(pp_rank, layout.dims.pp, layout.dims.vpp)
    layers = {int(k) for s in mine for k in keys[s]}
    places = (
        layers | ({"first"} if 0 in mine else set()) | ({"last"} if stages - 1 in mine else set())
    )
    dtype = torch.bfloat16 if layout.precision == "bf16-true" else torch.float32
    held, seen = [], set()
    for p in params:
        if stage_of(p.name) not in places or p.ident in seen:
            continue
        seen.add(p.ident)
        shape = list(p.shape)
        if p.tp_dim is not None:
            shape[p.tp_dim] //= layout.dims.tp
        if p.expert:
            shape[0] //= layout.dims.ep
        block = stage_of(p.name)
        block = block if isinstance(block, int) else None
        dtype_held = p.dtype or dtype
        held.append(Local(math.prod(shape), dtype_held, p.trainable, tuple(shape), p.expert, block))
    return held
