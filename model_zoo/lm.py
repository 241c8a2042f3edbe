"""CausalLM: next-token training, evaluation and generation for any TransformerConfig."""

import dataclasses
import functools
import math

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import OptimizerCallable
from torchmetrics import Metric

from plugintrain.data.token_bytes import TokenBytesSource
from plugintrain.model_zoo import deepseek_v3, gpt2, llama3, qwen3, qwen3_moe
from plugintrain.model_zoo.config import TransformerConfig
from plugintrain.model_zoo.cross_entropy import token_cross_entropy
from plugintrain.model_zoo.layers import QK_NORM_PLAN
from plugintrain.model_zoo.routing_stats import RoutingHooks
from plugintrain.model_zoo.transformer import Transformer
from plugintrain.portable_checkpoints import PortableCheckpoints

# Model family -> its declarative tensor/sequence-parallel plan for a config (the MoE
# families' plans depend on which blocks are dense).
_TP_PLANS = {
    "gpt2": lambda config: gpt2.tp_plan(),
    "llama3": lambda config: llama3.tp_plan(),
    "qwen3": lambda config: qwen3.tp_plan(),
    "deepseek_v3": deepseek_v3.tp_plan,
    "qwen3_moe": qwen3_moe.tp_plan,
}


class _SummedNLL(Metric):
    """Total NLL (nats) and a total to divide it by, synced across ranks by summing both."""

    full_state_update = False
    higher_is_better = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state(
            "nll_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum"
        )
        self.add_state("total", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def _add(self, loss: torch.Tensor, num_tokens: int, total: int | torch.Tensor) -> None:
        self.nll_sum += loss.detach().double() * num_tokens
        self.total += total


class Perplexity(_SummedNLL):
    """Token-level perplexity from mean losses.

    Takes the loss already computed for the step, so the vocabulary softmax runs once.
    """

    def update(self, loss: torch.Tensor, num_tokens: int) -> None:
        """Add a batch whose mean token NLL is ``loss`` over ``num_tokens`` tokens."""
        self._add(loss, num_tokens, num_tokens)

    def compute(self) -> torch.Tensor:
        """``exp(total NLL / total tokens)``."""
        return torch.exp(self.nll_sum / self.total)


class BitsPerByte(_SummedNLL):
    """Bits per UTF-8 byte of text: total NLL (nats) / (ln 2 x total bytes of the targets).

    Unlike loss per token it does not depend on the tokenizer, so models with different
    vocabularies compare on it. Every target's NLL counts, also a special token's, which
    spells no bytes.
    """

    def update(self, loss: torch.Tensor, targets: torch.Tensor, token_bytes: torch.Tensor) -> None:
        """Add a batch whose mean token NLL is ``loss`` over ``targets`` (ids, any shape);
        ``token_bytes[i]`` is the number of bytes id ``i`` spells."""
        self._add(loss, targets.numel(), token_bytes[targets].sum())

    def compute(self) -> torch.Tensor:
        """``total NLL / (ln 2 x total bytes)``."""
        return self.nll_sum / (math.log(2) * self.total)


class EvalMetrics(torch.nn.Module):
    """The metrics of one evaluation stage, updated from each batch's mean loss: perplexity,
    and bits per byte once ``token_bytes`` (UTF-8 bytes per token id) is known."""

    def __init__(self) -> None:
        super().__init__()
        self.ppl = Perplexity()
        self.bpb = BitsPerByte()
        self.token_bytes: torch.Tensor | None = None

    def update(self, loss: torch.Tensor, targets: torch.Tensor) -> dict[str, Metric]:
        """Add a batch of mean loss ``loss`` over ``targets``; returns the metrics to log."""
        self.ppl.update(loss, targets.numel())
        token_bytes = self.bytes_on(targets.device)
        if token_bytes is None:
            return {"ppl": self.ppl}
        self.bpb.update(loss, targets, token_bytes)
        return {"ppl": self.ppl, "bpb": self.bpb}

    def bytes_on(self, device: torch.device) -> torch.Tensor | None:
        """``token_bytes`` on ``device`` (copied once, then a no-op), None if unknown."""
        if self.token_bytes is not None:
            self.token_bytes = self.token_bytes.to(device)
        return self.token_bytes


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


class CausalLM(PortableCheckpoints, RoutingHooks, L.LightningModule):
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
    ) -> None:
        super().__init__()
        # The optimizer is training setup, not part of the model, and a callable would stop
        # `load_from_checkpoint` from reading the checkpoint with `weights_only=True`.
        self.save_hyperparameters(ignore=["optimizer"])
        self.weights = weights
        self.config = _resolve_config(config, weights)
        if weights is not None:  # checkpoints hold the architecture and need no weights file
            self.hparams["config"] = self.config
            del self.hparams["weights"]
        self.optimizer = optimizer
        self.weight_decay = weight_decay
        self.warmup_steps = warmup_steps
        self.lr_decay_steps = lr_decay_steps
        self.min_lr_ratio = min_lr_ratio
        self.model: Transformer | None = None
        # Training FLOPs of the latest batch on this device, for Lightning's ThroughputMonitor
        # (MFU); set by training_step.
        self.flops_per_batch = 0
        self.flops_per_token_adjustment = 0
        """Added to the config's training FLOPs per token: the LoRA callback sets it to what
        its steps add and skip (the adapters' matmuls; no weight gradients of frozen ones)."""
        self.eval_metrics = torch.nn.ModuleDict({"val": EvalMetrics(), "test": EvalMetrics()})

    @property
    def vocab_size(self) -> int:
        """Number of token ids the model covers."""
        return self.config.vocab_size

    @property
    def max_seq_len(self) -> int:
        """Longest sequence the model accepts (``block_size``)."""
        return self.config.block_size

    def configure_model(self) -> None:
        """Build the transformer, once (Lightning may call this hook more than once)."""
        if self.model is None:
            self.model = _build(self.config, self.weights)

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
        _load_pretrained(self.model, self.config, self.weights)

    def tp_plan(self) -> dict[str, str]:
        """The family's tensor-parallel plan, keyed by paths under this module (``model.*``);
        the query/key norms' entries follow ``config.qk_norm``, whatever the family."""
        return {f"model.{pattern}": style for pattern, style in _tp_plan(self.config).items()}

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(B, T, V)`` for token ids ``(B, T)``; see :meth:`Transformer.forward`."""
        return self.model(tokens, input_pos)

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean fp32 cross-entropy of ``logits`` ``(B, T, V)`` against ``targets`` ``(B, T)``."""
        return token_cross_entropy(logits, targets)

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        """Next-token loss on ``(x, y)`` int64 ``(B, T)``; logs ``train_loss``, ``train_ppl``
        and, given the bytes per token, ``train_bpb``."""
        x, y = batch
        loss = self.loss_fn(self(x), y)
        self.record_loss("train", loss, batch)
        aux = self.model.take_aux_loss()  # MoE balance losses (logged as moe/aux_loss)
        return loss if aux is None else loss + aux

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Logs ``val_loss``, ``val_ppl`` and, given the bytes per token, ``val_bpb``."""
        x, y = batch
        self.record_loss("val", self.loss_fn(self(x), y), batch)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Logs ``test_loss``, ``test_ppl`` and, given the bytes per token, ``test_bpb``."""
        x, y = batch
        self.record_loss("test", self.loss_fn(self(x), y), batch)

    def record_loss(
        self, stage: str, loss: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        """Log the mean loss of ``batch`` for ``stage``, and FLOPs or the `EvalMetrics`.

        Split from the steps so a strategy that runs forward and backward itself (the
        pipeline schedules) logs the loss it computed exactly as the steps do.

        Args:
            stage: ``"train"``, ``"val"`` or ``"test"``.
            loss: The batch's mean token loss.
            batch: The ``(x, y)`` batch it was computed on.
        """
        x, y = batch
        if stage == "train":
            per_token = self.config.flops_per_token(x.size(1)) + self.flops_per_token_adjustment
            self.flops_per_batch = per_token * x.numel()
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

    def setup(self, stage: str) -> None:
        """Bits per byte take the bytes per token id of a datamodule that knows them."""
        for metrics in self.eval_metrics.values():
            metrics.token_bytes = _token_bytes_of(self.trainer.datamodule)

    def configure_optimizers(self) -> dict:
        """The injected optimizer over decay/no-decay groups, with a per-step LR schedule."""
        optimizer = self.optimizer(self._param_groups())
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

    def _param_groups(self) -> list[dict]:
        # nanoGPT: decay matrices (Linear and embedding weights), not biases and norm gains.
        params = [p for p in self.parameters() if p.requires_grad]
        return [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": self.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]

    @torch.inference_mode()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        use_cache: bool = True,
        eos_id: int | None = None,
    ) -> torch.Tensor:
        """Extend the prompts ``idx`` ``(B, T)`` by up to ``max_new_tokens`` tokens.

        Call ``eval()`` first when the config has dropout.

        Args:
            idx: Prompt token ids.
            max_new_tokens: Number of tokens to generate.
            temperature: Softmax temperature; 0 picks the most likely token (greedy).
            top_k: Sample only among the k most likely tokens; None samples from all.
            use_cache: Prefill a KV cache once and decode one token per step; without it,
                each step reruns the (last ``block_size`` tokens of the) sequence.
            eos_id: Stop once every row has produced this token; finished rows are padded
                with it.

        Returns:
            The prompts followed by the generated tokens, ``(B, T + n)`` with
            ``n <= max_new_tokens``.

        Raises:
            ValueError: If the cache is used and prompt plus new tokens exceed ``block_size``.
        """
        if use_cache:
            self._setup_kv_cache(idx, max_new_tokens)
        try:
            return self._generate(idx, max_new_tokens, temperature, top_k, use_cache, eos_id)
        finally:
            self.model.clear_kv_cache()

    def _setup_kv_cache(self, idx: torch.Tensor, max_new_tokens: int) -> None:
        total = idx.size(1) + max_new_tokens
        if total > self.max_seq_len:
            raise ValueError(
                f"Prompt length {idx.size(1)} + max_new_tokens={max_new_tokens} = {total} "
                f"exceeds block_size={self.max_seq_len}; generate fewer tokens, or pass "
                f"use_cache=False to crop the context to the last block_size tokens."
            )
        self.model.setup_kv_cache(idx.size(0), total, device=idx.device)

    def _generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float,
        top_k: int | None,
        use_cache: bool,
        eos_id: int | None,
    ) -> torch.Tensor:
        done = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)
        for step in range(max_new_tokens):
            logits = self._next_logits(idx, step, use_cache)  # (B, V)
            idx_next = _sample(logits, temperature, top_k)  # (B, 1)
            if eos_id is not None:
                idx_next = idx_next.masked_fill(done[:, None], eos_id)
                done |= idx_next[:, 0] == eos_id
            idx = torch.cat((idx, idx_next), dim=1)
            if done.all():
                break
        return idx

    def _next_logits(self, idx: torch.Tensor, step: int, use_cache: bool) -> torch.Tensor:
        if not use_cache:
            return self.model(idx[:, -self.max_seq_len :])[:, -1]
        # The first step prefills the cache with the prompt; later ones feed the newest token.
        start = 0 if step == 0 else idx.size(1) - 1
        input_pos = torch.arange(start, idx.size(1), device=idx.device)
        return self.model(idx[:, start:], input_pos)[:, -1]


def _tp_plan(config: TransformerConfig) -> dict[str, str]:
    """``config``'s family plan, with query/key norm entries exactly when it has them."""
    plan = {k: v for k, v in _TP_PLANS[config.family](config).items() if k not in QK_NORM_PLAN}
    return plan | QK_NORM_PLAN if config.qk_norm else plan


def _build(config: TransformerConfig, weights: str | None) -> Transformer:
    """The transformer, randomly initialized, or holding the pretrained ``weights``.

    Pretrained: built on meta and allocated without drawing random values; under a
    strategy's meta-device context the strategy allocates it, then calls ``init_weights``.
    """
    if weights is None:
        return Transformer(config)
    device = torch.empty(()).device
    with torch.device("meta"):
        model = Transformer(config)
    if device.type != "meta":
        model.to_empty(device=device)
        model.init_buffers()
        _load_pretrained(model, config, weights)
    return model


def _load_pretrained(model: Transformer, config: TransformerConfig, weights: str) -> None:
    """Copy the pretrained ``weights`` into the parts of ``model`` this rank holds."""
    from plugintrain.formats import load_into, open_weights

    load_into(model, open_weights(weights), config)


def _resolve_config(
    config: str | dict | TransformerConfig | None, weights: str | None
) -> TransformerConfig:
    """The architecture: ``config`` (a preset name, fields or a config), else the one the
    ``weights`` file describes, with the tokenizer that came with it."""
    if isinstance(config, dict):  # saved as its fields (PortableCheckpoints)
        config = TransformerConfig.from_dict(config)
    elif isinstance(config, str):
        config = TransformerConfig.from_name(config)
    if weights is None:
        return config or TransformerConfig.from_name("gpt2-debug")
    from plugintrain.data.assets import PRETRAINED_MODELS
    from plugintrain.formats import check_architecture, open_weights

    found = open_weights(weights)
    if config is not None:
        check_architecture(config, found)
        return config
    tokenizer = weights if weights in PRETRAINED_MODELS else found.tokenizer
    return dataclasses.replace(found.config, tokenizer=tokenizer)


def _bits_per_byte(
    loss: torch.Tensor, targets: torch.Tensor, token_bytes: torch.Tensor
) -> torch.Tensor:
    """Bits per UTF-8 byte of ``targets`` whose mean token NLL is ``loss`` (nats)."""
    return loss * targets.numel() / (math.log(2) * token_bytes[targets].sum().clamp(min=1))


def _token_bytes_of(datamodule: L.LightningDataModule | None) -> torch.Tensor | None:
    """The UTF-8 bytes per token id of a datamodule that knows them, else None."""
    return datamodule.token_bytes if isinstance(datamodule, TokenBytesSource) else None


def _sample(logits: torch.Tensor, temperature: float, top_k: int | None) -> torch.Tensor:
    """Pick one token id per row of ``logits`` ``(B, V)``: ``(B, 1)``."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits.float(), dim=-1), num_samples=1)
