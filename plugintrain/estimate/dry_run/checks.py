"""What a dry run checks over the ranks it built: their bytes against the estimate's and a
memory limit, the pipeline's balance, paired point-to-point messages, and every trainable
element stepped exactly once per replica the layout keeps."""

from __future__ import annotations

from typing import TYPE_CHECKING

from plugintrain.estimate.dry_run.build import DryRank, meta_model
from plugintrain.estimate.layout import Layout
from plugintrain.model_zoo.config import TransformerConfig

if TYPE_CHECKING:
    from plugintrain.estimate.search import RankMemory


def planned_total(rank: DryRank, estimated: RankMemory) -> int:
    """A rank's peak: its dry-run training state plus the estimate's activations and
    communication buffers (``estimated``: the estimate's rank at its position)."""
    return sum(rank.training_state) + estimated.activations + estimated.communication


def estimate_problems(
    ranks: list[DryRank], estimated: dict[int, RankMemory], memory: int | None
) -> list[str]:
    """A rank whose parameters, gradients or optimizer state differ from the estimate's
    (``estimated``: by rank), and one whose :func:`planned_total` is over ``memory``."""
    problems = []
    for r in ranks:
        expected = estimated[r.rank].training_state
        if r.training_state != expected:
            problems.append(
                f"rank {r.rank}: holds parameters/gradients/optimizer {r.training_state}"
                f" bytes, the estimate says {expected}"
            )
        total = planned_total(r, estimated[r.rank])
        if memory is not None and total > memory:
            problems.append(
                f"rank {r.rank} (pp {r.pp_rank}, dp {r.dp_rank}, tp {r.tp_rank}) needs"
                f" {total} bytes > --memory {memory}; list layouts that fit with"
                f" --fit {memory}"
            )
    return problems


def ownership_problems(
    ranks: list[DryRank], layout: Layout, trainable: dict[str, int] | None = None
) -> list[str]:
    """Every trainable parameter's elements stepped exactly once per replica the layout
    keeps, over all ranks (call with every rank): one line per parameter that is not,
    or that no rank holds. ``trainable``: the whole model's trainable parameters (by
    canonical name) and the pipeline stages each belongs on (:func:`trainable_stages`);
    None: those the ranks hold, on the stages seen holding them."""
    if len(ranks) != layout.world_size:
        raise ValueError("the ownership check needs every rank (--ranks all)")
    stepped: dict[str, int] = {}
    stages: dict[str, set[int]] = {}
    copies: dict[str, int] = {}
    full: dict[str, int] = {}
    for r in ranks:
        for name, n in r.owned.items():
            stepped[name] = stepped.get(name, 0) + n
            stages.setdefault(name, set()).add(r.pp_rank)
            copies[name], full[name] = r.copies[name], r.full[name]
    expected_stages = trainable or {name: len(held) for name, held in stages.items()}
    problems = [
        f"parameter {name}: held by no rank (nothing would train it)"
        for name in sorted(set(expected_stages) - set(stepped))
    ]
    for name in sorted(stepped):
        count = expected_stages.get(name, len(stages[name]))
        expected = full[name] * copies[name] * count
        if stepped[name] != expected:
            problems.append(
                f"parameter {name}: {stepped[name]} elements stepped over all ranks, expected"
                f" {expected} ({full[name]} x {copies[name]} replicas x {count} stages)"
            )
    return problems


def trainable_stages(config: TransformerConfig, layout: Layout) -> dict[str, int]:
    """The whole model's trainable parameters (canonical names; LoRA: its adapters) and
    how many pipeline stages hold each: two for a weight tied across the first and the
    last stage, else one (built on the meta device in this process)."""
    module = meta_model(config, layout)
    tied = dict(module.model.tied_parameters())
    canonical = {b: a for a, b in tied.items()}
    stages = 2 if layout.dims.pp > 1 else 1
    names = {}
    for name, param in module.model.named_parameters(remove_duplicate=False):
        if param.requires_grad:
            name = canonical.get(name, name)
            names[name] = stages if name in tied else 1
    return names


def balance_problems(
    ranks: list[DryRank], config: TransformerConfig, layout: Layout, limit: float = 1.5
) -> list[str]:
    """A pipeline stage computing over ``limit`` x the training FLOPs per token of the
    lightest one (it sets the pace of every step; the layers it holds, as built, each
    ``6 x`` its active parameters plus its attention, and the head on the last stage):
    one line naming it and the fix."""
    per_stage = {r.pp_rank: _stage_flops(r, config, layout) for r in ranks}
    if len(per_stage) < 2:
        return []
    heavy = max(per_stage, key=per_stage.__getitem__)
    light = min(per_stage, key=per_stage.__getitem__)
    ratio = per_stage[heavy] / max(per_stage[light], 1)
    if ratio <= limit:
        return []
    return [
        f"pipeline stage {heavy} computes {ratio:.2f}x the FLOPs per token of stage {light}"
        f" ({per_stage[heavy]:.3g} vs {per_stage[light]:.3g}); move blocks off it with"
        " --layers_per_stage"
    ]


def _stage_flops(rank: DryRank, config: TransformerConfig, layout: Layout) -> float:
    """Training FLOPs per token of the blocks ``rank`` holds, plus the head on the last
    pipeline rank (:meth:`TransformerConfig.flops_per_token`'s terms, per block)."""
    flops = 0.0
    for index in rank.block_indices:
        flops += config.block_flops(index, layout.seq_len).training
    if rank.pp_rank == layout.dims.pp - 1:
        flops += 6 * config.vocab_size * config.n_embd
    return flops


def p2p_problems(ranks: list[DryRank]) -> list[str]:
    """Every point-to-point message between two traced ranks paired: rank a's n-th send to
    b has the size of b's n-th receive from a, and their counts agree (a send with no
    receive blocks a NCCL pipeline for good). One line per pair that does not."""
    traced = {r.rank: r.trace for r in ranks if r.trace is not None}
    sent: dict[tuple[int, int], list[int]] = {}
    received: dict[tuple[int, int], list[int]] = {}
    for rank, trace in traced.items():
        for kind, peer, nbytes in trace.p2p:
            if kind == "send":
                sent.setdefault((rank, peer), []).append(nbytes)
            else:
                received.setdefault((peer, rank), []).append(nbytes)
    problems = []
    for pair in sorted(set(sent) | set(received)):
        src, dst = pair
        if src not in traced or dst not in traced:
            continue
        sends, recvs = sent.get(pair, []), received.get(pair, [])
        if sends != recvs:
            problems.append(
                f"rank {src} -> rank {dst}: {len(sends)} sends of {sorted(set(sends))} bytes,"
                f" {len(recvs)} receives of {sorted(set(recvs))} bytes; the pipeline would hang"
            )
    return problems
