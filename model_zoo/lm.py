"""CausalLM: next-token training, evaluation and generation for any TransformerConfig."""

import functools
import math

import lightning as L
import torch
from lightning.pytorch.cli import OptimizerCallable

from plugintrain.checkpoints.portable import PortableCheckpoints
from plugintrain.core.context_shard import ContextShard
from plugintrain.core.contracts import TokenBytesSource
from plugintrain.model_zoo.config import TransformerConfig
from plugintrain.model_zoo.cross_entropy import (
    IGNORE_INDEX,
    head_cross_entropy,
    token_cross_entropy,
)
from plugintrain.model_zoo.families import tp_plan
from plugintrain.model_zoo.generation import TextGenerator
from plugintrain.model_zoo.metrics import EvalMetrics, bits_per_byte
from plugintrain.model_zoo.pretrained import build_transformer, load_pretrained, resolve_config
from plugintrain.model_zoo.routing_stats import RoutingHooks
from plugintrain.model_zoo.transformer import Transformer

PACKED_ATTENTION = ("documents", "dense")
"""How packed rows may attend (:attr:`Transformer.packed_attention`)."""


def lr_factor(step: int, warmup_steps: int, decay_steps: int, min_lr_ratio: float) -> float:
    """Learning-rate multiplier: linear warmup, then cosine decay to ``min_lr_ratio``.

    Warmup follows torchtitan, ``(step + 1) / (warmup_steps + 1)``, so the first step already
    moves the weights; the factor is 1 at ``warmup_steps`` and ``min_lr_ratio`` from
    ``decay_steps`` on.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    progress = min(1.0, (step - warmup_steps) / max(1, decay_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class StepAccounting:
    """What a :class:`CausalLM` counts of its training batches: their FLOPs (for the
    throughput monitor's MFU) and, with a loss mask, their scored targets (for the
    precision plugin's mean over the step's targets)."""

    config: TransformerConfig
    model: Transformer | None
    loss_mask: bool
    flops_per_batch: int
    flops_per_token_adjustment: int
    _model_flops: dict[int, int]
    _target_counts: torch.Tensor | None

    def count_flops(self, x: torch.Tensor, extra_forwards: int = 0) -> None:
        """Set :attr:`flops_per_batch` for training inputs ``x`` ``(B, T)``, with
        ``extra_forwards`` no-grad forwards (a third of a training step's FLOPs each)."""
        seq_len = x.size(1)
        if seq_len not in self._model_flops:
            self._model_flops[seq_len] = self.config.flops_per_token(seq_len)
        per_token = self._model_flops[seq_len] + self.flops_per_token_adjustment
        per_token += extra_forwards * (self._model_flops[seq_len] // 3)
        # The replica's FLOPs, as under tp: the throughput monitor divides by its devices.
        self.flops_per_batch = per_token * x.numel()

    def _count_targets(self, scored: torch.Tensor, positions: int) -> None:
        counts = torch.stack((scored.double(), scored.new_full((), positions, dtype=torch.float64)))
        total = self._target_counts
        self._target_counts = counts if total is None else total + counts

    def take_target_counts(self) -> torch.Tensor | None:
        """Scored targets and positions of the training batches since the last call, as a
        float64 ``(2,)`` tensor; None when the data has no loss mask (the precision plugin
        then leaves the gradients as they are). Every rank of a run answers alike."""
        if not self.loss_mask:
            return None
        counts = self._target_counts
        self._target_counts = None
        if counts is None:  # e.g. a pipeline rank that ran no training step of its own
            return torch.zeros(2, dtype=torch.float64, device=self.device)
        return counts


class CausalLM(StepAccounting, PortableCheckpoints, RoutingHooks, TextGenerator, L.LightningModule):
    """A decoder-only language model trained on next-token prediction.

    The transformer is built in :meth:`configure_model`, so a strategy can build it on the
    meta device and shard it before allocating the weights.

    Args:
        config: A preset name (see ``TransformerConfig.presets()``) or a full config; None
            means the architecture the ``weights`` file describes (``gpt2-debug`` without
            one).
        optimizer: Builds the optimizer from parameter groups, e.g. ``torch.optim.AdamW``
            with its learning rate; injected as a callable because the model's parameters
            only exist after ``configure_model``.
        weight_decay: Decoupled weight decay for matrices (not for biases and norm weights).
        warmup_steps: Optimizer steps of linear learning-rate warmup.
        lr_decay_steps: Step at which the cosine decay reaches its floor; None means the
            trainer's estimated total number of steps.
        min_lr_ratio: Final learning rate as a fraction of the peak.
        weights: Pretrained weights to start from: a Hugging Face model directory, an
            llm.c ``.bin``, a ``.gguf`` file, a plugintrain checkpoint, or a pretrained name
            (``smollm2-135m``). They are loaded into whatever layout the strategy builds
            (each rank reads one tensor at a time and keeps its own part); a checkpoint
            resumed with ``--ckpt_path`` replaces them (a LoRA run's checkpoint holds only
            the adapters: the base still comes from here).
        packed_attention: How packed rows attend: ``documents`` or ``dense`` (the
            ``T x T`` mask, for comparison; :func:`~plugintrain.model_zoo.layers.packed_mask`).
        fused_head_loss: The LM head fused into the loss, no ``(B, T, V)`` logits whole
            (:func:`~plugintrain.model_zoo.cross_entropy.head_cross_entropy`; not tp/pp/FSDP2).
    """

    def __init__(
        self,
        config: str | TransformerConfig | None = None,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        weight_decay: float = 0.1,
        warmup_steps: int = 100,
        lr_decay_steps: int | None = None,
        min_lr_ratio: float = 0.1,
        weights: str | None = None,
        packed_attention: str = "documents",
        fused_head_loss: bool = False,
    ) -> None:
        super().__init__()
        self.packed_attention = _checked_packed_attention(packed_attention)
        self.fused_head_loss = fused_head_loss
        # The optimizer is training setup, not part of the model, and a callable would stop
        # `load_from_checkpoint` from reading the checkpoint with `weights_only=True`.
        self.save_hyperparameters(ignore=["optimizer"])
        self.weights = weights
        self.config = resolve_config(config, weights)
        if weights is not None:  # checkpoints hold the architecture and need no weights file
            self.hparams["config"] = self.config
            del self.hparams["weights"]
        self.optimizer, self.weight_decay, self.warmup_steps = optimizer, weight_decay, warmup_steps
        self.lr_decay_steps, self.min_lr_ratio = lr_decay_steps, min_lr_ratio
        self.model: Transformer | None = None
        self.flops_per_batch = 0  # the latest training batch's, for ThroughputMonitor (MFU)
        self.flops_per_token_adjustment = 0
        """Added to the config's training FLOPs per token: the LoRA callback sets it to what
        its steps add and skip (the adapters' matmuls; no weight gradients of frozen ones)."""
        self._model_flops: dict[int, int] = {}  # FLOPs per token by sequence length, cached
        self.eval_metrics = torch.nn.ModuleDict({"val": EvalMetrics(), "test": EvalMetrics()})
        self.loss_mask = False
        """Whether the data masks targets (set at setup from the datamodule's ``loss_mask``,
        the same on every rank): the training steps then count their scored targets and
        positions, and ``take_target_counts()`` hands them to the precision plugin."""
        self._target_counts: torch.Tensor | None = None

    def configure_model(self) -> None:
        """Build the transformer, once (Lightning may call this hook more than once)."""
        if self.model is None:
            self.model = build_transformer(self.config, self.weights)
            self.model.packed_attention = self.packed_attention

    @property
    def init_seed(self) -> int:
        """The seed the transformer's weights derive from (after ``configure_model``)."""
        assert self.model is not None
        return self.model.init_seed

    @init_seed.setter
    def init_seed(self, seed: int) -> None:
        assert self.model is not None
        self.model.init_seed = seed

    def init_weights(self) -> None:
        """Initialize the weights this rank holds (see :meth:`Transformer.init_weights`)."""
        assert self.model is not None
        if self.weights is None:
            self.model.init_weights()
            return
        self.model.init_buffers()
        load_pretrained(self.model, self.config, self.weights)

    def one_block_model(self) -> Transformer:
        """A one-block transformer of this architecture (``config.one_block()``), randomly
        initialized: what ``layers_per_stage: auto`` times instead of the whole model."""
        return Transformer(self.config.one_block())

    def tp_plan(self) -> dict[str, str]:
        """The family's tensor-parallel plan, keyed by paths under this module (``model.*``);
        the query/key norms' entries follow ``config.qk_norm``, whatever the family."""
        return {f"model.{pattern}": style for pattern, style in tp_plan(self.config).items()}

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Fp32 cross-entropy of ``logits`` ``(B, T, V)`` against ``targets`` ``(B, T)``: the
        summed loss of the scored targets (not ``IGNORE_INDEX``) over the ``B * T``
        positions, the mean when nothing is masked (see
        :func:`~plugintrain.model_zoo.cross_entropy.token_cross_entropy`).

        Under context parallelism: over this rank's chunks of the rows, whose mean over the
        cp ranks (as the gradients are averaged over dp x cp) is the rows' loss."""
        context = self.model.context if self.model is not None else None
        if context is not None and targets.size(1) != logits.size(1):
            targets = context.take(targets)
        return token_cross_entropy(logits, targets)

    def split_sequences(self, shard: ContextShard) -> None:
        """Hold only ``shard``'s chunks of every sequence from now on (context parallelism,
        :class:`~plugintrain.core.contracts.SplitsSequences`; the strategy calls it)."""
        assert self.model is not None
        self.model.context = shard
        for _, moe in self.model.moe_layers():  # balance losses over whole sequences
            moe.context_group = shard.group

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        """Next-token loss on ``(x, y)`` int64 ``(B, T)``, or ``(x, y, positions)`` of packed
        rows; logs ``train_loss``, ``train_ppl`` and, given the bytes per token,
        ``train_bpb``."""
        loss = self.batch_loss(batch)
        self.record_loss("train", loss, batch)
        aux = self.model.take_aux_loss()  # MoE balance losses (logged as moe/aux_loss)
        if aux is not None and self.loss_mask:
            # The step's gradients are rescaled by positions / scored targets: weighing the
            # balance loss by this batch's share of scored targets makes it, after that,
            # the target-weighted mean of the micro-batches' balance losses.
            targets = batch[1]
            aux = aux * (targets != IGNORE_INDEX).sum() / targets.numel()
        return loss if aux is None else loss + aux

    def validation_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> None:
        """Logs ``val_loss``, ``val_ppl`` and, given the bytes per token, ``val_bpb``."""
        self.record_loss("val", self.batch_loss(batch), batch)

    def test_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> None:
        """Logs ``test_loss``, ``test_ppl`` and, given the bytes per token, ``test_bpb``."""
        self.record_loss("test", self.batch_loss(batch), batch)

    def batch_loss(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """:meth:`loss_fn` of the model's logits on ``batch``; with ``fused_head_loss`` the
        head and the loss fused, with no logits kept."""
        if self.fused_head_loss:
            return _fused_head_loss(self.model, batch)
        return self.loss_fn(self(*_model_inputs(batch)), batch[1])

    def record_loss(self, stage: str, loss: torch.Tensor, batch: tuple[torch.Tensor, ...]) -> None:
        """Log the mean loss of ``batch``'s scored targets for ``stage``, and FLOPs or the
        `EvalMetrics`; count the targets a training batch scores (``loss_mask``).

        Split from the steps so a strategy that runs forward and backward itself (the
        pipeline schedules) logs the loss it computed exactly as the steps do.

        Args:
            stage: ``"train"``, ``"val"`` or ``"test"``.
            loss: The batch's loss as :meth:`loss_fn` returns it (per position).
            batch: The ``(x, y[, positions])`` batch it was computed on.
        """
        x, y = batch[0], batch[1]
        loss = _mean_over_context(self.model, loss)
        scored = (y != IGNORE_INDEX).sum() if self.loss_mask else None
        if scored is not None:  # the per-position loss as the mean over the scored targets
            loss = loss * y.numel() / scored.clamp(min=1)
        if stage == "train":
            if scored is not None:
                self._count_targets(scored, y.numel())
            self.count_flops(x)
            # This rank's batch, as Lightning logs a step's loss: ppl and bpb of the same one.
            self.log("train_loss", loss, prog_bar=True)
            self.log("train_ppl", loss.detach().exp())
            token_bytes = self.eval_metrics["val"].bytes_on(y.device)
            if token_bytes is not None:
                self.log("train_bpb", _bits_per_byte(loss.detach(), y, token_bytes))
            return
        self.log(f"{stage}_loss", loss, prog_bar=True, sync_dist=True)
        for name, metric in self.eval_metrics[stage].update(loss, y).items():
            self.log(f"{stage}_{name}", metric)

    def check_launch(self, trainer: L.Trainer, datamodule: L.LightningDataModule | None) -> None:
        """Refuse preference pairs (a ``PreferenceLM``'s data) in one line: ``plugintrain
        fit`` calls it before any process is launched, :meth:`setup` again."""
        if getattr(datamodule, "preference", False):
            raise ValueError(
                f"{type(datamodule).__name__} holds preference pairs, which"
                f" {type(self).__name__} does not train on; use `model: class_path:"
                " plugintrain.model_zoo.PreferenceLM` (DPO and its family)"
            )
        problem = _fused_head_problem(trainer.strategy) if self.fused_head_loss else None
        if problem is not None:
            raise ValueError(problem)

    def setup(self, stage: str) -> None:
        """Bits per byte take the bytes per token id of a datamodule that knows them."""
        datamodule = self.trainer.datamodule
        if type(self).check_launch is CausalLM.check_launch:
            self.check_launch(self.trainer, datamodule)
        for metrics in self.eval_metrics.values():
            metrics.token_bytes = _token_bytes_of(datamodule)
        self.loss_mask = bool(getattr(datamodule, "loss_mask", False))

    def configure_optimizers(self) -> dict:
        """The injected optimizer over decay/no-decay groups, with a per-step LR schedule."""
        optimizer = self.optimizer(self.param_groups())
        decay_steps = self.lr_decay_steps
        if decay_steps is None:
            decay_steps = self.trainer.estimated_stepping_batches
            if not math.isfinite(decay_steps):
                raise ValueError("The trainer has no step limit; set CausalLM(lr_decay_steps=...).")
        schedule = functools.partial(
            lr_factor,
            warmup_steps=self.warmup_steps,
            decay_steps=int(decay_steps),
            min_lr_ratio=self.min_lr_ratio,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        # Named so LearningRateMonitor logs `lr/pg1` (matrices) and `lr/pg2` (biases, norms)
        # whatever the optimizer class (it would log `lr-AdamW/pg1`).
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "name": "lr"},
        }

    def param_groups(self) -> list[dict]:
        """The trainable parameters as the optimizer's two groups, which
        :meth:`configure_optimizers` (and a dry run) builds the optimizer on."""
        # nanoGPT: decay matrices (Linear and embedding weights), not biases and norm gains.
        params = [p for p in self.parameters() if p.requires_grad]
        return [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": self.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]


def _mean_over_context(model: Transformer | None, loss: torch.Tensor) -> torch.Tensor:
    """The rows' per-position loss from this rank's share of it under context parallelism
    (every cp rank holds as many positions): the mean over the cp group, for logging
    (detached; the strategy averages the gradients). ``loss`` itself otherwise."""
    context = model.context if model is not None else None
    if context is None or context.size == 1:
        return loss
    total = loss.detach().clone()
    torch.distributed.all_reduce(total, group=context.group)
    return total / context.size


def _fused_head_loss(model: Transformer, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The loss of ``batch`` with the head fused into it (``fused_head_loss``): a plain
    bias-free Linear head only (not one with a LoRA adapter or a quantized weight)."""
    head = model.output
    if type(head) is not torch.nn.Linear or head.bias is not None:
        raise ValueError(
            f"fused_head_loss=True needs a plain Linear LM head without a bias, and this one"
            f" is a {type(head).__name__} (an adapter, a quantized weight or a bias on"
            " `output`); set model.init_args.fused_head_loss: false, or leave the head out"
            " of the LoRA targets"
        )
    hidden = model.norm(model.features(*_model_inputs(batch)))
    targets = batch[1] if model.context is None else model.context.take(batch[1])
    return head_cross_entropy(hidden, model.output.weight, targets)


def _fused_head_problem(strategy: object) -> str | None:
    """Why ``fused_head_loss`` cannot run on ``strategy``'s layout (one line), or None."""
    dims = getattr(strategy, "parallel_dims", None)
    if dims is None or not (
        dims.tensor_parallel > 1 or dims.pipeline_parallel > 1 or dims.zero_stage == 3
    ):
        return None
    return (
        "fused_head_loss=True needs the LM head whole on each rank, and this layout shards it"
        f" (tensor_parallel={dims.tensor_parallel}, pipeline_parallel="
        f"{dims.pipeline_parallel}, zero_stage={dims.zero_stage}); set"
        " model.init_args.fused_head_loss: false"
    )


def _model_inputs(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor | None, ...]:
    """The model's arguments for a batch: ``(x,)``, or ``(x, None, positions)`` of packed
    rows."""
    return (batch[0],) if len(batch) == 2 else (batch[0], None, batch[2])


def _bits_per_byte(
    loss: torch.Tensor, targets: torch.Tensor, token_bytes: torch.Tensor
) -> torch.Tensor:
    """Bits per UTF-8 byte of the scored ``targets`` whose mean token NLL is ``loss`` (nats)."""
    scored = targets[targets != IGNORE_INDEX]
    return bits_per_byte(loss * scored.numel(), token_bytes[scored].sum().clamp(min=1))


def _token_bytes_of(datamodule: L.LightningDataModule | None) -> torch.Tensor | None:
    """The UTF-8 bytes per token id of a datamodule that knows them, else None."""
    return datamodule.token_bytes if isinstance(datamodule, TokenBytesSource) else None


def _checked_packed_attention(value: str) -> str:
    if value not in PACKED_ATTENTION:
        raise ValueError(
            f"packed_attention={value!r}: use documents (attention within each document, no"
            " T x T mask) or dense (the mask, for comparison)"
        )
    return value
