"""The benchmark matrix: a YAML file of configurations, expanded and checked before any run.

A matrix file holds ``defaults`` (fields every configuration starts from), ``matrix``
blocks whose axes are crossed (model x layout x precision x ...), and explicit ``runs``::

    defaults: {recipe: recipes/gpt2_debug_shakespeare_cpu.yaml, steps: 6, warmup: 2}
    matrix:
      - layout:
          - {name: single, devices: 1}
          - {name: zero2 x2, strategy: zero2, devices: 2}
        precision: [32-true, bf16-mixed]
    runs:
      - {name: plain loop, runner: plain, baseline: true}

An axis value that is a mapping is merged into the configuration (its ``name`` names it
in the row); a scalar sets the field the axis is named after. Every configuration is a
:class:`BenchConfig`; its :meth:`~BenchConfig.command` is the exact command line that
runs it, ``plugintrain fit`` itself for the ``fit`` runner, so a benchmark measures what
users run.
"""

from __future__ import annotations

import itertools
import json
import shlex
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

RUNNERS = ("fit", "plain", "torch_pipelining")
"""``fit``: ``plugintrain fit`` (any strategy, Lightning's included); ``plain``: a
hand-written PyTorch loop over the same model, data and optimizer, one process;
``torch_pipelining``: torch.distributed.pipelining's schedules over the same stages."""


@dataclass
class BenchConfig:
    """One configuration of the matrix: what to run and how to time it."""

    name: str
    """Row label, unique in the matrix."""
    recipe: str
    """The recipe the run starts from (model, data, optimizer, trainer defaults)."""
    runner: str = "fit"
    """One of :data:`RUNNERS`."""
    model: str | None = None
    """A preset name that replaces the recipe's model config."""
    strategy: str | dict[str, Any] | None = None
    """``trainer.strategy``: a registered name or ``{class_path, init_args}``."""
    devices: int = 1
    """Processes on this machine (``trainer.devices``)."""
    precision: str | None = None
    """``trainer.precision``; None keeps the recipe's."""
    micro_batch: int | None = None
    """Sequences per data-parallel rank and step (``data.batch_size``)."""
    seq_len: int | None = None
    """Tokens per sequence (``data.seq_len``)."""
    steps: int = 6
    """Timed optimizer steps."""
    warmup: int = 2
    """Untimed first steps (allocator warm-up, first-call overheads, compilation)."""
    overrides: list[str] = field(default_factory=list)
    """Further ``plugintrain fit`` options, e.g. ``--trainer.gradient_clip_val=0.5``."""
    baseline: bool = False
    """The row the ratios divide by (one per matrix; the first row if none is marked)."""
    timeout: float = 900.0
    """Seconds before the run is stopped and recorded as failed."""

    def fit_args(self, out_dir: Path) -> list[str]:
        """``plugintrain fit`` arguments: the recipe, this configuration, a quiet trainer
        that runs ``warmup + steps`` timed steps plus one measured for memory."""
        args = ["--config", self.recipe]
        if self.model is not None:
            args.append(f"--model.init_args.config={self.model}")
        if self.strategy is not None:
            value = self.strategy if isinstance(self.strategy, str) else json.dumps(self.strategy)
            args.append(f"--trainer.strategy={value}")
        if self.precision is not None:
            args.append(f"--trainer.precision={self.precision}")
        if self.micro_batch is not None:
            args.append(f"--data.init_args.batch_size={self.micro_batch}")
        if self.seq_len is not None:
            args.append(f"--data.init_args.seq_len={self.seq_len}")
        recorder = {
            "class_path": "plugintrain.bench.BenchRecorder",
            "init_args": {"out_dir": str(out_dir), "warmup": self.warmup},
        }
        return [
            *args,
            f"--trainer.devices={self.devices}",
            f"--trainer.max_steps={self.warmup + self.steps + 1}",
            "--trainer.max_epochs=-1",  # max_steps alone ends the run
            "--trainer.limit_val_batches=0",
            "--trainer.num_sanity_val_steps=0",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            f"--trainer.logger.init_args.save_dir={out_dir / 'logs'}",
            "--checkpoint.save_top_k=0",
            "--checkpoint.save_last=false",
            f"--trainer.callbacks+={json.dumps(recorder)}",
            *self.overrides,
        ]

    def command(self, out_dir: Path) -> list[str]:
        """The exact command line that runs this configuration, writing to ``out_dir``:
        ``plugintrain fit`` (which launches its ranks), the plain loop, or torch's pipeline
        schedules under ``torchrun`` (one process per stage)."""
        args = self.fit_args(out_dir)
        if self.runner == "fit":
            return [sys.executable, "-m", "plugintrain", "fit", *args]
        baseline = ["-m", "plugintrain.bench.baselines", self.runner, *args]
        if self.runner == "plain":
            return [sys.executable, *baseline]
        launcher = ["-m", "torch.distributed.run", "--standalone"]
        return [sys.executable, *launcher, f"--nproc-per-node={self.devices}", *baseline]

    def shell(self, out_dir: Path) -> str:
        """:meth:`command` as one line to paste into a shell."""
        words = self.command(out_dir)[1:]
        short = {"plugintrain": "plugintrain", "torch.distributed.run": "torchrun"}
        if words[1] in short:
            return shlex.join([short[words[1]], *words[2:]])
        return shlex.join(["python", *words])


_FIELDS = {f.name for f in fields(BenchConfig)}


class MatrixError(ValueError):
    """A matrix file that cannot be run; the message is one line with the fix."""


def load_matrix(path: str | Path) -> list[BenchConfig]:
    """Read, expand and check a matrix file (every configuration, before any runs)."""
    path = Path(path)
    if not path.is_file():
        raise MatrixError(
            f"matrix file {str(path)!r} not found; pass one such as benchmarks/cpu.yaml"
        )
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict) or not set(raw) <= {"defaults", "matrix", "runs"}:
        keys = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise MatrixError(f"{path}: top-level keys {keys} are not 'defaults', 'matrix' and 'runs'")
    defaults = raw.get("defaults") or {}
    blocks, runs = raw.get("matrix") or [], raw.get("runs") or []
    _check_shape(defaults, blocks, runs, path)
    rows = [*_expand(blocks, path), *runs]
    configs = [_config({**defaults, **row}, path) for row in rows]
    _check(configs, path)
    return configs


def _check_shape(defaults: Any, blocks: Any, runs: Any, path: Path) -> None:
    example = "matrix: [{precision: [32-true, bf16-mixed]}]"
    if not isinstance(defaults, dict):
        raise MatrixError(f"{path}: defaults must be a mapping of fields, got {defaults!r}")
    if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
        raise MatrixError(f"{path}: runs must be a list of mappings, e.g. runs: [{{name: a}}]")
    if not isinstance(blocks, list) or not all(isinstance(b, dict) for b in blocks):
        raise MatrixError(f"{path}: matrix must be a list of mappings of axes, e.g. {example}")
    for block in blocks:
        for axis, values in block.items():
            if not isinstance(values, list) or not values:
                raise MatrixError(
                    f"{path}: matrix axis {axis}={values!r} must be a non-empty list, e.g."
                    f" {example}"
                )


def _expand(blocks: list[dict[str, list[Any]]], path: Path) -> list[dict[str, Any]]:
    """Every combination of each block's axes, as field mappings with a joined name."""
    rows = []
    for block in blocks:
        axes = list(block.items())
        for combo in itertools.product(*(values for _, values in axes)):
            row: dict[str, Any] = {}
            names = []
            for (axis, _), value in zip(axes, combo, strict=True):
                if isinstance(value, dict):
                    item = dict(value)
                    names.append(str(item.pop("name", axis)))
                    row.update(item)
                else:
                    names.append(str(value))
                    row[axis] = value
            row.setdefault("name", " · ".join(names))
            rows.append(row)
    return rows


def _config(row: dict[str, Any], path: Path) -> BenchConfig:
    unknown = sorted(set(row) - _FIELDS)
    if unknown:
        raise MatrixError(
            f"{path}: unknown field {unknown[0]!r} in {row.get('name', row)!r}; the fields"
            f" are {', '.join(sorted(_FIELDS))}"
        )
    if "recipe" not in row or "name" not in row:
        raise MatrixError(f"{path}: {row!r} needs a 'name' and a 'recipe'")
    for name, value in row.items():
        kinds = _TYPES[name]
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            wanted = " or ".join(_KIND_NAMES[k] for k in kinds)
            raise MatrixError(
                f"{path}: {name}={value!r} of {row['name']!r} is not {wanted}"
                f" (YAML: write {name}: {_EXAMPLES.get(name, 'a value of that type')})"
            )
    return BenchConfig(**row)


_TYPES: dict[str, tuple[type, ...]] = {
    "name": (str,), "recipe": (str,), "runner": (str,), "model": (str,),
    "strategy": (str, dict), "devices": (int,), "precision": (str,), "micro_batch": (int,),
    "seq_len": (int,), "steps": (int,), "warmup": (int,), "overrides": (list,),
    "baseline": (bool,), "timeout": (int, float),
}  # fmt: skip
_KIND_NAMES = {str: "a string", dict: "a mapping", int: "an integer", list: "a list",
               bool: "true or false", float: "a number"}  # fmt: skip
_EXAMPLES = {"devices": "2", "steps": "6", "warmup": "2", "overrides": "[--trainer.x=1]"}


def _check(configs: list[BenchConfig], path: Path) -> None:
    names = [c.name for c in configs]
    for config in configs:
        if names.count(config.name) > 1:
            raise MatrixError(f"{path}: two configurations are named {config.name!r}")
        if config.runner not in RUNNERS:
            raise MatrixError(
                f"{path}: runner={config.runner!r} of {config.name!r} is not one of {RUNNERS}"
            )
        if not Path(config.recipe).is_file():
            raise MatrixError(
                f"{path}: recipe {config.recipe!r} of {config.name!r} not found (paths are"
                " relative to the directory bench runs in, usually the repository root)"
            )
        if min(config.steps, config.warmup, config.devices) < 1 or config.timeout <= 0:
            raise MatrixError(
                f"{path}: {config.name!r} has steps={config.steps}, warmup={config.warmup},"
                f" devices={config.devices}, timeout={config.timeout}; all must be at least 1"
            )
        init_args = (
            config.strategy.get("init_args") or {} if isinstance(config.strategy, dict) else {}
        )
        if config.runner == "torch_pipelining" and init_args.get("layers_per_stage") == "auto":
            raise MatrixError(
                f"{path}: {config.name!r} runs torch_pipelining over layers_per_stage auto;"
                " give it block counts (e.g. [3, 1]: the split the auto row logs)"
            )
    if sum(c.baseline for c in configs) > 1:
        marked = [c.name for c in configs if c.baseline]
        raise MatrixError(f"{path}: baseline: true on {marked}; mark one configuration")
