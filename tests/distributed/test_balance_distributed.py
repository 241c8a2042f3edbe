"""``layers_per_stage: auto`` on two ranks that measure differently still cuts one way.

Each rank's timings differ (another load, another clock); a split chosen from its own
figures would differ between ranks and the pipeline would hang. Here rank 1 is made to
measure a cheap head (its own figures alone would keep the equal split) and rank 0 a
heavy one: both must come out with rank 0's split.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from plugintrain.model_zoo import TransformerConfig
from plugintrain.strategies import ParallelDims, PipelineOptions, auto_split, balance
from plugintrain.strategies.balance import LayerCosts, choose_split

from _harness import run_distributed

HEAVY = LayerCosts(embed=(0.0005, 0.001), block=(0.010, 0.020), head=(0.060, 0.090))
CHEAP = LayerCosts(embed=(0.0005, 0.001), block=(0.010, 0.020), head=(0.0005, 0.001))


def _choose(rank: int, world_size: int) -> tuple[int, ...]:
    balance.measure_one_block = lambda *args, **kwargs: HEAVY if rank == 0 else CHEAP
    config = TransformerConfig.from_name("gpt2-debug", n_layer=8)
    dims = ParallelDims(pipeline_parallel=2).with_world_size(2)
    options = PipelineOptions.resolve(dims, "1f1b", 4, "auto")
    data = SimpleNamespace(batch_size=8, seq_len=64)
    module = SimpleNamespace(config=config, one_block_model=lambda: None)
    chosen = auto_split.balance_stages(module, dims, options, data, torch.device("cpu"), None)
    return chosen.layers_per_stage


def test_every_rank_takes_rank_0s_split() -> None:
    own = [choose_split(c, 8, 2, 1, "1f1b", 4).layers_per_stage for c in (HEAVY, CHEAP)]
    assert own[0] != own[1]  # on their own figures the ranks would disagree
    assert run_distributed(_choose, 2) == [own[0], own[0]]
