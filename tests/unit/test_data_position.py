"""The data position in a checkpoint is the whole data-parallel group's, so any layout resumes it.

The reference is the uninterrupted single-process order: the samples a resumed run (any dp
size, any per-rank batch) draws at each step must be exactly the ones one process at the
same global batch would draw next.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from plugintrain.data import TokenDataModule, write_token_bin

T = 4
WINDOWS = 40


@pytest.fixture
def data_dir(tmp_path):
    # Token value == position, so a window's first input token / T is its index.
    write_token_bin(tmp_path / "train.bin", np.arange(WINDOWS * T + 1))
    write_token_bin(tmp_path / "val.bin", np.arange(3 * T + 1))
    return tmp_path


def _fake_trainer(replicas: int, rank: int, processed: int = 0, epoch: int = 0):
    progress = SimpleNamespace(current=SimpleNamespace(processed=processed, ready=processed))
    return SimpleNamespace(
        strategy=SimpleNamespace(
            distributed_sampler_kwargs={"num_replicas": replicas, "rank": rank},
            root_device=torch.device("cpu"),
        ),
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)),
        current_epoch=epoch,
    )


def _module(data_dir, batch: int, replicas: int, rank: int, **trainer) -> TokenDataModule:
    dm = TokenDataModule(data_dir=str(data_dir), seq_len=T, batch_size=batch, seed=3)
    dm.trainer = _fake_trainer(replicas, rank, **trainer)
    dm.setup("fit")
    return dm


def _steps(data_dir, batch: int, replicas: int, state=None, processed: int = 0) -> list[set]:
    """The samples of each step of epoch 0, over all ranks of a dp group of ``replicas``."""
    per_rank = []
    for rank in range(replicas):
        dm = _module(data_dir, batch, replicas, rank, processed=processed)
        if state is not None:
            dm.load_state_dict(state)
        loader = dm.train_dataloader()
        per_rank.append([set((x[:, 0] // T).tolist()) for x, _ in loader])
    return [set().union(*batches) for batches in zip(*per_rank, strict=True)]


@pytest.mark.parametrize(
    ("saved", "resumed"), [((2, 2), (1, 4)), ((1, 4), (4, 1)), ((4, 1), (2, 2))]
)
def test_a_resume_under_another_dp_size_continues_the_single_process_order(
    data_dir, saved, resumed
) -> None:
    (saved_dp, saved_batch), (resumed_dp, resumed_batch) = saved, resumed
    uninterrupted = _steps(data_dir, batch=4, replicas=1)
    # Three steps done under the saving layout: what its rank 0 writes into the checkpoint.
    state = _module(data_dir, saved_batch, saved_dp, 0, processed=3).state_dict()
    assert state == {"epoch": 0, "position": 12}
    continued = _steps(data_dir, resumed_batch, resumed_dp, state, processed=3)
    assert continued == uninterrupted[3 : 3 + len(continued)]
    assert len(continued) == len(uninterrupted) - 3


def test_a_resumed_run_counts_only_its_own_batches_on_top(data_dir) -> None:
    """In the resumed epoch Lightning's restored batch count is the saving layout's; the
    position grows by this layout's group batch from there."""
    dm = _module(data_dir, batch=1, replicas=4, rank=0, processed=3)
    dm.load_state_dict({"epoch": 0, "position": 12})  # saved by dp=1 x batch 4 after 3 steps
    dm.train_dataloader()
    dm.trainer.fit_loop.epoch_loop.batch_progress.current.processed = 5  # two more steps
    assert dm.state_dict() == {"epoch": 0, "position": 12 + 2 * 4}


def test_older_checkpoints_counted_samples_per_rank(data_dir) -> None:
    dm = _module(data_dir, batch=2, replicas=2, rank=1)
    dm.load_state_dict({"epoch": 0, "samples": 4})  # rank-local, same layout
    assert dm._train_sampler is None
    first = next(iter(dm.train_dataloader()))[0][:, 0] // T
    reference = _steps(data_dir, batch=4, replicas=1)[2]
    assert set(first.tolist()) <= reference
