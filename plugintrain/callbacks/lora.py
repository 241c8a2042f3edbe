"""The LoRA callback: adapters put into a LightningModule's model after it is built and
before any strategy shards it or builds its optimizers, adapter-only checkpoints."""

from __future__ import annotations

import copy
import fnmatch
import functools
import json
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from plugintrain.core.initialization import draw_seed
from plugintrain.data.assets import PRETRAINED_MODELS
from plugintrain.formats import lora_checkpoints, resolve
from plugintrain.model_zoo import lora


class LoRA(Callback):
    """Low-rank adapters on a model's Linear layers; everything else frozen.

    Configured under ``trainer.callbacks``::

        - class_path: plugintrain.callbacks.LoRA
          init_args: {r: 8, alpha: 16, target_modules: ["*.attention.wq", "*.attention.wv"]}

    The adapters go in right after the module's ``configure_model`` (plugintrain's
    strategies call :meth:`on_model_built` there; under Lightning's own strategies the
    callback wraps ``configure_model``), so they are built on the meta device and split,
    staged and sharded with their base layers like any other weight. Only adapters (and
    ``trainable`` modules, and biases per ``bias``) require gradients, so the optimizer
    and the gradient engine see nothing else.

    A run whose model came from a ``weights`` file saves adapter checkpoints: the
    trainable tensors and their optimizer state, plus the base file's path and sha256;
    resuming loads the base from that file and refuses another one.

    Args:
        r: Rank of each update.
        alpha: The update is scaled by ``alpha / r``.
        dropout: Dropout on the adapters' inputs.
        target_modules: Globs on module paths (relative to the LightningModule, e.g.
            ``*.attention.wq``, ``*.feed_forward.*``) of the Linear layers to adapt.
        trainable: Globs of other modules to train whole (e.g. ``model.output``).
        bias: ``none`` (frozen), ``all`` (every bias trains), ``lora_only`` (the adapted
            layers' biases train).
        init: ``kaiming`` (A Kaiming-uniform) or ``gaussian`` (A normal, standard
            deviation 1/r); B starts at zero either way, so training starts from the base.
        base_dtype: Store the adapted layers' frozen weights in ``bf16`` (or ``fp16``) to
            halve their memory while the adapters train in the model's dtype; None keeps
            the model's dtype.
        quantize: Hold the adapted layers' frozen weights quantized (QLoRA): ``nf4``
            (NormalFloat-4, blocks of 64, double-quantized block scales: 4.127 bits a
            weight) or ``int8`` (per-row absmax); None keeps them as ``base_dtype`` says.
            Weights are quantized as they load (one tensor at a time) and dequantized per
            matmul into the compute dtype; adapters, norms, embeddings and the head stay
            as the precision plugin says. A weight whose size the block does not divide,
            or one listed under ``trainable``, is kept as it is (and said once). Runs
            under every strategy that holds whole weights (one process, ``ddp_bucketed``,
            ``zero1``, ``zero2``, ``hybrid``/``pipeline`` with ``tensor_parallel: 1``,
            FSDP2 included); tensor parallelism is refused.
        adapter: A PEFT adapter directory (``adapter_config.json`` and
            ``adapter_model.safetensors``, e.g. ``plugintrain export --format peft``'s or
            ``peft``'s ``save_pretrained``'s) to start the adapters from instead of
            ``init``: its rank and scaling must be ``r`` and ``alpha / r``, and every
            module it adapts one of ``target_modules``; targets it does not adapt start
            as ``init`` says.
    """

    def __init__(
        self,
        r: int = 8,
        alpha: float = 16.0,
        dropout: float = 0.0,
        target_modules: list[str] | None = None,
        trainable: list[str] | None = None,
        bias: str = "none",
        init: str = "kaiming",
        base_dtype: str | None = None,
        quantize: str | None = None,
        adapter: str | None = None,
    ) -> None:
        default = lora.LoRASpec.target_modules
        self.spec = lora.LoRASpec(
            r=r,
            alpha=alpha,
            dropout=dropout,
            target_modules=tuple(default if target_modules is None else target_modules),
            trainable=tuple(trainable or ()),
            bias=bias,
            init=init,
            base_dtype=base_dtype,
            quantize=quantize,
        )
        self.adapter = adapter
        self.adapted: list[str] = []
        self._trained: set[str] = set()
        self._base_hash: Future[str] | None = None

    @property
    def state_key(self) -> str:
        return f"LoRA(r={self.spec.r})"

    def check_model(self, pl_module: pl.LightningModule, strategy: Any = None) -> None:
        """Raise what :meth:`on_model_built` would (a glob matching nothing, a target that
        is no Linear layer, a tied one, a quantized base that ``strategy`` cannot hold); a
        module that builds its model in ``configure_model`` is checked on a copy built on
        the meta device (nothing is allocated). ``plugintrain fit`` calls it before any
        process is launched."""
        if self.spec.quantize is not None and base_name(pl_module) is None:
            raise ValueError(
                f"LoRA quantize: {self.spec.quantize} quantizes a pretrained base, and this"
                f" model has none; set {BASE_OPTION} (a Hugging Face directory, GGUF, llm.c"
                " file, checkpoint or pretrained name), or drop quantize"
            )
        if self.spec.quantize is not None and strategy is not None:
            problem = quantized_base_problem(strategy, self.spec.quantize)
            if problem is not None:
                raise ValueError(problem)
        if not is_overridden("configure_model", pl_module):
            lora.check(pl_module, self.spec)
            self._peft_start(pl_module)
            return
        probe = copy.deepcopy(pl_module)  # not built yet: no weights to copy
        # Building draws a model's init seed: the real run's must not see the probe's draw.
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            probe.configure_model()
        lora.check(probe, self.spec)
        self._peft_start(probe)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.spec.quantize is not None:  # also where no CLI checked it (the Python API)
            problem = quantized_base_problem(trainer.strategy, self.spec.quantize)
            if problem is not None:
                raise ValueError(problem)
        if not is_overridden("configure_model", pl_module):
            self.on_model_built(trainer, pl_module)  # the model exists already
        elif self.spec.quantize is not None or not getattr(
            trainer.strategy, "calls_on_model_built", False
        ):  # a quantized base is built on meta even where the strategy builds it whole
            hook = functools.partial(self.on_model_built, trainer)
            _after_configure_model(pl_module, hook, on_meta=self.spec.quantize is not None)
        base = base_name(pl_module)
        if base is not None and trainer.is_global_zero and self._base_hash is None:
            # Hashed beside the first steps (hashlib releases the GIL); needed at the first save.
            self._base_hash = ThreadPoolExecutor(1).submit(
                lora_checkpoints.weights_sha256, _resolve(base)
            )

    def on_model_built(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Put the adapters in (once per module); plugintrain's strategies call this right
        after the module's ``configure_model``, before they split, shard or allocate."""
        if any(True for _ in lora.adapted_layers(pl_module)):
            if not self._trained:  # adapted by an earlier run of this module
                self.adapted = [path for path, _ in lora.adapted_layers(pl_module)]
                self._trained = {n for n, p in pl_module.named_parameters() if p.requires_grad}
            return
        self.adapted = lora.inject(pl_module, self.spec)
        # Names before any wrapper (Lightning's FSDP) renames them: what checkpoints keep.
        self._trained = {name for name, p in pl_module.named_parameters() if p.requires_grad}
        if hasattr(pl_module, "flops_per_token_adjustment"):  # MFU counts what steps run
            pl_module.flops_per_token_adjustment = lora.flops_per_token_change(pl_module)
        if base_name(pl_module) is not None:
            pl_module.strict_loading = False  # the base weights come from their file
        start = self._peft_start(pl_module)  # checked here, on meta, before any allocation
        on_meta = any(p.is_meta for p in pl_module.parameters())
        if on_meta and callable(getattr(pl_module, "init_weights", None)):
            _after_init_weights(pl_module, self.spec.init, start)
        else:
            seed = getattr(pl_module, "init_seed", None)
            lora.init_adapters(pl_module, draw_seed() if seed is None else seed, self.spec.init)
            _copy_adapters(pl_module, start)

    def _peft_start(self, pl_module: pl.LightningModule) -> dict[str, torch.Tensor]:
        """The tensors of :attr:`adapter` by our parameter names (those this rank holds),
        after checking that they fit this run's spec and targets."""
        if self.adapter is None:
            return {}
        from plugintrain.formats import read_adapters

        spec, tensors = read_adapters(self.adapter, pl_module.config)
        if spec.r != self.spec.r or abs(spec.alpha / spec.r - self.spec.alpha / self.spec.r) > 1e-9:
            raise ValueError(
                f"the PEFT adapter {self.adapter} has r={spec.r}, alpha={spec.alpha:g}; set the"
                f" LoRA callback's r: {spec.r} and alpha: {spec.alpha:g} to continue it"
            )
        modules = {f"model.{name.rpartition('.')[0]}" for name in tensors}
        patterns = self.spec.target_modules
        outside = sorted(m for m in modules if not any(fnmatch.fnmatch(m, p) for p in patterns))
        if outside:
            raise ValueError(
                f"the PEFT adapter {self.adapter} adapts {outside[0]}, which the LoRA callback's"
                f" target_modules {list(self.spec.target_modules)} do not match; add it"
            )
        held = {name for name, _ in pl_module.named_parameters()}
        return {f"model.{n}": t for n, t in tensors.items() if f"model.{n}" in held}

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        base = base_name(pl_module)
        if base is not None:  # a randomly initialized base exists nowhere else: kept whole
            state = checkpoint["state_dict"]
            checkpoint["state_dict"] = {k: v for k, v in state.items() if k in self._trained}
        digest = self._base_hash.result() if self._base_hash is not None else None
        checkpoint[lora.RECORD_KEY] = {
            "base": base,
            "sha256": digest,
            "spec": self.spec.record(),
            "adapted": list(self.adapted),
        }

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        record = checkpoint.get(lora.RECORD_KEY)
        if record is None:
            return
        problem = _spec_problem(record, self.spec)
        state = checkpoint.get("state_dict")  # (a sharded load has filled the model already)
        missing = sorted(self._trained - set(state)) if state is not None else []
        if problem is None and missing:
            problem = f"the checkpoint lacks {missing[0]} ({len(missing)} trained tensors)"
        if problem is None and self._base_hash is not None:  # global rank 0 hashed the base
            try:
                lora_checkpoints.check_base(
                    record, base_name(pl_module), self._base_hash.result(), BASE_OPTION
                )
            except ValueError as error:
                problem = str(error)
        problem = trainer.strategy.broadcast(problem)  # every rank stops, not only rank 0
        if problem is not None:
            raise ValueError(problem)


BASE_OPTION = "model.init_args.weights"
"""Where a recipe names the base weights."""

QUANTIZED_BASE_STRATEGIES = (
    "one process, ddp_bucketed, zero1, zero2, hybrid or pipeline with tensor_parallel: 1"
    " (FSDP2: zero_stage: 3)"
)
"""Where a quantized base runs (what the refusal below names)."""


def quantized_base_problem(strategy: Any, kind: str) -> str | None:
    """Why ``strategy`` cannot hold a base quantized as ``kind``, in one line with the
    strategies that can; None if it can. A quantized weight is one flat byte tensor per
    layer: strategies that keep whole weights (or shard flat parameters, FSDP2) hold it;
    tensor parallelism splits weights by rows or columns, and Lightning's FSDP and
    DeepSpeed flatten parameters of one dtype."""
    tp = getattr(getattr(strategy, "parallel_dims", None), "tensor_parallel", 1)
    name = type(strategy).__name__
    if isinstance(tp, int) and tp > 1:
        return (
            f"LoRA quantize: {kind} cannot run under {name}(tensor_parallel={tp}): a quantized"
            f" base weight is not split over tensor-parallel ranks; use {QUANTIZED_BASE_STRATEGIES}"
        )
    if name in ("FSDPStrategy", "DeepSpeedStrategy"):
        return (
            f"LoRA quantize: {kind} cannot run under Lightning's {name}, which flattens"
            f" parameters of one dtype; use {QUANTIZED_BASE_STRATEGIES}"
        )
    return None


def base_name(pl_module: pl.LightningModule) -> str | None:
    """The module's base weights as a checkpoint records them: a pretrained name as it
    is, a path made absolute (so tools find it from any directory); None without one."""

    weights = getattr(pl_module, "weights", None)
    if weights is None or str(weights) in PRETRAINED_MODELS:
        return None if weights is None else str(weights)
    return str(Path(weights).resolve())


def _spec_problem(record: dict[str, Any], spec: lora.LoRASpec) -> str | None:
    difference = lora_checkpoints.spec_difference(record, spec)
    if difference is None:
        return None
    return (
        f"the adapters were trained with LoRA {difference}; set the LoRA callback's"
        " init_args to the checkpoint's spec to resume it"
    )


def _resolve(weights: str) -> str:
    """The path of ``weights`` (a pretrained name is fetched into the asset directory)."""

    return str(resolve(weights))


def resume_base(
    ckpt_path: str, record: dict[str, Any], weights: str | None, callbacks: Any, verify: bool
) -> str | None:
    """The base weights a run resumes the LoRA checkpoint ``ckpt_path`` on: the run's
    ``weights``, else the base its ``record`` names (None: the checkpoint holds the whole
    model); checked before anything is launched, the base's sha256 only where ``verify``
    (the launching process: one read of the base, not one per rank).

    Raises:
        ValueError: One line: no LoRA callback configured, another spec, or base weights
            whose sha256 differs from the one the adapters were trained on.
    """
    listed = callbacks if isinstance(callbacks, list) else [callbacks] if callbacks else []
    configured = [_spec_of(c) for c in listed if _is_lora(c)]
    if not configured:
        spec = ", ".join(f"{k}: {json.dumps(v)}" for k, v in record["spec"].items())
        raise ValueError(
            f"{ckpt_path} holds LoRA adapters (base: {record['base']}); add the LoRA"
            f" callback to trainer.callbacks: {{class_path: plugintrain.callbacks.LoRA,"
            f" init_args: {{{spec}}}}}"
        )
    problem = _spec_problem(record, configured[0])
    if problem is not None:
        raise ValueError(f"{ckpt_path}: {problem}")
    base = weights or record["base"]
    if base is not None and verify:
        lora_checkpoints.check_named_base(record, base, BASE_OPTION)
    return base


def _spec_of(callback: Any) -> lora.LoRASpec:
    if isinstance(callback, LoRA):
        return callback.spec
    init_args = callback.get("init_args")
    return LoRA(**(init_args.as_dict() if hasattr(init_args, "as_dict") else init_args or {})).spec


def _is_lora(callback: Any) -> bool:
    if isinstance(callback, LoRA):
        return True
    path = callback.get("class_path") if hasattr(callback, "get") else None
    return isinstance(path, str) and path.rpartition(".")[2] == "LoRA"


def _after_configure_model(pl_module: pl.LightningModule, hook: Any, on_meta: bool) -> None:
    """Make ``pl_module.configure_model`` call ``hook(pl_module)`` after itself; with
    ``on_meta`` (a quantized base), build on the meta device, put the adapters in there,
    then allocate and call ``init_weights`` (which loads the base, quantizing each weight
    as it is read): the base is never held whole in full precision. Where the strategy
    builds on the meta device itself (``hybrid``, ``pipeline``: it allocates its shards and
    calls ``init_weights`` later) the adapters just go in; a module that cannot initialize
    its own weights (no ``init_weights``) is built as it is and quantized after."""
    original = pl_module.configure_model
    if getattr(original, "_lora_hook", None) == hook.func:
        return  # wrapped by an earlier `setup` (another stage) already

    def configure_model() -> None:
        device = torch.empty(()).device
        shard_first = device.type == "meta"  # the strategy allocates and initializes
        initializes = callable(getattr(type(pl_module), "init_weights", None))
        if shard_first or not (on_meta and initializes):
            original()
            hook(pl_module)
            return
        before = {id(p) for p in pl_module.parameters()}
        with torch.device("meta"):
            original()
            hook(pl_module)
        if any(id(p) not in before for p in pl_module.parameters()):  # built just now
            for child in pl_module.children():
                if any(p.is_meta for p in child.parameters()):
                    child.to_empty(device=device)
            with torch.no_grad():
                pl_module.init_weights()

    configure_model._lora_hook = hook.func  # type: ignore[attr-defined]
    pl_module.configure_model = configure_model


def _after_init_weights(
    pl_module: pl.LightningModule, init: str, start: dict[str, torch.Tensor]
) -> None:
    """Make the strategy's ``init_weights`` call (after the model is materialized, with
    the broadcast seed) initialize the adapters too, then copy in ``start``."""
    original = pl_module.init_weights

    def init_weights() -> None:
        original()
        with torch.no_grad():
            lora.init_adapters(pl_module, pl_module.init_seed, init)
        _copy_adapters(pl_module, start)

    pl_module.init_weights = init_weights


@torch.no_grad()
def _copy_adapters(pl_module: pl.LightningModule, start: dict[str, torch.Tensor]) -> None:
    """Copy whole adapter tensors into the module's parameters, each rank its own box of a
    sharded one (tensor parallel, FSDP2)."""
    from plugintrain.core.tensor_boxes import local_box, select

    params = dict(pl_module.named_parameters())
    for name, tensor in start.items():
        local, box = local_box(params[name])
        local.copy_(select(tensor, box, (0,) * tensor.ndim))
