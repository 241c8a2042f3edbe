"""What ``--ckpt_path`` means, decided before anything is launched or written.

- ``last`` is the newest *complete* checkpoint in the run's checkpoint directory (a save
  killed midway is never picked); with none there, the run says plainly that it starts
  from scratch. Leftovers of a killed save are cleaned up first.
- Under ``torchrun --max-restarts N`` a restarted worker resumes from ``last`` by itself
  (:mod:`plugintrain.core.elastic`).
- The model options of the command line and config are compared with the checkpoint's
  hyperparameters: options left at their defaults take the checkpoint's values (as
  LightningCLI does), options set to something else are an error naming both values,
  unless ``--resume_overrides`` lists them.

Hyperparameters are read without unpickling code: ``hyper_parameters.json`` beside a
directory's shards, or a file's ``hyper_parameters`` with ``weights_only=True``.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from plugintrain.checkpoints.dcp import HPARAMS_FILENAME, read_hparams
from plugintrain.checkpoints.files import LIGHTNING_METADATA, load_torch_file, newest_complete
from plugintrain.checkpoints.files import recover as recover_leftovers
from plugintrain.core.elastic import elastic_restart, launching_rank

# LightningCLI's own entries beside a module's arguments.
_CLI_KEYS = ("_class_path", "_instantiator")


def resolve_ckpt_path(ckpt_path: str | None, checkpoint_dir: str | None) -> str | None:
    """The checkpoint a run resumes from: ``ckpt_path`` itself, or for ``last`` (given, or
    implied by an elastic restart) the newest complete one in ``checkpoint_dir``.

    Raises:
        FileNotFoundError: ``ckpt_path`` names nothing (one line, with the fix).
    """
    if ckpt_path is None and elastic_restart():
        ckpt_path = "last"
    if ckpt_path is None or ckpt_path in ("best", "hpc", "registry"):
        return ckpt_path
    if ckpt_path != "last":
        if "://" not in ckpt_path and not Path(ckpt_path).exists():
            raise FileNotFoundError(
                f"--ckpt_path {ckpt_path} does not exist; pass an existing checkpoint file or"
                " directory, or --ckpt_path last for the newest in the run's checkpoint directory."
            )
        return ckpt_path
    directory = Path(checkpoint_dir) if checkpoint_dir else None
    if directory is not None and launching_rank():
        for line in recover_leftovers(directory):
            print(f"plugintrain: {line}")
    found = newest_complete(directory) if directory is not None else None
    if found is None:
        print(f"plugintrain: no checkpoint in {directory}: starting from scratch.")
        return None
    if launching_rank():
        print(f"plugintrain: resuming from {found} (the newest complete checkpoint).")
    return str(found)


def checkpoint_hparams(path: str) -> dict[str, Any]:
    """The module hyperparameters saved in the checkpoint at ``path`` (no code is run)."""
    file = Path(path)
    if "://" in path:
        return {}
    if file.is_dir() and (file / HPARAMS_FILENAME).is_file():
        return read_hparams(file)
    return dict(checkpoint_entry(path, "hyper_parameters") or {})


def checkpoint_entry(path: str, key: str) -> Any:
    """The top-level entry ``key`` of the checkpoint at ``path`` (a file, or a directory's
    metadata), or None; only tensors and plain data are unpickled."""
    file = Path(path)
    if "://" in path:
        return None
    if file.is_dir():
        return load_torch_file(file / LIGHTNING_METADATA).get(key)
    return load_torch_file(file, mmap=True, map_location="cpu").get(key)


def reconcile(
    ckpt_path: str,
    saved: dict[str, Any],
    given: dict[str, Any],
    model_class: type | None,
    overrides: list[str],
) -> dict[str, Any]:
    """The model options to resume with: ``given`` where it agrees with ``saved`` or is
    listed in ``overrides``, the checkpoint's where ``given`` is only the class default.

    Raises:
        ValueError: An option set (not defaulted) to a value other than the checkpoint's.
    """
    defaults = _defaults(model_class)
    merged = dict(given)
    for key, value in saved.items():
        if key in _CLI_KEYS or key not in given or _same(given[key], value):
            continue
        if key in overrides:
            continue
        if key in defaults and _same(given[key], defaults[key]):
            merged[key] = value  # left at its default: the checkpoint decides
            continue
        raise ValueError(
            f"{ckpt_path} was trained with model {key}={_show(value)}, but this run sets"
            f" {key}={_show(given[key])}: drop that option to resume the checkpoint's model,"
            f" or add --resume_overrides [{key}] to keep yours."
        )
    return merged


def _defaults(model_class: type | None) -> dict[str, Any]:
    if model_class is None:
        return {}
    return {
        name: p.default
        for name, p in inspect.signature(model_class).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def _plain(value: Any) -> Any:
    if hasattr(value, "as_dict"):  # a jsonargparse Namespace
        value = value.as_dict()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if k not in _CLI_KEYS}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _same(a: Any, b: Any) -> bool:
    return _plain(a) == _plain(b)


def _show(value: Any) -> str:
    text = repr(_plain(value))
    return text if len(text) <= 80 else text[:77] + "..."
