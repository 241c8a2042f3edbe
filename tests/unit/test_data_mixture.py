"""TokenDataModule over ``prepare text``'s shards and over weighted mixtures of folders:
windows across shards, sha256 checked at start, document-respecting windows, each source's
share of a mixture, and exact resume mid-mixture (same and changed weights, any dp size)."""

from __future__ import annotations

import json
from collections import Counter
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from test_data_position import _fake_trainer  # the trainer a datamodule sees

from plugintrain.data import TokenDataModule
from plugintrain.data.datamodules.mixture import IndexPermutation, Interleave
from plugintrain.data.prepare.corpus import PrepareOptions, prepare_text

T = 4


def _prepared(root: Path, docs: list[str], shard_tokens: int = 50) -> Path:
    (root / "in").mkdir(parents=True)
    for i, doc in enumerate(docs):
        (root / "in" / f"{i:04d}.txt").write_text(doc)
    options = PrepareOptions("gpt2", val_docs=1, shard_tokens=shard_tokens)
    prepare_text([str(root / "in")], root / "out", options, num_proc=1, progress=False)
    return root / "out"


def _shard_tokens(folder: Path, split: str = "train") -> np.ndarray:
    from plugintrain.data import read_token_bin

    meta = json.loads((folder / "meta.json").read_text())
    files = [folder / s["file"] for s in meta["splits"][split]["shards"]]
    return np.concatenate([np.asarray(read_token_bin(f), dtype=np.int64) for f in files])


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Three prepared folders of different sizes, many shards each."""
    root = tmp_path_factory.mktemp("mixture")
    words = ["alpha", "beta", "gamma"]
    return {
        w: _prepared(root / w, [f"{w} {i} " * (3 + i % 5) for i in range(n)])
        for w, n in zip(words, (120, 60, 30), strict=True)
    }


def _module(replicas=1, rank=0, processed=0, batch=4, **kwargs) -> TokenDataModule:
    dm = TokenDataModule(seq_len=T, batch_size=batch, seed=7, **kwargs)
    dm.trainer = _fake_trainer(replicas, rank, processed)
    dm.setup("fit")
    return dm


def test_windows_run_across_shards_as_one_token_stream(sources):
    folder = sources["alpha"]
    meta = json.loads((folder / "meta.json").read_text())
    assert len(meta["splits"]["train"]["shards"]) > 5
    dm = _module(data_dir=str(folder), shuffle=False)
    tokens = _shard_tokens(folder)
    assert len(dm.train_set) == (len(tokens) - 1) // T
    for i in (0, 7, len(dm.train_set) - 1):
        x, y = dm.train_set[i]
        assert x.tolist() == tokens[i * T : i * T + T].tolist()
        assert y.tolist() == tokens[i * T + 1 : i * T + T + 1].tolist()
    assert dm.val_set is not None and len(dm.val_set) >= 1


def test_respect_documents_keeps_every_window_inside_one_document(sources):
    folder = sources["alpha"]
    dm = _module(data_dir=str(folder), respect_documents=True, shuffle=False)
    tokens = _shard_tokens(folder)
    doc_starts = np.concatenate([[0], np.flatnonzero(tokens == 50256) + 1])
    assert len(dm.train_set) > 0
    for i in range(len(dm.train_set)):
        x, y = dm.train_set[i]
        start = int(dm.train_set.starts[i])
        assert x.tolist() == tokens[start : start + T].tolist()
        # No boundary inside: the only EOS a window holds is its last target.
        assert 50256 not in x.tolist() and 50256 not in y.tolist()[:-1]
        # Cut from its document's start in whole windows.
        doc_start = doc_starts[np.searchsorted(doc_starts, start, side="right") - 1]
        assert (start - doc_start) % T == 0
    # Every document long enough for a window has its first window.
    lengths = np.diff(np.append(doc_starts, len(tokens)))
    assert set(doc_starts[lengths > T].tolist()) <= set(dm.train_set.starts.tolist())


def test_a_changed_shard_is_refused_at_start_and_a_verified_one_is_not_read_again(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("PLUGINTRAIN_CACHE", str(tmp_path / "cache"))
    folder = _prepared(tmp_path, ["one two three four five six seven"] * 20)
    TokenDataModule(data_dir=str(folder), seq_len=T)
    assert (tmp_path / "cache" / "verified-shards.json").is_file()
    import plugintrain.data.datamodules.token_shards as token_shards

    def no_hashing(path):
        raise AssertionError(f"{path} hashed again")

    with monkeypatch.context() as patch:
        patch.setattr(token_shards, "sha256_file", no_hashing)
        TokenDataModule(data_dir=str(folder), seq_len=T)  # every shard verified before
    shard = (
        folder
        / json.loads((folder / "meta.json").read_text())["splits"]["train"]["shards"][1]["file"]
    )
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"sha256 .* does not match .*prepare the data again"):
        TokenDataModule(data_dir=str(folder), seq_len=T)


def test_each_source_s_share_is_within_one_percent_of_its_weight(sources):
    weights = {"alpha": 0.2, "beta": 0.5, "gamma": 0.3}
    mix = [{"path": str(sources[w]), "weight": v} for w, v in weights.items()]
    dm = _module(mix=mix, batch=1)
    dataset = dm.train_set
    first_token = {w: _shard_tokens(sources[w])[0] for w in weights}
    counts: Counter = Counter()
    draws = 10_000  # several epochs of the mixture
    for sample in range(draws):
        k, _ = dataset.locate(sample)
        counts[list(weights)[k]] += 1
    for w, v in weights.items():
        assert abs(counts[w] / draws - v) < 0.01, (w, counts)
    # The samples really come from those folders: read a few and find them in the source.
    for sample in range(20):
        k, _ = dataset.locate(sample)
        x, _ = dataset[sample]
        assert x.tolist()[0] in _shard_tokens(sources[list(weights)[k]]).tolist()
    assert all(first_token.values())


def test_the_interleave_is_every_source_s_samples_in_key_order():
    """Against a brute-force sort of every sample by its key ``(i + 1/2) / m_k`` (exact
    fractions), ties to the lower source: which source each sample comes from and how many
    of each precede it."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        counts = rng.integers(0, 25, size=rng.integers(1, 6)).tolist()
        order = sorted(
            (Fraction(2 * i + 1, 2 * m), k) for k, m in enumerate(counts) for i in range(m)
        )
        interleave, seen = Interleave(counts), [0] * len(counts)
        for j, (_, k) in enumerate(order):
            assert interleave.counts_before(j) == seen
            assert interleave.locate(j) == (k, seen[k])
            seen[k] += 1
        assert interleave.counts_before(len(order)) == seen == counts


@pytest.mark.parametrize("size", [1, 2, 3, 17, 1000, 4097])
def test_an_index_permutation_is_a_seeded_permutation(size):
    values = [IndexPermutation(size, 7, 0, 0)[i] for i in range(size)]
    assert sorted(values) == list(range(size))
    other = [IndexPermutation(size, 8, 0, 0)[i] for i in range(size)]
    assert size < 17 or values != other


def test_a_resume_keeps_its_position_in_its_own_epoch_only(sources):
    """After a resume, the next epochs are whole and the uninterrupted run's."""
    mix = [{"path": str(sources[w]), "weight": v} for w, v in (("beta", 1), ("gamma", 3))]
    reference = _module(mix=mix)
    epochs = []
    for epoch in (0, 1):
        reference.trainer.current_epoch = epoch
        loader = reference.train_dataloader()
        loader.sampler.set_epoch(epoch)
        epochs.append([x.tolist() for x, _ in loader])
    state = _module(processed=3, mix=mix).state_dict()
    resumed = _module(processed=3, mix=mix)
    resumed.load_state_dict(state)
    loader = resumed.train_dataloader()
    assert [x.tolist() for x, _ in loader] == epochs[0][3:]
    loader.sampler.set_epoch(1)
    assert [x.tolist() for x, _ in loader] == epochs[1]


def _epoch_samples(dm: TokenDataModule) -> list[list[int]]:
    """Each batch's samples as their first token positions (the source-window identity)."""
    return [x.tolist() for x, _ in dm.train_dataloader()]


@pytest.mark.parametrize(("saved", "resumed"), [((1, 4), (2, 2)), ((2, 2), (4, 1))])
def test_a_resume_mid_mixture_continues_the_exact_order(sources, saved, resumed):
    mix = [{"path": str(sources[w]), "weight": v} for w, v in (("alpha", 1), ("beta", 2))]
    uninterrupted = _steps(mix, replicas=1, batch=4)
    (dp, batch), (dp2, batch2) = saved, resumed
    state = _module(dp, 0, processed=5, batch=batch, mix=mix).state_dict()
    assert state["position"] == 20 and "mixture" in state
    continued = _steps(mix, replicas=dp2, batch=batch2, state=state, processed=5)
    assert continued == uninterrupted[5 : 5 + len(continued)]
    assert len(continued) == len(uninterrupted) - 5


def _steps(mix, replicas, batch, state=None, processed=0, **kwargs) -> list[list[list[int]]]:
    """Each step's sequences over the whole dp group, sorted (rank order is not the point)."""
    per_rank = []
    for rank in range(replicas):
        dm = _module(replicas, rank, processed=processed, batch=batch, mix=mix, **kwargs)
        if state is not None:
            dm.load_state_dict(state)
        per_rank.append(_epoch_samples(dm))
    return [sorted(x for batch in step for x in batch) for step in zip(*per_rank, strict=True)]


def test_new_weights_continue_every_source_where_it_stopped(sources):
    old = [{"path": str(sources[w]), "weight": v} for w, v in (("alpha", 1), ("beta", 1))]
    new = [{"path": str(sources[w]), "weight": v} for w, v in (("alpha", 1), ("beta", 3))]
    dm = _module(mix=old, processed=6, batch=4)
    state = dm.state_dict()
    consumed = state["mixture"]["consumed"]
    resumed = _module(mix=new, processed=6, batch=4)
    resumed.load_state_dict(state)
    dataset = resumed.train_set
    # The next sample of each source is the one its stream would have given next.
    seen = {0: [], 1: []}
    for sample in range(state["position"], state["position"] + 40):
        k, n = dataset.locate(sample)
        seen[k].append(n)
    assert seen[0][0] == consumed[0] and seen[1][0] == consumed[1]
    assert seen[1] == list(range(consumed[1], consumed[1] + len(seen[1])))
    assert len(seen[1]) > 2 * len(seen[0])  # the new weights apply from here on


def test_other_sources_on_resume_are_refused(sources):
    mix = [
        {"path": str(sources["alpha"]), "weight": 1},
        {"path": str(sources["beta"]), "weight": 1},
    ]
    state = _module(mix=mix, processed=2).state_dict()
    other = [
        {"path": str(sources["alpha"]), "weight": 1},
        {"path": str(sources["gamma"]), "weight": 1},
    ]
    with pytest.raises(ValueError, match="only the weights may change"):
        _module(mix=other, processed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="trained on a mixture"):
        _module(data_dir=str(sources["alpha"])).load_state_dict(state)


@pytest.mark.parametrize("weight", [0, -1, "a", True])
def test_a_weight_that_is_not_positive_is_refused(sources, weight):
    mix = [{"path": str(sources["alpha"]), "weight": weight}]
    with pytest.raises(ValueError, match=r"mix\[0\]\.weight = .*must be numbers > 0"):
        TokenDataModule(mix=mix, seq_len=T)


def test_folders_of_different_tokenizers_are_not_mixed(sources, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    meta = json.loads((sources["beta"] / "meta.json").read_text())
    (other / "meta.json").write_text(json.dumps({**meta, "tokenizer": "llama3"}))
    mix = [{"path": str(sources["alpha"]), "weight": 1}, {"path": str(other), "weight": 1}]
    with pytest.raises(ValueError, match="different tokenizers"):
        TokenDataModule(mix=mix, seq_len=T, verify_shards=False)


def test_a_folder_without_held_out_documents_is_refused_before_training(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("one two three four five six seven eight nine")
    options = PrepareOptions("gpt2", val_fraction=0.0)
    prepare_text([str(tmp_path / "in")], tmp_path / "out", options, num_proc=1, progress=False)
    with pytest.raises(ValueError, match=r"no held-out documents .* --val_docs N --overwrite"):
        TokenDataModule(data_dir=str(tmp_path / "out"), seq_len=T)


def test_ids_outside_the_model_s_vocabulary_are_refused_before_training(sources):
    with pytest.raises(ValueError, match=r"ids up to 50256 .*outside the model's vocab_size=1000"):
        TokenDataModule(data_dir=str(sources["beta"]), seq_len=T, vocab_size=1000)
    mix = [
        {"path": str(sources["alpha"]), "weight": 1},
        {"path": str(sources["beta"]), "weight": 1},
    ]
    with pytest.raises(ValueError, match="outside the model's vocab_size=1000"):
        TokenDataModule(mix=mix, seq_len=T, vocab_size=1000)


def test_a_read_only_cache_only_costs_another_verification(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("PLUGINTRAIN_CACHE", str(tmp_path / "file" / "cache"))
    folder = _prepared(tmp_path, ["one two three four five six seven"] * 20)
    TokenDataModule(data_dir=str(folder), seq_len=T)
