"""Stage splitting: full-model names, ownership of embedding/head, and chunk composition."""

from __future__ import annotations

import pytest
import torch

from plugintrain.model_zoo import Transformer, TransformerConfig
from plugintrain.strategies.pipeline_runtime import TIED, chunk_partition
from plugintrain.strategies.pipeline_stages import check_layers, split_model, stage_layer_keys
from plugintrain.strategies.tied import TiedParameters


def _model(preset: str) -> Transformer:
    torch.manual_seed(0)
    config = TransformerConfig.from_name(preset, n_layer=4, vocab_size=64, n_embd=32)
    return Transformer(config)


def test_interleaved_split_winds_layers_around_the_ranks() -> None:
    # pp=2 x vpp=2: virtual stage s = chunk * pp + rank holds layer s.
    assert stage_layer_keys(4, 4) == [["0"], ["1"], ["2"], ["3"]]
    first = split_model(_model("gpt2-debug"), rank=0, pp=2, vpp=2)
    last = split_model(_model("gpt2-debug"), rank=1, pp=2, vpp=2)
    assert [c.index for c in first] == [0, 2] and [c.index for c in last] == [1, 3]
    assert list(first[0].model.layers) == ["0", "2"]
    assert list(last[0].model.layers) == ["1", "3"]
    assert first[0].model.tok_embeddings is not None and first[0].model.output is None
    assert last[0].model.tok_embeddings is None and last[0].model.norm is not None
    assert [c.is_first for c in first] == [True, False]
    assert [c.is_last for c in last] == [False, True]


@pytest.mark.parametrize("preset", ["gpt2-debug", "llama3-debug"])
@pytest.mark.parametrize(("pp", "vpp"), [(2, 1), (4, 1), (2, 2)])
def test_stages_hold_the_whole_model_by_full_names_and_compose_to_it(
    preset: str, pp: int, vpp: int
) -> None:
    full = _model(preset)
    x = torch.randint(0, 64, (2, 8))
    expected = full(x)
    reference = full.state_dict()
    chunks_by_stage = {}
    names: set[str] = set()
    for rank in range(pp):
        chunks = split_model(_model(preset), rank, pp, vpp)
        names |= set(chunks[0].model.state_dict())
        for name, value in chunks[0].model.state_dict().items():
            torch.testing.assert_close(value, reference[name], rtol=0, atol=0)
        chunks_by_stage.update({c.index: c for c in chunks})
    assert names == set(reference)  # a tied head appears as `output.weight` on the last stage
    h = x
    for stage in range(pp * vpp):
        h = chunks_by_stage[stage](h, seq_len=8)
    torch.testing.assert_close(h, expected, rtol=0, atol=0)


def test_layers_not_divisible_by_stages_are_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"n_layer=4 .* pipeline_parallel=3 .* among \[1, 2, 4\]"):
        check_layers(4, 3, 1)
    with pytest.raises(ValueError, match=r"virtual_pipeline_parallel=2 = 8 stages"):
        split_model(_model("llama3-debug"), rank=0, pp=4, vpp=2)


def test_uneven_split_gives_the_last_stage_fewer_layers() -> None:
    full = _model("llama3-debug")
    x = torch.randint(0, 64, (2, 8))
    expected = full(x)
    first = split_model(_model("llama3-debug"), 0, 2, layers_per_stage=[3, 1])
    last = split_model(_model("llama3-debug"), 1, 2, layers_per_stage=[3, 1])
    assert list(first[0].model.layers) == ["0", "1", "2"] and list(last[0].model.layers) == ["3"]
    torch.testing.assert_close(last[0](first[0](x, 8), 8), expected, rtol=0, atol=0)
    # With layers_per_stage, any number of layers per stage is fine, including 3 stages.
    assert stage_layer_keys(4, 3, [2, 2, 0]) == [["0", "1"], ["2", "3"], []]


@pytest.mark.parametrize("counts", [[2, 1], [4, 0, 0], [5, -1]])
def test_bad_layers_per_stage_are_refused(counts: list[int]) -> None:
    with pytest.raises(ValueError, match=r"layers_per_stage=.* summing to n_layer=4"):
        check_layers(4, 2, 1, counts)


def test_chunk_partition_follows_the_chunks_and_sets_tied_weights_apart() -> None:
    """The gradient engine's buckets follow it, so a chunk reduces once it is done."""
    module = torch.nn.Module()
    module.model = _model("gpt2-debug")  # its head is tied to the embedding
    stages = split_model(module.model, rank=0, pp=2, vpp=2)
    tied = TiedParameters.of(module)
    partition = chunk_partition(module, stages, tied)
    assert partition["model.tok_embeddings.weight"] == TIED
    assert {partition[n] for n in partition if n.startswith("model.layers.0.")} == {0}
    assert {partition[n] for n in partition if n.startswith("model.layers.2.")} == {1}
    last = torch.nn.Module()
    last.model = _model("gpt2-debug")
    stages = split_model(last.model, rank=1, pp=2, vpp=2)
    partition = chunk_partition(last, stages, TiedParameters.of(last))
    assert partition["model.output.weight"] == TIED
    assert partition["model.norm.weight"] == 1  # the last stage's chunk runs the head
    assert {partition[n] for n in partition if n.startswith("model.layers.1.")} == {0}
