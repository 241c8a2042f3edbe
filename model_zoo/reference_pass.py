"""The reference log-probs of full fine-tuning, computed by ``fit`` itself: a first pass
over the pairs before the first step, cached beside the data and resumable
(``PreferenceLM(reference="first_pass")``, and ``auto``'s choice when the data holds none
and no LoRA adapters are there to switch off).

Before any training step the model is the reference, so the pass scores every training
and held-out sequence with the model as the strategy laid it out, in the run's own
precision and without dropout: one copy of the weights, and the policy's log-ratios are 0
at the first step exactly. The pairs are cut into chunks of :data:`CHUNK_PAIRS`; the
data-parallel ranks take the chunks in turn (tensor-parallel peers score theirs together),
each in batches of the datamodule's ``batch_size`` pairs, and each chunk's log-probs are
written as one numpy file the moment they are done, so a stopped run scores only the
chunks it had not finished. Every rank runs as many forwards as every other (a rank out of
chunks runs a stand-in of one short batch), so the collectives of a sharded model (FSDP2)
line up.

The cache, ``DATA_DIR/reference_cache/<key>/`` (or the datamodule's ``reference_cache``
folder, which every rank must see), is keyed by what decides the numbers: the starting
weights (their spec, and the size and modification time of the file or of each file of
the folder; random weights' seed), the architecture, the precision and the prepared data
(the size and modification time of its files). A run resumed from a checkpoint must find
it complete, else it is refused (its model is no longer the reference).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from plugintrain.core.atomic_files import atomic_open
from plugintrain.core.preference_batch import unpack_reference

CHUNK_PAIRS = 64
"""Pairs a chunk holds: the unit a rank scores and a stopped run keeps."""
SPLITS = ("train", "val")


def cache_folder(module: Any, trainer: Any, datamodule: Any) -> Path:
    """The cache of this run's reference log-probs: a folder named by the key of the module
    docstring."""
    weights = module.weights
    key = {
        "weights": weights,
        "weights_files": None if weights is None else _stats(Path(weights)),
        "init_seed": module.init_seed if weights is None else None,  # random weights' seed
        "config": repr(module.config),
        "precision": str(trainer.precision),
        "data": _stats(Path(datamodule.data_dir)),
        "chunk_pairs": CHUNK_PAIRS,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return datamodule.reference_cache_root / digest


def _stats(path: Path) -> list[list[Any]] | None:
    """Name, size and modification time of ``path``, or of each file directly in it (a
    folder of weights, the prepared data): what changes when any of them is rewritten."""
    if not path.exists():
        return None  # a pretrained name
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def _chunk_file(folder: Path, split: str, chunk: int) -> Path:
    return folder / f"{split}.{chunk:06d}.npy"


def cached_logps(folder: Path, datamodule: Any) -> dict[str, np.ndarray] | None:
    """Each split's reference log-probs from a complete cache, else None."""
    out = {}
    for split, pairs in _splits(datamodule):
        chunks = [_chunk_file(folder, split, k) for k in range(_chunks(len(pairs)))]
        if not all(path.is_file() for path in chunks):
            return None
        out[split] = np.concatenate([np.load(path, allow_pickle=False) for path in chunks])
        if out[split].shape != (2 * len(pairs),):
            return None
    return out


def _splits(datamodule: Any) -> list[tuple[str, Any]]:
    sets = {"train": datamodule.train_set, "val": datamodule.val_set}
    return [(split, sets[split]) for split in SPLITS if sets[split] is not None]


def _chunks(pairs: int) -> int:
    return math.ceil(pairs / CHUNK_PAIRS)


def first_pass(module: Any, trainer: Any, datamodule: Any) -> dict[str, np.ndarray]:
    """Score every pair's sequences of ``datamodule`` with ``module``'s model (the chunks
    a cache lacks, shared among the data-parallel ranks) and return each split's log-probs
    ``(2n,)`` float64, from the cache. Every rank of the run calls it; rank 0 alone names
    the cache, lists what it lacks and reads it back, and hands the results to every rank.

    Raises:
        ValueError: On every rank, if the run resumes from a checkpoint and the cache is
            incomplete, or the chunks the ranks wrote are not all where rank 0 reads.
    """
    strategy = trainer.strategy
    first = strategy.global_rank == 0
    folder = strategy.broadcast(cache_folder(module, trainer, datamodule) if first else None, src=0)
    missing = strategy.broadcast(_missing(folder, datamodule) if first else None, src=0)
    if missing and trainer.ckpt_path is not None:
        raise ValueError(
            f"the reference log-probs cached in {folder} lack {len(missing)} chunks, and this"
            f" run resumes from {trainer.ckpt_path}, whose model is no longer the reference;"
            " start the run again from its first step, or prepare the pairs with `plugintrain"
            " prepare preference ... --reference WEIGHTS`"
        )
    if missing:
        _score_chunks(module, trainer, datamodule, folder, missing)
        strategy.barrier("reference_first_pass")
    logps = strategy.broadcast(cached_logps(folder, datamodule) if first else None, src=0)
    if logps is None:
        raise ValueError(
            f"the first pass's reference log-probs are not all in {folder} for rank 0 to read:"
            " set data.init_args.reference_cache to a folder every rank sees (a shared"
            " filesystem across nodes, as for checkpoints)"
        )
    return logps


def _missing(folder: Path, datamodule: Any) -> list[tuple[str, int]]:
    """``(split, chunk)`` of every chunk the cache lacks."""
    return [
        (split, chunk)
        for split, pairs in _splits(datamodule)
        for chunk in range(_chunks(len(pairs)))
        if not _chunk_file(folder, split, chunk).is_file()
    ]


@torch.no_grad()
def _score_chunks(
    module: Any, trainer: Any, datamodule: Any, folder: Path, missing: list[tuple[str, int]]
) -> None:
    """This rank's turn of the ``missing`` chunks, each written once scored; as many
    forwards on every rank."""
    replicas, rank = datamodule._data_parallel_layout()
    sets = dict(_splits(datamodule))
    per_chunk = math.ceil(CHUNK_PAIRS / datamodule.batch_size)
    pad_multiple = datamodule.collate_fn.pad_multiple
    context = trainer.strategy.precision_plugin.forward_context
    training = module.model.training
    module.model.eval()  # the reference without dropout, as the adapters-off one
    folder.mkdir(parents=True, exist_ok=True)
    try:
        for start in range(0, len(missing), replicas):
            turn = missing[start + rank] if start + rank < len(missing) else None
            batches = _batches(sets, turn, datamodule, per_chunk)
            scores = []
            for batch in batches:
                with context():
                    scores.append(_sequence_logps(module, batch, pad_multiple))
            if turn is not None:
                split, chunk = turn
                with atomic_open(_chunk_file(folder, split, chunk), shared=True) as stream:
                    np.save(stream, np.concatenate([s for s in scores if s is not None]))
    finally:
        module.model.train(training)


def _batches(
    sets: dict[str, Any], turn: tuple[str, int] | None, datamodule: Any, count: int
) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """The ``count`` batches of a chunk (None: a one-token forward in its place)."""
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * count
    if turn is None:
        return out
    split, chunk = turn
    pairs = sets[split]
    first, last = chunk * CHUNK_PAIRS, min((chunk + 1) * CHUNK_PAIRS, len(pairs))
    size = datamodule.batch_size
    for index, start in enumerate(range(first, last, size)):
        out[index] = datamodule.collate_fn(
            [pairs[i] for i in range(start, min(start + size, last))]
        )
    return out


def _sequence_logps(
    module: Any, batch: tuple[torch.Tensor, torch.Tensor] | None, pad_multiple: int
) -> np.ndarray | None:
    """The batch's rows' answer log-probs (float64), or None after a stand-in forward."""
    device = module.device
    if batch is None:  # a row as long as a batch's least (tensor- and sequence-parallel safe)
        module(torch.zeros(2, pad_multiple, dtype=torch.int64, device=device))
        return None
    x, y = (t.to(device) for t in batch)
    targets, _ = unpack_reference(y)
    return module.answer_logps(x, targets).double().cpu().numpy()
