"""Shard-first initialization: any piece of a tensor, initialized alone, equals that piece
of the whole tensor initialized in one go (the reference), across generator chunks."""

from __future__ import annotations

import pytest
import torch

from plugintrain.core.initialization import CHUNK, normal_box_, seeded_normal_
from plugintrain.core.tensor_boxes import flat_boxes

SHAPE = (1500, 1601)  # 2.4 Mi elements: three generator chunks, rows straddling them


@pytest.fixture(scope="module")
def whole() -> torch.Tensor:
    assert SHAPE[0] * SHAPE[1] > 2 * CHUNK
    return seeded_normal_(torch.empty(SHAPE), 0.02, seed=7, key="layers.0.w1.weight")


BOXES = {
    "row shard (colwise tp, FSDP dim 0)": ((750, 0), (750, 1601)),
    "column shard (rowwise tp)": ((0, 800), (1500, 801)),
    "2-D shard (FSDP over tp)": ((375, 800), (375, 801)),
    "one element": ((1499, 1600), (1, 1)),
}


@pytest.mark.parametrize("box", BOXES.values(), ids=BOXES.keys())
def test_a_shard_initialized_alone_equals_its_part_of_the_whole(
    whole: torch.Tensor, box: tuple[tuple[int, int], tuple[int, int]]
) -> None:
    (r, c), (h, w) = box
    local = normal_box_(torch.empty(h, w), box, SHAPE, 0.02, seed=7, key="layers.0.w1.weight")
    assert torch.equal(local, whole[r : r + h, c : c + w])


def test_values_follow_seed_and_name_not_the_generator(whole: torch.Tensor) -> None:
    torch.manual_seed(123)  # the global generator plays no part
    again = seeded_normal_(torch.empty(SHAPE), 0.02, seed=7, key="layers.0.w1.weight")
    assert torch.equal(again, whole)
    other = seeded_normal_(torch.empty(SHAPE), 0.02, seed=7, key="layers.1.w1.weight")
    assert not torch.equal(other, whole)
    assert abs(whole.std().item() - 0.02) < 1e-4 and abs(whole.mean().item()) < 1e-4


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4), ()])
def test_flat_boxes_cover_a_range_in_order(shape: tuple[int, ...]) -> None:
    numel = torch.Size(shape).numel()
    index = torch.arange(numel).view(shape)
    for start in range(numel):
        for length in range(numel - start + 1):
            covered = []
            for offsets, sizes in flat_boxes(shape, start, length):
                part = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
                covered += part.reshape(-1).tolist()
            assert covered == list(range(start, start + length))
