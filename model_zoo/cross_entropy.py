"""Mean token cross-entropy that never holds the logits in fp32 all at once.

``F.cross_entropy(logits.float().flatten(0, 1), targets)`` upcasts the whole ``(B, T, V)``
logits, and autograd keeps the fp32 log-softmax until backward: 16.8 GB each at the
Llama 3 vocabulary and 32k tokens per step (issue 18). :func:`chunked_cross_entropy`
walks the tokens in chunks instead. Each chunk is upcast, its loss summed in fp32, and
its gradient, ``(softmax - one_hot) / N``, is computed right away and stored in one buffer
in the logits' dtype; backward only scales that buffer in place. The buffer is the
gradient autograd hands to the LM head anyway, so beyond it only a few fp32 chunks exist.
Computing the gradient in the forward pass is what Liger Kernel's fused cross-entropy
does (Hsu et al., 2024), here in plain PyTorch so it runs on any device.

Loss masks: a target equal to :data:`IGNORE_INDEX` is not scored (prompt tokens of chat
data, padding). The loss is then the sum over the scored targets divided by the number of
*positions*, scored or not: a denominator fixed by the batch's shape, so that the
gradients of every micro-batch, accumulation step and data-parallel rank add up to the
sum over the global batch's targets times one known constant, which the precision plugin
turns into the mean over the global batch's targets at the optimizer step (Megatron's
per-token loss; a mean of per-micro-batch means would weigh a target of a short answer
more than one of a long answer, the gradient-accumulation bug ``transformers`` fixed in
2024). Without ignored targets it is the plain mean, as before.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.graph import increment_version
from torch.distributed.tensor import DTensor

IGNORE_INDEX = -100
"""A target that is not scored (torch's ``cross_entropy`` default ``ignore_index``)."""

CHUNK_ELEMENTS = 1 << 24
"""Logits per chunk (a 64 MiB fp32 copy): at Llama 3's 128,256-token vocabulary 130
tokens, large enough that each chunk's few kernels keep a GPU busy."""


def token_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """The loss :class:`~plugintrain.model_zoo.CausalLM` trains on (its ``loss_fn``).

    Plain logits go through :func:`chunked_cross_entropy`. Under tensor parallelism the
    strategy wraps ``loss_fn`` in ``vocab_parallel_loss`` and the logits arrive as
    DTensors sharded over the vocabulary: they take torch's cross-entropy, whose
    ``loss_parallel`` rule reduces over the shards (each rank upcasts only its ``V / tp``
    columns), as before.

    Returns:
        The summed loss of the scored targets (not :data:`IGNORE_INDEX`) over the number
        of positions, ``targets.numel()``: the mean when every target is scored.
    """
    if isinstance(logits, DTensor):
        flat_targets = targets.flatten()
        total = F.cross_entropy(
            logits.float().flatten(0, -2), flat_targets, ignore_index=IGNORE_INDEX, reduction="sum"
        )
        return total / flat_targets.numel()
    return chunked_cross_entropy(logits, targets)


def chunked_cross_entropy(
    logits: Tensor, targets: Tensor, chunk_tokens: int | None = None
) -> Tensor:
    """Cross-entropy of ``logits`` ``(..., V)`` against ``targets`` ``(...)``, in fp32: the
    sum over the scored targets over the number of positions (see the module docstring).

    Equal to ``F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(),
    reduction="sum") / targets.numel()`` with ``ignore_index`` :data:`IGNORE_INDEX` in loss
    and gradient (to fp32 rounding; the gradient is rounded once to the logits' dtype), but
    the fp32 copies are one chunk of tokens at a time. A target is a token id in ``[0, V)``
    or :data:`IGNORE_INDEX`.

    Args:
        logits: Plain (not DTensor) logits of any floating dtype; the gradient comes back
            in it.
        targets: int64 token ids, one per row of ``logits``.
        chunk_tokens: Tokens per chunk; None: as many as :data:`CHUNK_ELEMENTS` logits.

    Returns:
        The fp32 scalar loss. Its backward runs once: it scales the stored gradient in
        place, so a second backward through the same graph (``retain_graph=True``) is
        refused by autograd's in-place check instead of returning a wrong gradient.
    """
    vocab = logits.size(-1)
    chunk = chunk_tokens or max(1, CHUNK_ELEMENTS // vocab)
    return _ChunkedCrossEntropy.apply(logits, targets, chunk)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and, when the logits need one, their gradient."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor, chunk: int) -> Tensor:
        flat = logits.reshape(-1, logits.size(-1))  # (N, V)
        flat_targets = targets.reshape(-1)  # (N,)
        n = flat.size(0)
        grad = torch.empty_like(flat) if ctx.needs_input_grad[0] else None
        total = torch.zeros((), dtype=torch.float32, device=flat.device)
        for start in range(0, n, chunk):
            rows = slice(start, start + chunk)
            grad_rows = None if grad is None else grad[rows]
            total += _chunk_loss(flat[rows], flat_targets[rows], grad_rows, 1.0 / n)
        if grad is not None:
            ctx.save_for_backward(grad.view(logits.shape))
        return total / n

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, None, None]:
        (grad,) = ctx.saved_tensors
        if grad_output.device.type == "cpu" and grad_output.item() == 1.0:
            # A plain backward of the loss: scaling by exactly 1 changes nothing, so the
            # pass over the logits-sized buffer is skipped (on a GPU the check would cost a
            # synchronization). The version bump keeps a second backward refused.
            increment_version(grad)
            return grad, None, None
        # In place: a second logits-sized buffer is what this Function exists to avoid.
        return grad.mul_(grad_output), None, None


def _chunk_loss(logits: Tensor, targets: Tensor, grad: Tensor | None, scale: float) -> Tensor:
    """Summed fp32 loss of one chunk ``(n, V)``; writes ``scale * d(loss)/d(logits)`` into
    ``grad`` (in the logits' dtype) unless it is None."""
    # (n, V) fp32, the one fp32 copy of the chunk (CUDA reads bf16 and writes fp32 at once);
    # fp32 logits' gradient rows hold it themselves, with no buffer of its own (a fresh one
    # is page-faulted in at every step on a CPU)
    in_grad = grad is not None and grad.dtype == torch.float32
    log_probs = torch.log_softmax(
        logits, dim=-1, dtype=torch.float32, out=grad if in_grad else None
    )
    scored = (targets != IGNORE_INDEX)[:, None]  # (n, 1)
    index = targets.clamp(min=0)[:, None]  # an ignored row gathers id 0, then counts 0
    loss = -(log_probs.gather(1, index) * scored).sum()
    if grad is not None:
        probs = log_probs.exp_()  # softmax, in the same memory
        probs.scatter_add_(1, index, -scored.to(probs.dtype))
        # (softmax - one_hot) * scale on scored rows, zero on ignored ones; rounded to the
        # logits' dtype at once
        torch.mul(probs, scored * scale, out=grad)
    return loss


def head_cross_entropy(
    hidden: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int | None = None
) -> Tensor:
    """:func:`chunked_cross_entropy` of the logits ``hidden @ weight.T`` without ever holding
    them whole: the LM head and the loss fused, a chunk of tokens at a time.

    Each chunk's logits are computed, their loss summed and their gradient taken (as
    :func:`chunked_cross_entropy` does), and that gradient is at once turned into the
    chunk's gradient of ``hidden`` (``grad @ weight``) and added into the weight's
    (``grad.T @ hidden``, fp32, only when ``weight`` needs one). What outlives a chunk is
    ``hidden``'s gradient and the weight's: ``(B, T, C)`` and ``(V, C)`` instead of two
    ``(B, T, V)`` buffers, the logits and their gradient (1.6 GB at 4,096 tokens of a
    49,152-token vocabulary). Liger Kernel's fused linear cross-entropy does this with Triton
    kernels; here it is plain PyTorch, on any device.

    Args:
        hidden: ``(B, T, C)`` final hidden states (after the final norm), plain tensors.
        weight: ``(V, C)`` the LM head's weight (no bias), a plain tensor.
        targets: ``(B, T)`` int64 token ids or :data:`IGNORE_INDEX`.
        chunk_tokens: Tokens per chunk; None: as many as :data:`CHUNK_ELEMENTS` logits.

    Returns:
        The fp32 loss: the sum over the scored targets over the number of positions.
    """
    chunk = chunk_tokens or max(1, CHUNK_ELEMENTS // weight.size(0))
    return _HeadCrossEntropy.apply(hidden, weight, targets, chunk)


class _HeadCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and the gradients of the hidden states and the weight."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int) -> Tensor:
        flat = hidden.reshape(-1, hidden.size(-1))  # (N, C)
        flat_targets = targets.reshape(-1)
        n = flat.size(0)
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(flat) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        total = torch.zeros((), dtype=torch.float32, device=flat.device)
        device = flat.device.type
        # Under autocast the head's matmuls run in its dtype: the weight is cast once.
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        cast = weight.to(dtype or torch.promote_types(flat.dtype, weight.dtype))
        with torch.autocast(device, enabled=False):
            for start in range(0, n, chunk):
                rows = slice(start, start + chunk)
                inputs = flat[rows].to(cast.dtype)
                logits = inputs @ cast.t()  # (n, V) in the compute dtype
                grad = torch.empty_like(logits) if want_hidden or want_weight else None
                total += _chunk_loss(logits, flat_targets[rows], grad, 1.0 / n)
                del logits
                if grad_hidden is not None:
                    grad_hidden[rows] = grad @ cast
                if (
                    grad_weight is not None
                ):  # the chunk's product in the compute dtype, summed in fp32
                    grad_weight += grad.t() @ inputs
        ctx.save_for_backward(
            *(g if g is not None else torch.empty(0) for g in (grad_hidden, grad_weight))
        )
        ctx.shapes = hidden.shape, weight.dtype
        return total / n

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        shape, weight_dtype = ctx.shapes
        hidden = grad_hidden.view(shape) * grad_output if ctx.needs_input_grad[0] else None
        weight = (grad_weight * grad_output).to(weight_dtype) if ctx.needs_input_grad[1] else None
        return hidden, weight, None, None
