"""Dry runs: one CPU process plays rank R of N through torch's fake process-group backend.

Where :func:`~plugintrain.estimate.estimate` computes each rank's bytes from the model's
shapes, a dry run builds rank R as a launch would, on the real code path: the layout's
DeviceMesh over N ranks (``ParallelDims.build_mesh``), the model built shard-first on the
meta device, this rank's pipeline stages split off, the TP(+SP) plan, expert placement,
FSDP2 or the gradient engine's buckets and shards, the optimizer attached to them, then
one optimizer step whose state the optimizer creates itself. Nothing is allocated (every
tensor stays on the meta device) and no collective moves data (the ``fake`` backend
returns at once), so a rank of a 405B model on 1,024 ranks takes seconds and a few
hundred MB. The bytes reported are read from the tensors this rank holds, counted by
distinct storage as the real-rank tests count them
(``tests/distributed/test_estimate_distributed.py``).

What a real launch would refuse (a degree that does not divide, heads that tp does not
split, layers that do not split into the stages, experts that ep does not divide) is
refused here by the same checks, as one line naming the rank and the value.

The package, in the order a dry run goes:

* :mod:`~plugintrain.estimate.dry_run.world`: the fake process group (the one import from
  torch's test internals) and which ranks to build;
* :mod:`~plugintrain.estimate.dry_run.build`: building one rank (:class:`DryRank`);
* :mod:`~plugintrain.estimate.dry_run.trace`: with ``--trace``, one training step of it on
  meta tensors: FLOPs, activations, collectives (:class:`StepTrace`);
* :mod:`~plugintrain.estimate.dry_run.pool`: many ranks, each in a process of its own;
* :mod:`~plugintrain.estimate.dry_run.checks`: the problems looked for over the ranks;
* :mod:`~plugintrain.estimate.dry_run.report`: :func:`dry_run` and its
  :class:`DryRunReport`, set against the estimate.
"""

from plugintrain.estimate.dry_run.build import DryRank, dry_rank
from plugintrain.estimate.dry_run.checks import (
    balance_problems,
    ownership_problems,
    p2p_problems,
    trainable_stages,
)
from plugintrain.estimate.dry_run.pool import build_ranks
from plugintrain.estimate.dry_run.report import DryRunReport, activation_peak, dry_run
from plugintrain.estimate.dry_run.trace import StepTrace, Traffic, TrafficRecorder, untraced
from plugintrain.estimate.dry_run.world import fake_world, parse_ranks, sample_ranks

__all__ = [
    "DryRank",
    "DryRunReport",
    "StepTrace",
    "Traffic",
    "TrafficRecorder",
    "activation_peak",
    "balance_problems",
    "build_ranks",
    "dry_rank",
    "dry_run",
    "fake_world",
    "ownership_problems",
    "p2p_problems",
    "parse_ranks",
    "sample_ranks",
    "trainable_stages",
    "untraced",
]
