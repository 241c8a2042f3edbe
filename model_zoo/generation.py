"""Sampling text from a transformer (a KV cache prefilled once, then one token per step),
and what a language model offers its users without Lightning."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from plugintrain.model_zoo.config import TransformerConfig
from plugintrain.model_zoo.pretrained import build_transformer, resolve_config
from plugintrain.model_zoo.transformer import Transformer


@torch.inference_mode()
def generate(
    model: Transformer,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    use_cache: bool = True,
    eos_id: int | None = None,
) -> torch.Tensor:
    """Extend the prompts ``idx`` ``(B, T)`` by up to ``max_new_tokens`` tokens of ``model``.

    Args:
        model: The transformer (``eval()`` it first when its config has dropout).
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
    stop_ids = () if eos_id is None else (eos_id,)
    steps = generate_tokens(model, idx, max_new_tokens, temperature, top_k, use_cache, stop_ids)
    return torch.cat([idx, *steps], dim=1)


@torch.inference_mode()
def generate_tokens(
    model: Transformer,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    use_cache: bool = True,
    stop_ids: Collection[int] = (),
) -> Iterator[torch.Tensor]:
    """The tokens :func:`generate` appends to ``idx`` ``(B, T)``, one ``(B, 1)`` per step,
    each yielded as soon as it is drawn (to print a reply while it is written).

    A row that has drawn one of ``stop_ids`` is finished: later steps give it that id again
    (as :func:`generate` pads), and the steps end once every row is. Closing the iterator
    early (``break``) frees the KV cache, as finishing does. The other arguments are
    :func:`generate`'s.
    """
    if use_cache:
        _setup_kv_cache(model, idx, max_new_tokens)
    stops = torch.tensor(sorted(stop_ids), dtype=idx.dtype, device=idx.device)
    stopped = torch.full_like(idx[:, :1], -1)  # (B, 1): the id a row stopped at, else -1
    try:
        for step in range(max_new_tokens):
            logits = _next_logits(model, idx, step, use_cache)  # (B, V)
            idx_next = _sample(logits, temperature, top_k)  # (B, 1)
            idx_next = torch.where(stopped >= 0, stopped, idx_next)
            stopped = torch.where(torch.isin(idx_next, stops), idx_next, stopped)
            idx = torch.cat((idx, idx_next), dim=1)
            yield idx_next
            if (stopped >= 0).all():
                return
    finally:
        model.clear_kv_cache()


def complete(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_ids: Collection[int] = (),
    batch_size: int = 8,
    **sampling: Any,
) -> list[list[int]]:
    """Each prompt's continuation by ``model``, up to (not including) its first stop id.

    Prompts run up to ``batch_size`` at a time, but only with prompts of their own length
    (no left padding, which :func:`sample_with_logps` takes): greedy answers are thus
    exactly the one-at-a-time ones.

    Args:
        model: The transformer (``eval()`` it first when its config has dropout).
        prompts: Token ids of each prompt.
        max_new_tokens: Most tokens to generate for each.
        stop_ids: Ids that end an answer (end of turn, EOS).
        batch_size: Most prompts run together.
        **sampling: :func:`generate_tokens`'s ``temperature``, ``top_k``, ``use_cache``.
    """
    answers: list[list[int]] = [[] for _ in prompts]
    device = next(model.parameters()).device
    for rows in _equal_length_batches(prompts, batch_size):
        idx = torch.tensor([list(prompts[i]) for i in rows], dtype=torch.long, device=device)
        steps = generate_tokens(model, idx, max_new_tokens, stop_ids=stop_ids, **sampling)
        new = torch.cat([idx[:, :0], *steps], dim=1).tolist()  # (rows, n)
        for i, tokens in zip(rows, new, strict=True):
            stop = next((j for j, t in enumerate(tokens) if t in stop_ids), len(tokens))
            answers[i] = tokens[:stop]
    return answers


def left_pad(prompts: Sequence[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of any lengths ``(T_i,)`` as one left-padded batch ``(B, max T_i)`` and each
    row's pad count ``(B,)``, for :func:`sample_with_logps` (``pad_id`` fills the pads,
    which no real token attends to)."""
    width = max(p.numel() for p in prompts)
    idx = prompts[0].new_full((len(prompts), width), pad_id)
    for row, prompt in zip(idx, prompts, strict=True):
        row[width - prompt.numel() :] = prompt
    pads = torch.tensor([width - p.numel() for p in prompts], device=idx.device)
    return idx, pads


@torch.no_grad()  # not inference mode: the tokens are a training step's inputs
def sample_with_logps(
    model: Transformer,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    stop_ids: Collection[int] = (),
    stopped: Callable[[torch.Tensor], torch.Tensor] | None = None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    pads: torch.Tensor | None = None,
    copies: int = 1,
    all_done: Callable[[torch.Tensor], bool] | None = None,
    forward: Callable[..., torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample continuations of the prompts ``idx`` ``(B, T)`` with a KV cache, recording
    each drawn token's log-probability under the model's distribution at ``temperature``
    (before top-k/top-p truncation, as the policy's log-probs are computed in training).

    Prompts of several lengths go in left-padded (:func:`left_pad`): a row's positions
    count from its first real token and it attends to none of its pads.

    Args:
        model: The transformer.
        idx: Prompt token ids, ``(B, T)``.
        max_new_tokens: Most tokens to draw per row.
        temperature: Softmax temperature, > 0.
        top_k: Draw only among the k most likely tokens; None: all.
        top_p: Draw only from the smallest set of most likely tokens whose probabilities
            reach ``top_p`` (nucleus sampling); 1: all.
        stop_ids: Ids that end a row (drawn and kept as its last token).
        stopped: Given the new tokens so far ``(B, n)``, which rows a stop string has ended
            (``(B,)`` bool), or None.
        generator: The draws' random numbers (None: torch's global ones); a sequence
            splits the rows into as many equal consecutive blocks, one generator each.
        pads: Each row's left pads ``(B,)``; None: rows of one length.
        copies: Rows sampled from each prompt, prefilled once (its KV cache repeated):
            ``B * copies`` rows, a prompt's consecutive.
        all_done: Given whether this process's rows have all ended (a bool tensor),
            whether every process's have (FSDP2: every rank runs every decode step).
        forward: What runs ``model`` on ``(tokens, input_pos)`` (a LightningModule whose
            strategy hooks must run); None: ``model``.

    Returns:
        ``(tokens, logps, lengths)``: the drawn tokens ``(R, n)`` (``R = B * copies``;
        after a row ends, its last token repeated), their log-probs ``(R, n)`` float32,
        and each row's length up to and including its stop token ``(R,)``.
    """
    try:
        _setup_kv_cache(model, idx, max_new_tokens, pads)
        draw, ends = (top_k, top_p, generator), (stopped, all_done)
        return _decode_with_logps(
            model, forward or model, idx, max_new_tokens, temperature, draw, stop_ids, ends, copies
        )
    finally:
        model.clear_kv_cache()


def _decode_with_logps(
    model: Transformer,
    forward: Callable[..., torch.Tensor],
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    draw: tuple[int | None, float, Any],
    stop_ids: Collection[int],
    ends: tuple[Callable[[torch.Tensor], torch.Tensor] | None, Callable | None],
    copies: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sample_with_logps`'s steps, the KV cache set up (``draw``: top-k, top-p and
    the generator; ``ends``: ``stopped`` and ``all_done``)."""
    stopped, all_done = ends
    stops = torch.tensor(sorted(stop_ids), dtype=idx.dtype, device=idx.device)
    rows = idx.size(0) * copies
    lengths = torch.full((rows,), max_new_tokens, dtype=torch.long, device=idx.device)
    done = torch.zeros(rows, dtype=torch.bool, device=idx.device)
    tokens: list[torch.Tensor] = []
    logps: list[torch.Tensor] = []
    for step in range(max_new_tokens):
        logits = _next_logits(forward, idx, step, True).float() / temperature  # (B, V)
        if step == 0 and copies > 1:  # the prompts prefilled once: now each row's own
            logits, idx = (t.repeat_interleave(copies, dim=0) for t in (logits, idx))
            model.repeat_kv_cache(copies)
        log_probs = torch.log_softmax(logits, dim=-1)
        drawn = _draw(logits, *draw)  # (B, 1)
        drawn = torch.where(done[:, None], tokens[-1] if tokens else drawn, drawn)
        tokens.append(drawn)
        logps.append(log_probs.gather(-1, drawn))
        idx = torch.cat((idx, drawn), dim=1)
        ended = torch.isin(drawn[:, 0], stops)
        if stopped is not None:
            ended |= stopped(torch.cat(tokens, dim=1))
        newly = ended & ~done
        lengths = torch.where(newly, torch.full_like(lengths, step + 1), lengths)
        done |= ended
        finished = done.all()
        if all_done(finished) if all_done is not None else finished:
            break
    return torch.cat(tokens, dim=1), torch.cat(logps, dim=1), lengths


def _draw(
    logits: torch.Tensor,
    top_k: int | None,
    top_p: float,
    generator: torch.Generator | Sequence[torch.Generator] | None,
) -> torch.Tensor:
    """One token per row of temperature-scaled ``logits`` ``(B, V)``, from the top-k and
    top-p truncated distribution, by inverse-CDF sampling: one uniform number a row against
    the cumulative probabilities (``torch.multinomial`` draws an exponential number for
    every vocabulary entry, 10 times the time at a 49k vocabulary). ``(B, 1)``; a sequence
    of generators: as :func:`sample_with_logps` splits the rows."""
    cdf = _truncated_probs(logits, top_k, top_p).cumsum_(dim=-1)  # (B, V)
    total = cdf[:, -1:]
    if not bool((torch.isfinite(total) & (total > 0)).all()):
        raise FloatingPointError(
            "the model's next-token probabilities are NaN or all zero (its logits hold NaN"
            " or inf): check the weights and the learning rate, or lower the precision's"
            " loss scale"
        )
    # u * total, kept below the total where it would round up to it: the first cdf above
    # it is then always a token of nonzero probability.
    target = torch.minimum(
        _uniform(logits.size(0), generator, logits.device) * total,
        torch.nextafter(total, torch.zeros_like(total)),
    )
    return torch.searchsorted(cdf, target, right=True).clamp_(max=logits.size(-1) - 1)


def _truncated_probs(logits: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """The fp32 probabilities of ``logits`` ``(B, V)`` after top-k, then top-p (nucleus)
    truncation."""
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(ordered.float(), dim=-1)
        before = probs.cumsum(dim=-1) - probs  # the mass ranked above each token
        ordered = ordered.masked_fill(before >= top_p, float("-inf"))  # the first always kept
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)
    return torch.softmax(logits.float(), dim=-1)


def _uniform(
    rows: int,
    generator: torch.Generator | Sequence[torch.Generator] | None,
    device: torch.device,
) -> torch.Tensor:
    """``rows`` uniform numbers in [0, 1) ``(rows, 1)`` from ``generator``, or from each of a
    sequence of generators for its equal block of consecutive rows."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand(rows, 1, generator=generator, device=device)
    per = rows // len(generator)
    assert per * len(generator) == rows, "one generator per equal block of rows"
    return torch.cat([torch.rand(per, 1, generator=g, device=device) for g in generator])


def _equal_length_batches(prompts: Sequence[Sequence[int]], batch_size: int) -> list[list[int]]:
    """Indices of ``prompts`` in batches of at most ``batch_size`` prompts of one length."""
    by_length: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(i)
    return [
        rows[start : start + batch_size]
        for rows in by_length.values()
        for start in range(0, len(rows), batch_size)
    ]


def _setup_kv_cache(
    model: Transformer, idx: torch.Tensor, max_new_tokens: int, pads: torch.Tensor | None = None
) -> None:
    total, block_size = idx.size(1) + max_new_tokens, model.config.block_size
    if total > block_size:
        raise ValueError(
            f"Prompt length {idx.size(1)} + max_new_tokens={max_new_tokens} = {total} "
            f"exceeds block_size={block_size}; generate fewer tokens, or pass "
            f"use_cache=False to crop the context to the last block_size tokens."
        )
    model.setup_kv_cache(idx.size(0), total, device=idx.device, pads=pads)


def _next_logits(model: Transformer, idx: torch.Tensor, step: int, use_cache: bool) -> torch.Tensor:
    if not use_cache:
        return model(idx[:, -model.config.block_size :])[:, -1]
    # The first step prefills the cache with the prompt; later ones feed the newest token.
    start = 0 if step == 0 else idx.size(1) - 1
    input_pos = torch.arange(start, idx.size(1), device=idx.device)
    return model(idx[:, start:], input_pos)[:, -1]


def _sample(logits: torch.Tensor, temperature: float, top_k: int | None) -> torch.Tensor:
    """Pick one token id per row of ``logits`` ``(B, V)``: ``(B, 1)``."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    # One multinomial draw a step from torch's global generator, as transformers samples.
    return torch.multinomial(_truncated_probs(logits / temperature, top_k, 1.0), num_samples=1)


class TextGenerator:
    """What a module holding a transformer as ``model`` (and its ``config``) offers a user
    of language models: its sizes, logits and :func:`generate`. Mixed into
    :class:`~plugintrain.model_zoo.CausalLM` and :class:`PretrainedLM`."""

    model: Transformer | None
    config: TransformerConfig

    @property
    def vocab_size(self) -> int:
        """Number of token ids the model covers."""
        return self.config.vocab_size

    @property
    def max_seq_len(self) -> int:
        """Longest sequence the model accepts (``block_size``)."""
        return self.config.block_size

    def forward(
        self,
        tokens: torch.Tensor,
        input_pos: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``(B, T, V)`` for token ids ``(B, T)``; see :meth:`Transformer.forward`
        (``positions``: packed rows)."""
        return self.model(tokens, input_pos, positions)

    def generate(self, idx: torch.Tensor, max_new_tokens: int, **sampling: Any) -> torch.Tensor:
        """Extend the prompts ``idx`` ``(B, T)`` by up to ``max_new_tokens`` tokens; the
        sampling options (``temperature``, ``top_k``, ``use_cache``, ``eos_id``) are
        :func:`generate`'s. Call ``eval()`` first when the config has dropout."""
        return generate(self.model, idx, max_new_tokens, **sampling)


class PretrainedLM(TextGenerator, nn.Module):
    """A language model to sample from, built as :class:`~plugintrain.model_zoo.CausalLM`
    builds its transformer but without Lightning (``plugintrain generate``).

    Args:
        config: A preset name, fields or a config; None: the one ``weights`` holds.
        weights: Pretrained weights or a checkpoint (any format plugintrain reads); None:
            random weights.
    """

    def __init__(
        self, config: str | dict | TransformerConfig | None = None, weights: str | None = None
    ) -> None:
        super().__init__()
        self.config = resolve_config(config, weights)
        self.model = build_transformer(self.config, weights)

    @property
    def device(self) -> torch.device:
        """Where the weights are."""
        return next(self.model.parameters()).device
