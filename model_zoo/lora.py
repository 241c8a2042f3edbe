"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"): a frozen
Linear layer plus a trainable low-rank update, ``y = x W^T + b + (alpha / r) x A^T B^T``.

Model-side code only: :class:`LoRALinear`, putting adapters into a module
(:func:`inject`), initializing them shard by shard (:func:`init_adapters`), merging them
into the base weights and back (:func:`merge`, :func:`unmerge`), and the fingerprint of
the base weights an adapter checkpoint names (:func:`weights_sha256`). The Lightning side
is :class:`plugintrain.callbacks.LoRA`.

Every operation is written on the layer's own tensors, so it runs unchanged on a
tensor-parallel shard: :meth:`LoRALinear.tp_placements` tells the strategy to split the
adapter with its base layer (column-wise base: ``A`` replicated, ``B`` split over the
output; row-wise base: ``A`` split over the input, ``B`` replicated), the adapter's
partial output is added inside the layer, before its one all-reduce or reduce-scatter,
and a merge adds ``B_local A_local`` to the local weight shard: nothing is gathered.

Adapters on layers that a module calls on one tensor (``wq``, ``wk`` and ``wv`` of an
attention, ``w1`` and ``w3`` of a gated MLP: :data:`SHARED_INPUT_LAYERS`) share the work on
that tensor (:class:`SharedInput`): one dropout mask, one matmul with their ``A`` stacked,
a ``B`` each. Each adapter keeps its own parameters, names and math, ``y = x W^T + b +
(alpha / r) dropout(x) A^T B^T``; only the mask is common to them, as in LitGPT's fused
``qkv`` and in PEFT on a fused projection (issue 28: a mask per adapter, three of them
on q, k and v's one input, were 17.6% of a SmolLM2 LoRA step on the CPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import math
import re
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils import flop_counter

from plugintrain.core.initialization import seeded_normal_, seeded_uniform_
from plugintrain.model_zoo.layers import Attention, SwiGLU
from plugintrain.model_zoo.quantization import QUANTIZATIONS, QuantizedWeight, unquantizable

RECORD_KEY = "lora"
"""Where a LoRA run's checkpoint keeps the adapters' spec and the base they were trained on."""

ADAPTER_PARAMS = ("lora_A", "lora_B")
INITS = ("kaiming", "gaussian")
BIAS_MODES = ("none", "all", "lora_only")
BASE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def is_adapter_name(name: str) -> bool:
    """Whether the parameter or state-dict key ``name`` is a LoRA adapter's."""
    return name.rpartition(".")[2] in ADAPTER_PARAMS


class LoRALinear(nn.Linear):
    """A Linear layer (weight and bias kept as they are, frozen) with a LoRA adapter.

    ``A`` is ``(r, in_features)``, ``B`` is ``(out_features, r)``; the adapter adds
    ``scaling * B A x`` with ``scaling = alpha / r``. A base weight stored in a lower
    precision than the adapter (``base_dtype``) is computed in its own dtype and the
    result cast back to the input's. A base held quantized (QLoRA: ``weight`` is then a
    :class:`~plugintrain.model_zoo.quantization.QuantizedWeight`) is dequantized per
    matmul, and cannot be merged. Bound to a :class:`SharedInput` (``shared``, by
    :func:`inject`), the adapter's ``A`` runs with its siblings' on their common input.

    Args:
        base: The Linear layer to adapt; its parameters are taken over, not copied.
        r: Rank of the update.
        alpha: Scale numerator.
        dropout: Dropout on the adapter's input.
        dtype: The adapter's dtype (default: the base weight's).
    """

    def __init__(
        self, base: nn.Linear, r: int, alpha: float, dropout: float, dtype: torch.dtype | None
    ) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        factory = {"device": base.weight.device, "dtype": dtype or base.weight.dtype}
        self.lora_A = nn.Parameter(torch.zeros(r, self.in_features, **factory))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, r, **factory))
        self.dropout = dropout
        self.shared: SharedInput | None = None
        self.merged = False
        self.disabled = False

    def forward(self, x: Tensor) -> Tensor:
        """``x W^T + b`` plus, unless merged or switched off (:func:`adapters_disabled`),
        ``scaling * dropout(x) A^T B^T``."""
        if self.merged or self.disabled:
            return self._base(x)
        h = self.shared.down(self, x) if self.shared is not None else _down((self,), x)[0]
        if not _one_plain_dtype(x, self.weight, self.lora_B):
            return self._base(x) + F.linear(h, self.lora_B).to(x.dtype)
        # One addmm, B's matmul accumulating in place onto the base's (N, out) output: no
        # output of its own, no copy of the base's and no separate addition.
        rows = F.linear(x.reshape(-1, self.in_features), self.weight, self.bias)
        rows = rows.addmm_(h.reshape(-1, self.r), self.lora_B.t())
        return rows.view(*x.shape[:-1], self.out_features)

    def _base(self, x: Tensor) -> Tensor:
        if isinstance(self.weight, QuantizedWeight):
            return self.weight.linear(x, self.bias).to(x.dtype)
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)

    def tp_placements(self, kind: str) -> dict[str, int | None]:
        """How the adapter splits when this layer is split ``kind`` (``colwise`` or
        ``rowwise``) over tensor-parallel ranks: the dim of each parameter, None for
        replicated (see :class:`plugintrain.core.contracts.TensorParallelExtras`)."""
        if kind == "colwise":
            return {"lora_A": None, "lora_B": 0}
        return {"lora_A": 1, "lora_B": None}

    @torch.no_grad()
    def merge(self) -> None:
        """Add ``scaling * B A`` into the weight, in place, on this rank's shard; a no-op if
        merged already."""
        if isinstance(self.weight, QuantizedWeight):
            raise ValueError(
                f"cannot merge a LoRA adapter into a {self.weight.kind} base weight; read the"
                " run through plugintrain export, which dequantizes the base, then merges"
            )
        if not self.merged:
            self.weight.add_(self._delta())
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Subtract what :meth:`merge` added; a no-op if not merged. Restores the weight up
        to the rounding of one addition and one subtraction in its dtype (exactly when
        ``B`` is zero)."""
        if self.merged:
            self.weight.sub_(self._delta())
            self.merged = False

    def _delta(self) -> Tensor:
        # DTensor propagation keeps it local: colwise B (Shard 0) @ A (replicated) and
        # rowwise B (replicated) @ A (Shard 1) are both laid out like the weight.
        return ((self.lora_B.float() @ self.lora_A.float()) * self.scaling).to(self.weight.dtype)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, r={self.r}, alpha={self.alpha}, dropout={self.dropout},"
            f" merged={self.merged}"
        )


# LoRALinear's in-place addmm_ is addmm's FLOPs; torch's counter (what the dry-run estimate
# and MFU checks count with) knows only the out-of-place op.
if torch.ops.aten.addmm_ not in flop_counter.flop_registry:
    addmm_formula = flop_counter.flop_registry[torch.ops.aten.addmm]
    flop_counter.register_flop_formula(torch.ops.aten.addmm_, get_raw=True)(addmm_formula)


def _down(layers: Sequence[LoRALinear], x: Tensor) -> tuple[Tensor, ...]:
    """``scaling * dropout(x) A^T`` of each of ``layers`` (one rank, scaling and dropout):
    one dropout mask and one matmul, with their ``A`` stacked, for all of them."""
    first = layers[0]
    a = first.lora_A if len(layers) == 1 else torch.cat([layer.lora_A for layer in layers])
    p = first.dropout if first.training else 0.0
    h = _dropped_linear(x.to(a.dtype), a, first.scaling, p)  # (..., len(layers) * r)
    return h.split(first.r, dim=-1) if len(layers) > 1 else (h,)


def _dropped_linear(x: Tensor, a: Tensor, scaling: float, p: float) -> Tensor:
    """``scaling * dropout(x, p) a^T``.

    Scaled through ``a`` (r x in, small): under a row-wise split the adapter's output is
    a partial sum until the layer's one reduction, and scaling the input would keep a
    scaled copy of every adapted layer's activations for backward; dropout's ``1 / (1 -
    p)`` goes there too where the mask is drawn here.

    On a CPU (where ``nn.Dropout`` draws a double per entry, and keeps a float mask for
    backward, 4 bytes an entry), below ``p = 0.1`` only the dropped entries are drawn
    (:func:`_drops`, about ``p`` draws per entry) and zeroed by index in ``x``'s copy and
    in its gradient (:class:`_DroppedLinear`: 8 bytes kept per dropped entry, no mask);
    from ``p = 0.1`` a bool mask, one 31-bit uniform integer per entry against ``p *
    2^31`` (``p`` rounded to a multiple of 2^-31). Elsewhere ``F.dropout`` (CUDA's is one
    fused kernel), and on a DTensor (a tensor-parallel input) too, whose mask is
    consistent across the shards.
    """
    if p == 0:
        return F.linear(x, a * scaling)
    if type(x) is not Tensor or x.device.type != "cpu":
        return F.linear(F.dropout(x, p), a * scaling)
    a = a * (scaling / (1 - p))
    if p < 0.1:
        return _DroppedLinear.apply(x, a, _drops(x.numel(), p))
    kept = torch.empty(x.shape, dtype=torch.int32).random_() >= round(p * 2**31)
    return F.linear(x * kept, a)


class _DroppedLinear(torch.autograd.Function):
    """``x a^T`` with the entries of ``x`` at flat ``indices`` zeroed. Backward zeroes the
    same entries of ``x``'s gradient in place, in the product it computes itself (no copy
    of a gradient that autograd hands over)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, a: Tensor, indices: Tensor) -> Tensor:
        dropped = x.clone(memory_format=torch.contiguous_format)
        dropped.view(-1).index_fill_(0, indices, 0)
        ctx.save_for_backward(dropped, a, indices)
        return F.linear(dropped, a)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        dropped, a, indices = ctx.saved_tensors
        grad_x = grad_a = None
        if ctx.needs_input_grad[0]:
            grad_x = grad @ a  # (..., in)
            grad_x.view(-1).index_fill_(0, indices, 0)
        if ctx.needs_input_grad[1]:
            rows = grad.reshape(-1, grad.size(-1))  # (N, r)
            grad_a = rows.t() @ dropped.view(-1, dropped.size(-1))
        return grad_x, grad_a, None


def _drops(n: int, p: float, batch: int | None = None) -> Tensor:
    """The indices in ``[0, n)`` of a Bernoulli(``p``) sequence's successes, from
    geometric gaps drawn ``batch`` at a time (default: 6 sigma over the expected count, so
    that one batch nearly always reaches ``n``)."""
    batch = batch or int(n * p + 6 * math.sqrt(n * p * (1 - p))) + 16
    # float64: exact integers up to 2^53, and a gap of inf (a uniform draw of 0) stays one.
    ends = torch.empty(batch, dtype=torch.float64).geometric_(p).cumsum_(0)  # 1-based
    while ends[-1] < n:
        more = torch.empty(batch, dtype=torch.float64).geometric_(p).cumsum_(0)
        ends = torch.cat((ends, more.add_(ends[-1])))
    return ends[: int(torch.searchsorted(ends, n, right=True))].long() - 1


def _plain_tensors(x: Tensor, *params: Tensor) -> bool:
    """Whether ``x`` and ``params`` are plain tensors (not a tensor-parallel layer's)."""
    return type(x) is Tensor and all(type(p) in (Tensor, nn.Parameter) for p in params)


def _one_plain_dtype(x: Tensor, *params: Tensor) -> bool:
    """:func:`_plain_tensors` all in ``x``'s dtype (no base stored in another), outside
    autocast (where the base's output is cast back to ``x``'s dtype)."""
    same = all(p.dtype == x.dtype for p in params)
    return _plain_tensors(x, *params) and same and not torch.is_autocast_enabled(x.device.type)


class SharedInput:
    """Adapters on the layers one module calls, in this order, on one tensor: the first
    call runs :func:`_down` for all of them (one dropout mask, one ``A`` matmul) and keeps
    the others' results until each layer is called on that same tensor (checked by
    identity: a layer called on another tensor, or a DTensor, runs its own ``A``, so a
    module that calls them otherwise still gets each adapter's own math). The last
    layer's call lets go of the tensor.

    Args:
        layers: The adapted layers, in the order the module calls them; one ``r``,
            ``scaling``, ``dropout``, adapter dtype and ``in_features``.
    """

    def __init__(self, layers: Sequence[LoRALinear]) -> None:
        self.layers = tuple(layers)
        self._input: Tensor | None = None
        self._pending: dict[int, Tensor] = {}

    def down(self, layer: LoRALinear, x: Tensor) -> Tensor:
        """``scaling * dropout(x) A^T`` of ``layer``, one of :attr:`layers`."""
        slot = self.layers.index(layer)
        if slot == 0 and _plain_tensors(x, *(m.lora_A for m in self.layers)):
            first, *rest = _down(self.layers, x)
            self._input, self._pending = x, dict(enumerate(rest, start=1))
            return first
        h = self._pending.pop(slot, None) if x is self._input else None
        if slot == len(self.layers) - 1:
            self._input, self._pending = None, {}
        return h if h is not None else _down((layer,), x)[0]


SHARED_INPUT_LAYERS: dict[type[nn.Module], tuple[str, ...]] = {
    Attention: ("wq", "wk", "wv"),
    SwiGLU: ("w1", "w3"),
}
"""The Linear layers that a module of each type calls on its one input, in call order:
their adapters share a :class:`SharedInput`."""


def _share_inputs(module: nn.Module) -> None:
    """Bind the adapters on each module's :data:`SHARED_INPUT_LAYERS` (two or more, alike)
    into one :class:`SharedInput`."""
    for parent in module.modules():
        names = SHARED_INPUT_LAYERS.get(type(parent), ())
        layers = [getattr(parent, n) for n in names if isinstance(getattr(parent, n), LoRALinear)]
        for layer in layers:
            layer.shared = None
        alike = {(m.in_features, m.r, m.scaling, m.dropout, m.lora_A.dtype) for m in layers}
        if len(layers) > 1 and len(alike) == 1:
            shared = SharedInput(layers)
            for layer in layers:
                layer.shared = shared


@dataclasses.dataclass(frozen=True)
class LoRASpec:
    """What :func:`inject` adapts and trains (the fields of :class:`plugintrain.callbacks.LoRA`)."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("*.attention.wq", "*.attention.wv")
    trainable: tuple[str, ...] = ()
    bias: str = "none"
    init: str = "kaiming"
    base_dtype: str | None = None
    quantize: str | None = None

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem is not None:
            raise ValueError(problem)

    def problem(self) -> str | None:
        """What is wrong with the values, in one line with the fix; None if nothing."""
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r <= 0:
            return f"LoRA r={self.r!r}: the rank must be a positive integer, e.g. r: 8"
        if not (isinstance(self.alpha, (int, float)) and self.alpha > 0):
            return f"LoRA alpha={self.alpha!r}: must be > 0 (the update is scaled by alpha / r)"
        if not 0 <= self.dropout < 1:
            return f"LoRA dropout={self.dropout!r}: must be in [0, 1)"
        if not self.target_modules:
            return "LoRA target_modules is empty; name the Linear layers, e.g. ['*.attention.wq']"
        for field, value, allowed in (
            ("bias", self.bias, BIAS_MODES),
            ("init", self.init, INITS),
            ("base_dtype", self.base_dtype, (None, *BASE_DTYPES)),
            ("quantize", self.quantize, (None, *QUANTIZATIONS)),
        ):
            if value not in allowed:
                names = ", ".join("null" if a is None else str(a) for a in allowed)
                return f"LoRA {field}={value!r}: use one of {names}"
        if self.quantize is not None and self.base_dtype is not None:
            return (
                f"LoRA quantize={self.quantize!r} and base_dtype={self.base_dtype!r}: a"
                " quantized base has no dtype of its own to choose; drop base_dtype"
            )
        return None

    def record(self) -> dict[str, object]:
        """The fields as plain data (saved in adapter checkpoints)."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_record(cls, record: dict[str, object]) -> LoRASpec:
        """The spec a :meth:`record` describes."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in record.items()}
        return cls(**{k: v for k, v in values.items() if k in names})


def _plain(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value


def inject(module: nn.Module, spec: LoRASpec) -> list[str]:
    """Replace every Linear layer of ``module`` whose path matches ``spec.target_modules``
    by a :class:`LoRALinear`, freeze every other parameter but ``spec.trainable`` ones
    (and biases per ``spec.bias``), and return the adapted paths.

    Works on the meta device (the adapters are allocated with the model later) and on
    real tensors (the adapters start at zero: call :func:`init_adapters`). Adapters on the
    layers of one module's :data:`SHARED_INPUT_LAYERS` are bound into a
    :class:`SharedInput`.

    Raises:
        ValueError: One line: a pattern that matches no module (listing the paths that
            exist, layer numbers folded), a match that is not a Linear layer, or a layer
            whose weight is shared with another module (a tied head: merging it would
            change the embedding too).
    """
    modules = dict(module.named_modules())
    targets = check(module, spec)
    for param in module.parameters():
        param.requires_grad_(False)
    adapted = []
    for path in targets:
        parent, _, leaf = path.rpartition(".")
        layer = modules[path]
        if not isinstance(layer, LoRALinear):  # (injecting twice adapts once)
            layer = LoRALinear(layer, spec.r, spec.alpha, spec.dropout, layer.weight.dtype)
            setattr(modules[parent] if parent else module, leaf, layer)
        adapted.append(path)
        layer.lora_A.requires_grad_(True)
        layer.lora_B.requires_grad_(True)
        if layer.bias is not None and spec.bias == "lora_only":
            layer.bias.requires_grad_(True)
    for path in _matching(modules, spec.trainable, "trainable"):
        modules[path].requires_grad_(True)
    if spec.bias == "all":
        for name, param in module.named_parameters():
            if name.rpartition(".")[2] == "bias":
                param.requires_grad_(True)
    if spec.base_dtype is not None:  # once every flag is final: only what stays frozen
        for _, layer in adapted_layers(module):
            _cast_frozen(layer, BASE_DTYPES[spec.base_dtype])
    if spec.quantize is not None:
        quantize_frozen(module, spec.quantize)
    _share_inputs(module)
    return adapted


def quantize_frozen(module: nn.Module, kind: str) -> dict[str, str]:
    """Hold every adapted layer's frozen weight as a
    :class:`~plugintrain.model_zoo.quantization.QuantizedWeight` of ``kind`` (on the meta
    device: to be filled by loading or initialization; real weights: quantized here, one
    layer at a time), and return the layers kept as they are, with why (a weight listed
    under ``trainable``, or one whose size the quantization's block does not divide)."""
    kept = {}
    for path, layer in adapted_layers(module):
        weight = layer.weight
        if isinstance(weight, QuantizedWeight):
            continue
        why = kept_unquantized(weight, kind)
        if why is not None:
            kept[path] = why
            continue
        quantized = QuantizedWeight.from_weight(weight.detach(), kind)
        del layer.weight
        layer.weight = quantized
    first_rank = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if kept and first_rank:  # said once, not once per rank
        listed = ", ".join(f"{path} ({why})" for path, why in kept.items())
        warnings.warn(f"LoRA quantize={kind!r}: kept unquantized: {listed}", stacklevel=2)
    return kept


def kept_unquantized(weight: Tensor, kind: str) -> str | None:
    """Why a QLoRA run of ``kind`` keeps an adapted layer's ``weight`` as it is (None: it
    holds it quantized): a weight that trains, or one the quantization's block does not
    divide. :func:`quantize_frozen` and whatever reads such a run back follow this rule."""
    return "it trains" if weight.requires_grad else unquantizable(kind, tuple(weight.shape))


def quantized_weights(module: nn.Module) -> Iterator[tuple[str, QuantizedWeight]]:
    """Every :class:`~plugintrain.model_zoo.quantization.QuantizedWeight` of ``module``
    with its path (the path of the weight it stands for, e.g. ``...attention.wq.weight``)."""
    for path, sub in module.named_modules():
        if isinstance(sub, QuantizedWeight):
            yield path, sub


def check(module: nn.Module, spec: LoRASpec) -> list[str]:
    """The Linear layers of ``module`` that ``spec`` adapts, changing nothing; raises what
    :func:`inject` would (see there)."""
    modules = dict(module.named_modules())
    targets = _linear_targets(modules, spec.target_modules)
    _matching(modules, spec.trainable, "trainable")
    shared = _shared_weights(module)
    for path in targets:
        weight = modules[path].weight
        if id(weight) in shared:
            raise ValueError(
                f"LoRA target {path} shares its weight with {shared[id(weight)]} (tied"
                " embeddings): an adapter there could not be merged; drop it from"
                " target_modules, or list it under trainable to train the tied weight itself"
            )
    return targets


def _cast_frozen(layer: nn.Linear, dtype: torch.dtype) -> None:
    """Store ``layer``'s weight and bias in ``dtype`` where they are frozen (a bias that
    trains, or a weight listed under ``trainable``, keeps the adapters' dtype)."""
    for name in ("weight", "bias"):
        param = getattr(layer, name)
        if param is not None and not param.requires_grad and param.dtype != dtype:
            setattr(layer, name, nn.Parameter(param.detach().to(dtype), requires_grad=False))


def _linear_targets(modules: dict[str, nn.Module], patterns: Sequence[str]) -> list[str]:
    """The Linear layers ``patterns`` match (a glob may also match other modules, e.g.
    ``*.feed_forward.*`` the dropout: those are skipped); a pattern that matches no
    Linear layer is an error naming what it matched."""
    matched = _matching(modules, patterns, "target_modules")
    for pattern in patterns:
        hits = fnmatch.filter(matched, pattern)
        if not any(isinstance(modules[p], nn.Linear) for p in hits):
            kinds = ", ".join(f"{p} ({type(modules[p]).__name__})" for p in hits[:3])
            raise ValueError(
                f"LoRA target_modules pattern {pattern!r} matches no Linear layer, only"
                f" {kinds}; target Linear layers such as {_example_linears(modules)}"
            )
    return [p for p in matched if isinstance(modules[p], nn.Linear)]


def _matching(modules: dict[str, nn.Module], patterns: Sequence[str], field: str) -> list[str]:
    """Module paths matching any of ``patterns``, in module order; a pattern matching
    nothing is an error that lists the paths there are."""
    paths = [p for p in modules if p]
    found: dict[str, None] = {}
    for pattern in patterns:
        matches = fnmatch.filter(paths, pattern)
        if not matches:
            raise ValueError(
                f"LoRA {field} pattern {pattern!r} matches no module; the module paths are"
                f" {_folded(paths)}"
            )
        found.update(dict.fromkeys(matches))
    return [p for p in paths if p in found]


def _folded(paths: list[str], limit: int = 40) -> str:
    """``paths`` with layer numbers folded into ``*`` (one line for any depth)."""
    folded = list(dict.fromkeys(re.sub(r"\.\d+(?=\.|$)", ".*", p) for p in paths))
    more = f" (and {len(folded) - limit} more)" if len(folded) > limit else ""
    return ", ".join(folded[:limit]) + more


def _example_linears(modules: dict[str, nn.Module]) -> str:
    linears = [p for p, m in modules.items() if isinstance(m, nn.Linear)]
    return _folded(linears, limit=4) or "(none: this model has no Linear layer)"


def _shared_weights(module: nn.Module) -> dict[int, str]:
    """id of every parameter held by more than one module -> the paths holding it."""
    owners: dict[int, list[str]] = {}
    for path, sub in module.named_modules():
        for name, param in sub.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(param), []).append(f"{path}.{name}" if path else name)
    return {key: " and ".join(paths) for key, paths in owners.items() if len(paths) > 1}


def lora_callback(trainer: Any) -> Any:
    """The LoRA callback among ``trainer``'s callbacks (the one with a :class:`LoRASpec`),
    or None."""
    callbacks = getattr(trainer, "callbacks", None) or []
    found = [c for c in callbacks if isinstance(getattr(c, "spec", None), LoRASpec)]
    return found[0] if found else None


def adapted_layers(module: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    """Every :class:`LoRALinear` of ``module`` with its path."""
    for path, layer in module.named_modules():
        if isinstance(layer, LoRALinear):
            yield path, layer


@torch.no_grad()
def init_adapters(module: nn.Module, seed: int, init: str = "kaiming") -> None:
    """Initialize every adapter of ``module``: ``B = 0`` (the model starts as its base)
    and ``A`` Kaiming-uniform (``U(-1/sqrt(in), 1/sqrt(in))``, PyTorch's Linear init and
    the reference implementation's) or Gaussian (standard deviation ``1/r``, as PEFT
    draws it). Values derive from ``(seed, path)`` only
    (:mod:`plugintrain.core.initialization`), so a rank that holds a shard of ``A`` draws just
    its part of what one process draws."""
    for path, layer in adapted_layers(module):
        key = f"{path}.lora_A"
        if init == "kaiming":
            seeded_uniform_(layer.lora_A, 1 / math.sqrt(layer.in_features), seed, key)
        else:
            seeded_normal_(layer.lora_A, 1 / layer.r, seed, key)
        layer.lora_B.zero_()
        layer.merged = False


def flops_per_token_change(module: nn.Module) -> int:
    """Training FLOPs per token that adapting ``module`` adds and removes, against the
    ``6 N`` of training every matmul weight: each adapter parameter costs 6 (forward,
    input and weight gradients), each frozen Linear weight saves its weight gradient's 2.
    Counted on the whole model (call before it is split into pipeline stages)."""
    frozen = sum(
        m.weight.numel()
        for m in module.modules()
        if isinstance(m, nn.Linear) and not m.weight.requires_grad
    )
    adapters = sum(
        layer.lora_A.numel() + layer.lora_B.numel() for _, layer in adapted_layers(module)
    )
    return 6 * adapters - 2 * frozen


@contextlib.contextmanager
def adapters_disabled(module: nn.Module) -> Iterator[None]:
    """Run ``module`` as its base: every adapter switched off inside the block (the
    reference model of preference tuning, with no second copy of the weights). Merged
    adapters are refused (their update is in the weight)."""
    layers = [layer for _, layer in adapted_layers(module)]
    merged = [layer for layer in layers if layer.merged]
    if merged:
        raise ValueError("adapters_disabled: unmerge the adapters first (they are in the weights)")
    for layer in layers:
        layer.disabled = True
    try:
        yield
    finally:
        for layer in layers:
            layer.disabled = False


def merge(module: nn.Module) -> int:
    """Merge every adapter of ``module`` into its base weight (idempotent); the count."""
    layers = list(adapted_layers(module))
    for _, layer in layers:
        layer.merge()
    return len(layers)


def unmerge(module: nn.Module) -> int:
    """Undo :func:`merge` on every adapter of ``module`` (idempotent); the count."""
    layers = list(adapted_layers(module))
    for _, layer in layers:
        layer.unmerge()
    return len(layers)
