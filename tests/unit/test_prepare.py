"""Preparing Shakespeare token files and MNIST IDX files from the offline assets."""

import gzip
import hashlib
import json
import shlex
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tokenizers import ByteLevelBPETokenizer

from plugintrain.cli import main
from plugintrain.data import (
    AssetError,
    MNISTDataModule,
    TokenDataModule,
    fetch_asset,
    get_tokenizer,
    prepare_mnist,
    prepare_shakespeare,
    read_idx,
    read_token_bin,
    write_idx,
)
from plugintrain.data.idx import IDX_FILES
from plugintrain.data.prepare import offline as prepare_module
from plugintrain.data.prepare.offline import FASHION_MNIST_DIR, FASHION_MNIST_SHA256


@pytest.fixture(scope="module")
def shakespeare_gpt2(tmp_path_factory):
    out = tmp_path_factory.mktemp("shakespeare_gpt2")
    return out, prepare_shakespeare(out, tokenizer="gpt2")


@pytest.fixture(scope="module")
def mnist_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("mnist")
    prepare_mnist(out)
    return out


def test_shakespeare_gpt2_token_files(shakespeare_gpt2):
    out, meta = shakespeare_gpt2
    train, val = read_token_bin(out / "train.bin"), read_token_bin(out / "val.bin")
    assert train.dtype == np.uint16  # version 1 files, as llm.c writes for GPT-2
    assert (len(train), len(val)) == (meta["train_tokens"], meta["val_tokens"])
    assert 0.05 <= len(val) / (len(train) + len(val)) <= 0.10
    assert max(train.max(), val.max()) < meta["vocab_size"] == 50257
    # Each work starts with the separator: 39 training works, 3 held out.
    assert (train == 50256).sum() == meta["train_works"] == 39
    assert (val == 50256).sum() == len(meta["val_works"]) == 3
    assert train[0] == val[0] == 50256
    assert "by William Shakespeare" in get_tokenizer("gpt2").decode(train[1:40].tolist())
    assert 4.0 < meta["val_unigram_xent_nats"] < np.log(50257)
    assert json.loads((out / "meta.json").read_text()) == meta


def _work_texts() -> dict[str, str]:
    files = fetch_asset("shakespeare").glob("*_gut.txt")
    return {p.name.removesuffix("_gut.txt"): p.read_text(encoding="utf-8") for p in files}


def test_shakespeare_bytes_per_token(shakespeare_gpt2):
    out, meta = shakespeare_gpt2
    table = np.load(out / "token_bytes.npy", allow_pickle=False)
    assert table.dtype == np.int32
    np.testing.assert_array_equal(table, get_tokenizer("gpt2").token_bytes())
    # The validation tokens spell the held-out works, byte for byte (separators spell none).
    texts = _work_texts()
    assert meta["val_bytes"] == sum(len(texts[name].encode()) for name in meta["val_works"])
    # The unigram baseline per byte, from the token files: add-one-smoothed training
    # frequencies, total validation NLL over the validation bytes.
    train, val = read_token_bin(out / "train.bin"), read_token_bin(out / "val.bin")
    counts = np.bincount(train, minlength=50257) + 1.0
    nll = -np.log(counts[val] / counts.sum()).sum()
    assert meta["val_unigram_bpb"] == pytest.approx(nll / meta["val_bytes"] / np.log(2))
    assert 1.0 < meta["val_unigram_bpb"] < 8.0


def test_a_dataset_prepared_before_bits_per_byte_is_completed(shakespeare_gpt2, tmp_path):
    out, meta = shakespeare_gpt2
    for name in ("train.bin", "val.bin"):
        shutil.copy(out / name, tmp_path / name)
    older = {k: v for k, v in meta.items() if k not in ("val_bytes", "val_unigram_bpb")}
    (tmp_path / "meta.json").write_text(json.dumps(older))
    stamp = (tmp_path / "train.bin").stat().st_mtime_ns
    assert prepare_shakespeare(tmp_path, tokenizer="gpt2") == meta
    assert (tmp_path / "train.bin").stat().st_mtime_ns == stamp  # completed, not rebuilt
    assert (tmp_path / "token_bytes.npy").read_bytes() == (out / "token_bytes.npy").read_bytes()


def test_a_bad_tokenizer_is_refused_before_anything_is_written(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"^unknown tokenizer 'gtp2': not one of \['gpt2'"):
        prepare_shakespeare(tmp_path / "out", tokenizer="gtp2")
    argv = ["prepare", "shakespeare", "--tokenizer", "gtp2", "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(
        "plugintrain prepare shakespeare: error: unknown tokenizer 'gtp2': not one of"
    )
    assert not (tmp_path / "out").exists()


def test_shakespeare_with_a_tokenizer_json(tmp_path, monkeypatch, capsys):
    # A small byte-level BPE as a Hugging Face tokenizer.json, named by a relative path.
    texts = _work_texts()
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        [texts["hamlet"]], vocab_size=600, special_tokens=["<|endoftext|>"], show_progress=False
    )
    (tmp_path / "tiny bpe").mkdir()
    bpe.save(str(tmp_path / "tiny bpe" / "tokenizer.json"))
    monkeypatch.chdir(tmp_path)
    assert main(["prepare", "shakespeare", "--tokenizer", "tiny bpe/tokenizer.json"]) == 0
    out = tmp_path / "data" / "shakespeare_tiny_bpe"  # the default, named for the directory
    meta = json.loads((out / "meta.json").read_text())
    assert json.loads(capsys.readouterr().out) == meta
    assert meta["tokenizer"] == str(tmp_path / "tiny bpe" / "tokenizer.json")
    assert (meta["vocab_size"], meta["bos_id"]) == (600, 0)
    assert meta["val_bytes"] == sum(len(texts[name].encode()) for name in meta["val_works"])
    assert prepare_shakespeare(out, tokenizer=str(tmp_path / "tiny bpe" / "tokenizer.json")) == meta
    # The model's tokenizer, however spelled, matches what meta.json recorded.
    TokenDataModule(str(out), seq_len=8, batch_size=2, tokenizer="tiny bpe/tokenizer.json")
    with pytest.raises(
        ValueError, match=r"holds .*tokenizer\.json tokens .* but the model reads gpt2"
    ):
        TokenDataModule(str(out), seq_len=8, batch_size=2, tokenizer="gpt2")


def test_shakespeare_is_idempotent(shakespeare_gpt2):
    out, meta = shakespeare_gpt2
    stamp = (out / "train.bin").stat().st_mtime_ns
    assert prepare_shakespeare(out, tokenizer="gpt2") == meta
    assert (out / "train.bin").stat().st_mtime_ns == stamp
    with pytest.raises(FileExistsError, match="overwrite=True"):
        prepare_shakespeare(out, tokenizer="gpt2", val_every=13)


def test_shakespeare_llama3_overwrites_other_data(tmp_path, shakespeare_gpt2):
    _, gpt2_meta = shakespeare_gpt2
    (tmp_path / "meta.json").write_text(json.dumps(gpt2_meta))
    with pytest.raises(FileExistsError, match="'tokenizer': 'gpt2'"):
        prepare_shakespeare(tmp_path, tokenizer="llama3", val_every=13)
    meta = prepare_shakespeare(tmp_path, tokenizer="llama3", val_every=13, overwrite=True)
    train = read_token_bin(tmp_path / "train.bin")
    assert train.dtype == np.uint32 and train[0] == 128000
    assert meta["vocab_size"] == 128256 and meta["bos_id"] == 128000
    assert (train == 128000).sum() == meta["train_works"]
    assert train.max() < 128256
    assert meta["val_works"] == ["henry_vi_part_3", "othello", "troilus_and_cressida"]


def test_mnist_idx_files_feed_the_datamodule(mnist_dir):
    assert len(read_idx(mnist_dir / IDX_FILES["train_images"], ndim=3)) == 4500
    assert len(read_idx(mnist_dir / IDX_FILES["test_labels"], ndim=1)) == 500
    dm = MNISTDataModule(str(mnist_dir), batch_size=100, val_fraction=0.1)
    dm.setup("fit")
    dm.setup("test")
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (4050, 450, 500)
    images, labels = next(iter(dm.train_dataloader()))
    assert images.shape == (100, 1, 28, 28) and labels.dtype.is_floating_point is False
    assert abs(float(images.mean())) < 0.2  # normalized with the MNIST mean and std
    for subset in (dm.train_set, dm.val_set, dm.test_set):
        assert set(subset.labels.tolist()) == set(range(10))


def test_mnist_is_idempotent_and_deterministic(mnist_dir, tmp_path):
    meta = prepare_mnist(mnist_dir)
    assert meta["train_images"] == 4500 and meta["test_images"] == 500
    prepare_mnist(tmp_path)
    for name in IDX_FILES.values():
        assert (tmp_path / name).read_bytes() == (mnist_dir / name).read_bytes()


def _fake_fashion(tmp_path):
    """A small stand-in for Debian's Fashion-MNIST directory; the sha256 of each IDX file."""
    src = tmp_path / "fashion"
    src.mkdir()
    rng = np.random.default_rng(0)
    arrays = {
        "train_images": rng.integers(0, 256, (20, 28, 28)),
        "train_labels": np.arange(20) % 10,
        "test_images": rng.integers(0, 256, (10, 28, 28)),
        "test_labels": np.arange(10),
    }
    digests = {}
    for key, array in arrays.items():
        plain = write_idx(tmp_path / IDX_FILES[key], array).read_bytes()
        (src / f"{IDX_FILES[key]}.gz").write_bytes(gzip.compress(plain))
        digests[IDX_FILES[key]] = hashlib.sha256(plain).hexdigest()
    return src, digests


def test_fashion_copies_gzipped_idx(tmp_path, monkeypatch):
    src, digests = _fake_fashion(tmp_path)
    monkeypatch.setattr(prepare_module, "FASHION_MNIST_SHA256", digests)
    out = tmp_path / "out"
    assert prepare_mnist(out, source="fashion", fashion_dir=src)["train_images"] == 20
    dm = MNISTDataModule(str(out), batch_size=5, val_fraction=0.2)
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set)) == (16, 4)


@pytest.mark.parametrize(("device", "pinned"), [("cpu", False), ("cuda", True)])
def test_mnist_batches_are_pinned_only_for_a_cuda_device(tmp_path, device, pinned):
    _fake_fashion(tmp_path)  # leaves the plain IDX files in tmp_path
    dm = MNISTDataModule(str(tmp_path), batch_size=5, val_fraction=0.2)
    dm.trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)))
    dm.setup("fit")
    assert dm.train_dataloader().pin_memory is pinned
    assert dm.val_dataloader().pin_memory is pinned


def test_fashion_files_other_than_debian_s_are_refused_before_writing(tmp_path):
    src, _ = _fake_fashion(tmp_path)  # not Fashion-MNIST: checked against the real sha256
    out = tmp_path / "out"
    name = IDX_FILES["train_images"]
    with pytest.raises(AssetError) as info:
        prepare_mnist(out, source="fashion", fashion_dir=src)
    assert str(info.value).startswith(
        f"{src / name}.gz: sha256 mismatch of the unpacked IDX data: expected"
        f" {FASHION_MNIST_SHA256[name]}, got "
    )
    assert str(info.value).endswith(
        "; reinstall it with `apt-get install --reinstall dataset-fashion-mnist`"
    )
    assert not out.exists()
    (src / f"{name}.gz").write_bytes(b"not gzip")
    with pytest.raises(AssetError, match="not a whole gzip file"):
        prepare_mnist(out, source="fashion", fashion_dir=src)


@pytest.mark.skipif(
    not Path(FASHION_MNIST_DIR).is_dir(), reason="Debian's dataset-fashion-mnist not installed"
)
def test_debian_fashion_mnist_matches_the_pinned_sha256(tmp_path):
    meta = prepare_mnist(tmp_path, source="fashion")
    assert (meta["train_images"], meta["test_images"]) == (60000, 10000)


def test_fashion_missing_says_how_to_install(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        prepare_mnist(tmp_path / "out", source="fashion", fashion_dir=tmp_path / "none")


def test_missing_mnist_says_how_to_prepare(tmp_path):
    # Refused on construction, so `plugintrain fit` stops before it launches anything.
    with pytest.raises(FileNotFoundError) as info:
        MNISTDataModule(str(tmp_path / "mnist"))
    assert str(info.value) == (
        f"{tmp_path / 'mnist' / IDX_FILES['train_images']}[.gz] not found; create the MNIST"
        f" files with `plugintrain prepare mnist --out {tmp_path / 'mnist'}`"
    )
    command = shlex.split(str(info.value).split("`")[1])
    assert main(command[1:]) == 0  # the hint works as given
    MNISTDataModule(str(tmp_path / "mnist"))


def test_bad_idx_header_is_named(tmp_path):
    path = write_idx(tmp_path / "x", np.zeros((2, 28, 28)))
    with pytest.raises(ValueError, match=r"bad IDX magic: expected \(0, 0, 8, 1\)"):
        read_idx(path, ndim=1)
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(ValueError, match="bad IDX data size"):
        read_idx(path, ndim=3)
