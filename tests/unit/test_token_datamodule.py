"""TokenDataModule: windows, seeded data-parallel sharding, checks, and exact resume."""

import json
import shlex
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from plugintrain.core.contracts import TokenBytesSource
from plugintrain.data import TokenDataModule, write_token_bin, write_token_bytes
from plugintrain.tools._command import parse
from plugintrain.tools.prepare import PREPARE

T, B = 4, 2


def _prepare_args(words: list[str]) -> SimpleNamespace:
    """What ``plugintrain prepare WORDS`` parses to (nothing runs): its dataset and options."""
    options = parse(PREPARE.commands[words[0]], words[1:], f"plugintrain prepare {words[0]}")
    return SimpleNamespace(dataset=words[0], **options)


@pytest.fixture
def data_dir(tmp_path):
    # Token value == position, so a window's first input token / T is its index.
    write_token_bin(tmp_path / "train.bin", np.arange(14 * T + 3))  # 14 windows
    write_token_bin(tmp_path / "val.bin", np.arange(3 * T + 1))  # 3 windows
    return tmp_path


def _fake_trainer(dp: dict | None = None, device: str = "cpu") -> SimpleNamespace:
    """A stand-in trainer whose strategy reports a data-parallel layout and its device."""
    strategy = SimpleNamespace(distributed_sampler_kwargs=dp, root_device=torch.device(device))
    return SimpleNamespace(strategy=strategy)


def _datamodule(data_dir, dp=None, **kwargs):
    dm = TokenDataModule(data_dir=str(data_dir), seq_len=T, batch_size=B, **kwargs)
    if dp is not None:
        dm.trainer = _fake_trainer(dp)
    dm.setup("fit")
    return dm


def _epoch(dm, epoch=0):
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(epoch)
    return [(x[:, 0] // T).tolist() for x, _ in loader]


def test_windows_are_next_token_pairs(data_dir):
    dm = _datamodule(data_dir)
    assert len(dm.train_set) == 14 and len(dm.val_set) == 3
    x, y = dm.train_set[5]
    assert x.dtype == y.dtype == torch.int64
    assert x.tolist() == list(range(5 * T, 6 * T))
    assert y.tolist() == list(range(5 * T + 1, 6 * T + 1))
    xb, yb = next(iter(dm.val_dataloader()))
    assert xb.shape == yb.shape == (B, T)
    assert xb[:, 0].tolist() == [0, T]  # validation is in order


def test_shuffle_is_seeded_per_epoch(data_dir):
    first = _epoch(_datamodule(data_dir))
    assert first == _epoch(_datamodule(data_dir))
    assert first != _epoch(_datamodule(data_dir), epoch=1)
    assert first != _epoch(_datamodule(data_dir, seed=7))
    assert sorted(i for batch in first for i in batch) == list(range(14))
    assert _epoch(_datamodule(data_dir, shuffle=False))[0] == [0, 1]


def test_data_parallel_ranks_partition_the_epoch(data_dir):
    ranks = [_epoch(_datamodule(data_dir, dp={"num_replicas": 2, "rank": r})) for r in (0, 1)]
    samples = [{i for batch in batches for i in batch} for batches in ranks]
    assert len(ranks[0]) == len(ranks[1]) == 3  # 7 windows per rank, full batches only
    assert not samples[0] & samples[1]
    assert len(samples[0] | samples[1]) == 12


def test_tensor_parallel_peers_see_the_same_batches(data_dir):
    # tp peers report the same dp layout, whatever their global rank.
    layout = {"num_replicas": 2, "rank": 1}
    assert _epoch(_datamodule(data_dir, dp=layout)) == _epoch(_datamodule(data_dir, dp=layout))
    assert _epoch(_datamodule(data_dir, dp=None)) == _epoch(_datamodule(data_dir))


@pytest.mark.parametrize(("device", "pinned"), [("cpu", False), ("cuda", True)])
def test_batches_are_pinned_only_for_a_cuda_device(data_dir, device, pinned):
    """Pinned host memory lets the copy to the GPU run asynchronously (Lightning's transfer
    is non-blocking for CUDA, see below); a CPU run has no copy to overlap."""
    dm = _datamodule(data_dir)
    assert not dm.train_dataloader().pin_memory  # outside a trainer
    dm.trainer = _fake_trainer({"num_replicas": 1, "rank": 0}, device)
    assert dm.train_dataloader().pin_memory is pinned
    assert dm.val_dataloader().pin_memory is pinned


def test_lightning_copies_batches_to_cuda_without_blocking(monkeypatch):
    """The transfer that pinning serves: Lightning's default batch transfer passes
    ``non_blocking=True`` for CUDA (and not for the CPU), so nothing needs overriding."""
    from lightning.fabric.utilities.apply_func import move_data_to_device

    calls = []
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: calls.append(k) or self)
    batch = (torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
    move_data_to_device(batch, torch.device("cuda", 0))
    move_data_to_device(batch, torch.device("cpu"))
    assert calls == [{"non_blocking": True}] * 2 + [{}] * 2


def test_out_of_vocab_token_raises(data_dir):
    with pytest.raises(ValueError, match=r"contains token id 58, outside .*vocab_size=50"):
        _datamodule(data_dir, vocab_size=50)


def test_seq_len_above_model_limit_raises(data_dir):
    with pytest.raises(ValueError, match="seq_len=4 exceeds the model's max_seq_len=2"):
        _datamodule(data_dir, max_seq_len=2)


def test_short_file_raises(tmp_path):
    write_token_bin(tmp_path / "train.bin", np.arange(T))
    write_token_bin(tmp_path / "val.bin", np.arange(T + 1))
    with pytest.raises(ValueError, match=r"holds 4 tokens, too few .*needs 5"):
        _datamodule(tmp_path)


def test_missing_file_says_how_to_prepare(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        TokenDataModule(str(tmp_path), seq_len=T, batch_size=B, tokenizer="llama3")
    assert str(info.value) == (
        f"token file {tmp_path / 'train.bin'} not found; create it with"
        f" `plugintrain prepare shakespeare --tokenizer llama3 --out {tmp_path}`"
    )
    args = _prepare_args(_command(str(info.value))[2:])
    assert (args.dataset, args.tokenizer, args.out) == ("shakespeare", "llama3", str(tmp_path))


def _meta(data_dir, tokenizer="gpt2", vocab_size=50257):
    (data_dir / "meta.json").write_text(
        json.dumps({"dataset": "shakespeare", "tokenizer": tokenizer, "vocab_size": vocab_size})
    )
    return data_dir


def _command(message):
    """The backquoted ``plugintrain ...`` command of a message, as argv."""
    return shlex.split(message.split("`")[1])


def test_token_files_of_another_tokenizer_are_refused_on_construction(data_dir):
    _meta(data_dir, "gpt2")
    with pytest.raises(ValueError) as info:
        TokenDataModule(str(data_dir), seq_len=T, batch_size=B, tokenizer="llama3")
    out = data_dir.parent / "shakespeare_llama3"
    assert str(info.value) == (
        f"{data_dir} holds gpt2 tokens (its meta.json) but the model reads llama3 tokens;"
        f" prepare them with `plugintrain prepare shakespeare --tokenizer llama3 --out {out}`"
        f" and pass `--data.init_args.data_dir {out}`"
    )
    args = _prepare_args(_command(str(info.value))[2:])
    assert (args.tokenizer, args.out, args.overwrite) == ("llama3", str(out), False)
    # The same tokenizer, or files that record none (llm.c's), are accepted.
    TokenDataModule(str(data_dir), seq_len=T, batch_size=B, tokenizer="gpt2")
    (data_dir / "meta.json").unlink()
    TokenDataModule(str(data_dir), seq_len=T, batch_size=B, tokenizer="llama3")


def test_a_tokenizer_path_matches_however_it_is_spelled(data_dir, monkeypatch):
    # prepare records a path made absolute; a model may name it relative to where it runs.
    monkeypatch.chdir(data_dir.parent)
    _meta(data_dir, str(data_dir.parent / "hf" / "tokenizer.json"))
    TokenDataModule(str(data_dir), seq_len=T, batch_size=B, tokenizer="hf/tokenizer.json")
    with pytest.raises(ValueError) as info:
        TokenDataModule(str(data_dir), seq_len=T, batch_size=B, tokenizer="models/Smol.Q4.gguf")
    out = data_dir.parent / "shakespeare_Smol.Q4"  # named for the file, not its whole path
    args = _prepare_args(_command(str(info.value))[2:])
    assert (args.tokenizer, args.out, args.overwrite) == ("models/Smol.Q4.gguf", str(out), False)


def test_bytes_per_token_are_read_in_setup(data_dir):
    assert _datamodule(data_dir).token_bytes is None  # token files prepared without them
    table = np.arange(64, dtype=np.int32) % 5
    write_token_bytes(data_dir, table)
    dm = _datamodule(data_dir)
    assert isinstance(dm, TokenBytesSource)
    assert dm.token_bytes.tolist() == table.tolist()
    np.save(data_dir / "token_bytes.npy", np.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"token_bytes.npy: expected a 1-D integer array"):
        _datamodule(data_dir)


def test_a_vocabulary_smaller_than_the_tokenizer_s_is_refused_on_construction(data_dir):
    _meta(data_dir, "gpt2", vocab_size=50257)
    with pytest.raises(ValueError) as info:
        TokenDataModule(str(data_dir), seq_len=T, batch_size=B, vocab_size=1000)
    assert str(info.value) == (
        f"{data_dir} holds gpt2 tokens with ids up to 50256 (its meta.json), outside the"
        " model's vocab_size=1000; give the model a vocab_size of at least 50257"
    )


class _Recorder(L.LightningModule):
    """Records (epoch, batch_idx, window indices) of every training batch it sees."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen = []

    def training_step(self, batch, batch_idx):
        x, _ = batch
        self.seen.append((self.current_epoch, batch_idx, (x[:, 0] // T).tolist()))
        return (self.w - 1).pow(2).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_save_checkpoint(self, checkpoint):
        checkpoint["seen"] = list(self.seen)

    def on_load_checkpoint(self, checkpoint):
        self.seen = list(checkpoint["seen"])


class _SaveEveryBatch(Callback):
    """Checkpoints after every batch, also between the batches of one accumulation."""

    def __init__(self, dirpath):
        self.dirpath = dirpath

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        trainer.save_checkpoint(self.dirpath / f"batch{len(pl_module.seen):03d}.ckpt")


def _fit(data_dir, accumulate, callbacks=(), ckpt_path=None):
    model = _Recorder()
    trainer = L.Trainer(
        max_epochs=2,
        accumulate_grad_batches=accumulate,
        callbacks=list(callbacks),
        enable_checkpointing=bool(callbacks),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=data_dir,  # Lightning's default checkpoint lands here, not in the repo
    )
    trainer.fit(model, TokenDataModule(str(data_dir), seq_len=T, batch_size=B), ckpt_path=ckpt_path)
    return model.seen


@pytest.mark.parametrize(
    ("accumulate", "saver", "n_checkpoints"),
    # With accumulation 2, an epoch of 7 batches takes 4 optimizer steps (the last one
    # flushes the odd batch), so ModelCheckpoint saves 8 times in 2 epochs.
    [(1, "model_checkpoint", 14), (2, "model_checkpoint", 8), (2, "every_batch", 14)],
)
def test_resume_continues_with_the_uninterrupted_batches(
    data_dir, tmp_path, accumulate, saver, n_checkpoints
):
    ckpt_dir = tmp_path / "ckpt"
    callback = (
        ModelCheckpoint(ckpt_dir, filename="{epoch}-{step}", every_n_train_steps=1, save_top_k=-1)
        if saver == "model_checkpoint"
        else _SaveEveryBatch(ckpt_dir)
    )
    full = _fit(data_dir, accumulate, [callback])
    assert len(full) == 14  # 7 batches per epoch, 2 epochs
    checkpoints = sorted(ckpt_dir.glob("*.ckpt"))
    # Every checkpoint, including the one at the last batch of epoch 0 (the boundary).
    assert len(checkpoints) == n_checkpoints
    for ckpt in checkpoints:
        assert _fit(data_dir, accumulate, ckpt_path=ckpt) == full, ckpt.name


def test_resume_position_applies_per_rank_and_only_to_its_epoch(data_dir):
    layout = {"num_replicas": 2, "rank": 1}
    full = [_epoch(_datamodule(data_dir, dp=layout), epoch=e) for e in (0, 1)]
    dm = _datamodule(data_dir, dp=layout)
    dm.load_state_dict({"epoch": 1, "samples": 2 * B})
    assert _epoch(dm, epoch=1) == full[1][2:]
    assert _epoch(dm, epoch=0) == full[0]


@pytest.mark.parametrize("size", [10, 11, 13])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_the_sampler_deals_out_distributed_sampler_s_order(size, shuffle, drop_last):
    """Without a resume, every rank's indices are torch's DistributedSampler's, exactly
    (held as an array, not a list of the epoch)."""
    from torch.utils.data import DistributedSampler

    from plugintrain.data import ResumableSampler

    data = list(range(size))
    for replicas in (1, 2, 3, 4):
        for rank in range(replicas):
            ours = ResumableSampler(data, replicas, rank, shuffle, seed=5, drop_last=drop_last)
            torchs = DistributedSampler(
                data, replicas, rank, shuffle=shuffle, seed=5, drop_last=drop_last
            )
            ours.set_epoch(2)
            torchs.set_epoch(2)
            assert list(ours) == list(torchs)
            assert len(list(ours)) == len(ours)
