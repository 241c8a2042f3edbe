"""``plugintrain fit|validate|test|predict``: :class:`PluginTrainCLI`, LightningCLI with
plugintrain's defaults, checks and one-line errors.

Imported by :func:`plugintrain.cli.main` only once a training command is certain (it
imports Lightning, plugintrain's strategies and callbacks).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from docstring_parser import DocstringStyle
from jsonargparse import set_parsing_settings
from jsonargparse.typing import import_object
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import (
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    ProgressBar,
)
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins.precision import Precision
from typing_extensions import override

import plugintrain.strategies
from plugintrain.callbacks import (
    CountedFlopsSummary,
    GracefulStop,
    PhaseProfiler,
    StepProgressBar,
    StepStatsMonitor,
    TokenThroughputMonitor,
)
from plugintrain.callbacks.lora import resume_base
from plugintrain.callbacks.run_record import RunRecord
from plugintrain.checkpoints.lightning_io import SafeCheckpointIO
from plugintrain.checkpoints.resume import (
    checkpoint_entry,
    checkpoint_hparams,
    reconcile,
    resolve_ckpt_path,
)
from plugintrain.cli_messages import (
    ConfigError,
    check_strategy_name,
    precision_help,
    strategy_class,
    strategy_help,
    user_message,
)
from plugintrain.core.elastic import launching_rank
from plugintrain.data import family_tokenizer
from plugintrain.model_zoo.lora import RECORD_KEY as LORA_RECORD
from plugintrain.precision_plugins import canonical_precision_name, precision_plugin_from_name
from plugintrain.tracking import check_loggers, logger_home

plugintrain.strategies.register()  # zero1, zero2, hybrid, ... by name

# Options whose output shows docstrings: help (also a class's, `--model.help Transformer`)
# and `--print_config=comments`.
_SHOWS_DOCS = re.compile(r"-h|--help|--print_config(=.*)?|--[\w.]+\.help(=.*)?")


def _parse_docstrings_for(args: list[str]) -> None:
    """Docstrings are Google-style here and in Lightning: parse only that style (the
    default tries every style on every docstring). Config dataclasses document their
    fields with attribute docstrings, which ``--help`` shows; reading them means parsing
    the classes' source, so it is done only when the command prints documentation
    (together about a second of every start-up otherwise)."""
    set_parsing_settings(
        docstring_parse_style=DocstringStyle.GOOGLE,
        docstring_parse_attribute_docstrings=any(_SHOWS_DOCS.fullmatch(a) for a in args),
    )


def _use_our_precision_plugin(trainer_config: dict[str, Any]) -> None:
    """Turn ``trainer.precision: <name>`` into plugintrain's precision plugin of that name.

    Our plugins agree found-inf and the global gradient norm across shards and keep
    ``16-mixed`` in fp16 on CPU, where Lightning's own would silently switch to bf16.
    Names we do not register (``64-true``, ``16-true``, ...) stay with Lightning.
    """
    name = canonical_precision_name(trainer_config.get("precision"))
    if name is None:
        return
    plugins = trainer_config.get("plugins") or []
    plugins = plugins if isinstance(plugins, list) else [plugins]
    if any(isinstance(plugin, Precision) for plugin in plugins):
        raise ValueError(
            f"trainer.precision={trainer_config['precision']!r} and a precision plugin in "
            "trainer.plugins both set the precision; keep only one of them."
        )
    trainer_config["precision"] = None
    trainer_config["plugins"] = [*plugins, precision_plugin_from_name(name)]


def _use_our_checkpoint_io(trainer_config: dict[str, Any]) -> None:
    """Single-file checkpoints through :class:`SafeCheckpointIO` (atomic saves, no code run
    on load, sharded directories readable in one process) unless one is configured."""
    plugins = trainer_config.get("plugins") or []
    plugins = plugins if isinstance(plugins, list) else [plugins]
    if not any(isinstance(plugin, CheckpointIO) for plugin in plugins):
        trainer_config["plugins"] = [*plugins, SafeCheckpointIO()]


def _shared_checkpoint_dir(logger: Any) -> str | None:
    """``<save_dir>/<name>/checkpoints`` of the configured logger (the first with a folder
    of its own, :func:`plugintrain.tracking.logger_home`), shared by its versions.

    Lightning's default puts checkpoints under the logger's new ``version_N``, where
    ``--ckpt_path last`` of a later run cannot find them. A directory per recipe keeps
    ``last`` working; ModelCheckpoint writes ``last-v1.ckpt`` rather than overwrite an
    earlier run's ``last.ckpt``, and ``last`` resolves to the newest.
    """
    home = logger_home(logger)
    return None if home is None else str(Path(home[0]) / home[1] / "checkpoints")


def _fill_checkpoint_dir(config: Any) -> str | None:
    """Set and return ModelCheckpoint's directory (the logger's shared one by default)."""
    if config.get("checkpoint") is None:
        return None
    if config.checkpoint.dirpath is None:
        config.checkpoint.dirpath = _shared_checkpoint_dir(config.trainer.logger)
    return config.checkpoint.dirpath


def _model_attribute(name: str) -> Callable[[Any], Any]:
    """Read ``name`` off the built model; None for models without it (e.g. MNIST)."""
    return lambda model: getattr(model, name, None)


def _model_tokenizer(model: Any) -> str | None:
    """The tokenizer whose ids the built model reads: its config's ``tokenizer`` (one that
    came with pretrained weights), else its family's; None if unknown."""
    config = getattr(model, "config", None)
    return getattr(config, "tokenizer", None) or family_tokenizer(getattr(config, "family", None))


def _document_names(parser: LightningArgumentParser) -> None:
    """Put plugintrain's strategy and precision names into ``--help``."""
    for option, names in (
        ("--trainer.strategy", strategy_help()),
        ("--trainer.precision", precision_help()),
    ):
        action = parser._option_string_actions[option]  # argparse's only index of options
        action.help = f"{names.replace('%', '%%')} {action.help or ''}"


def _display_callbacks(config: dict[str, Any], callbacks: list[Callback]) -> list[Callback]:
    """plugintrain's progress bar and model summary, where Lightning would add its own."""
    if config.get("barebones"):
        return []
    given = config.get("callbacks") or []
    present = [*(given if isinstance(given, list) else [given]), *callbacks]
    shown: list[Callback] = []
    if config.get("enable_progress_bar") is not False and not any(
        isinstance(c, ProgressBar) for c in present
    ):
        shown.append(StepProgressBar())
    if config.get("enable_model_summary") is not False and not any(
        isinstance(c, ModelSummary) for c in present
    ):
        shown.append(CountedFlopsSummary())
    return shown


MATMUL_PRECISION_HELP = (
    "torch.set_float32_matmul_precision for fp32 matmuls, in every process: 'high' lets"
    " them run on TF32 tensor cores (Ampere and newer NVIDIA GPUs: 10 mantissa bits,"
    " several times the fp32 rate), 'medium' also on bf16 ones, 'highest' keeps full fp32."
    " Unset: torch's default ('highest'), so '32-true' training never uses TF32. MFU's fp32"
    " peak follows it (the TF32 rate unless 'highest')."
)


def _set_matmul_precision(precision: str | None) -> None:
    """Apply ``--matmul_precision`` before the Trainer exists (its callbacks read it)."""
    if precision is not None:
        torch.set_float32_matmul_precision(precision)


def _graceful_stop(config: dict[str, Any], callbacks: list[Callback]) -> list[Callback]:
    """A :class:`GracefulStop` in every run (its signals and exit statuses), unless the
    configured callbacks hold one already."""
    given = config.get("callbacks") or []
    present = [*(given if isinstance(given, list) else [given]), *callbacks]
    return [] if any(isinstance(c, GracefulStop) for c in present) else [GracefulStop()]


def _phase_profiler(enabled: bool, config: dict[str, Any]) -> list[Callback]:
    """A :class:`PhaseProfiler` with its defaults for ``--profile_phases``, unless the
    configured callbacks already hold one."""
    given = config.get("callbacks") or []
    given = given if isinstance(given, list) else [given]
    if not enabled or any(isinstance(c, PhaseProfiler) for c in given):
        return []
    return [PhaseProfiler()]


class PluginTrainCLI(LightningCLI):
    """LightningCLI with plugintrain's defaults.

    Always present (configurable under their own keys): ``checkpoint`` (ModelCheckpoint,
    keeps ``last.ckpt``), ``lr_monitor``, ``throughput`` and ``step_stats`` (grad norm, loss
    scale, peak memory). The logger defaults to
    TensorBoard under ``runs/``; ``trainer.logger`` may name any of Lightning's loggers, or
    a list of them, checked before launch (:mod:`plugintrain.tracking`). The resolved
    ``config.yaml`` is saved beside the logs, and every logger and checkpoint is told what
    the run is (:class:`~plugintrain.callbacks.run_record.RunRecord`).
    Checkpoints go to ``<save_dir>/<name>/checkpoints`` (shared by the logger's versions,
    so ``--ckpt_path last`` resumes the newest run). The model's ``vocab_size`` and
    ``max_seq_len`` are linked into the datamodule so token files are checked against the
    model before training starts, and so is the tokenizer the token files were made with.
    ``--profile_phases true`` adds a :class:`~plugintrain.callbacks.PhaseProfiler` (a
    Chrome trace per rank and a per-phase table; ``--trainer.profiler`` selects Lightning's).
    ``--matmul_precision high`` lets fp32 matmuls use TF32 (``torch.set_float32_matmul_precision``).
    ``trainer.precision`` names (``32-true``, ``bf16-true``, ``bf16-mixed``, ``16-mixed``)
    select plugintrain's precision plugins, and importing this module registers
    plugintrain's strategy names; ``--help`` lists both.

    Options are never abbreviated. A mistake found before the run is launched (parsing,
    checks, building the classes) raises :class:`ConfigError`, whose message is one line
    naming the value and the fix; a bug keeps its exception and traceback.
    """

    def __init__(self, args: Any = None, run: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("save_config_callback", RunRecord)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("auto_configure_optimizers", False)
        self._launched = False
        argv = sys.argv[1:] if args is None else args
        # LightningCLI also takes a config (dict or Namespace) as args: it asks for no help.
        _parse_docstrings_for([str(a) for a in argv] if isinstance(argv, list | tuple) else [])
        try:
            super().__init__(args=args, run=run, **kwargs)
        except Exception as error:
            message = None if self._launched else user_message(error, self._option_names())
            if message is None:
                raise
            raise ConfigError(message) from error

    @override
    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        # Abbreviations let `--trainer.max_step 3` set max_steps (jsonargparse 5 drops them);
        # errors raise instead of printing the whole usage, for __init__ to make one line.
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("exit_on_error", False)
        return super().init_parser(**kwargs)

    def _option_names(self) -> list[str]:
        """Every ``--option`` of the parsers built so far (for "did you mean")."""
        parsers = [
            getattr(self, "parser", None),
            *getattr(self, "_subcommand_parsers", {}).values(),
        ]
        options = {o for p in parsers if p is not None for o in p._option_string_actions}
        return sorted(o for o in options if o.startswith("--"))

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.add_argument(
            "--resume_overrides",
            type=list[str],
            default=[],
            help="Model options to take from this run, not from --ckpt_path's checkpoint.",
        )
        parser.set_defaults({"checkpoint.save_last": True})
        parser.add_argument(
            "--profile_phases",
            type=bool,
            default=False,
            help="Profile forward, backward, optimizer and communication per rank"
            " (plugintrain.callbacks.PhaseProfiler with its defaults; configure it under"
            " trainer.callbacks for others): Chrome traces in the log directory and a"
            " per-phase table at the end.",
        )
        parser.add_argument(
            "--matmul_precision",
            type=Literal["highest", "high", "medium"] | None,
            default=None,
            help=MATMUL_PRECISION_HELP,
        )
        parser.add_lightning_class_args(LearningRateMonitor, "lr_monitor")
        parser.add_lightning_class_args(TokenThroughputMonitor, "throughput")
        parser.add_lightning_class_args(StepStatsMonitor, "step_stats")
        parser.set_defaults(
            {
                "trainer.logger": {
                    "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                    "init_args": {"save_dir": "runs", "name": "default"},
                }
            }
        )
        links = {name: _model_attribute(name) for name in ("vocab_size", "max_seq_len")}
        for name, value in {**links, "tokenizer": _model_tokenizer}.items():
            # Linked on instantiation: the value comes from the built model, so a preset
            # name and config overrides are already resolved. Datamodules without the
            # argument (MNIST) are left alone by the link.
            parser.link_arguments("model", f"data.init_args.{name}", value, apply_on="instantiate")
        _document_names(parser)

    @override
    def _parse_ckpt_path(self) -> None:
        # Replaces LightningCLI's, which unpickles the file, ignores `last` and silently
        # trains the checkpoint's model over the options given: see plugintrain.checkpoints.resume.
        subcommand = self.config.get("subcommand")
        config = self.config.get(str(subcommand)) if subcommand else None
        if config is None or "ckpt_path" not in config:
            return
        directory = _fill_checkpoint_dir(config)
        config.ckpt_path = resolve_ckpt_path(config.ckpt_path, directory)
        if config.ckpt_path is not None:
            self._resume_model_options(subcommand, config)

    def _resume_model_options(self, subcommand: str, config: Any) -> None:
        """Model options from the checkpoint where the run leaves them at their defaults;
        an error for options it sets otherwise (unless in ``--resume_overrides``)."""
        saved = checkpoint_hparams(config.ckpt_path)
        model = config.get("model")
        if not saved or model is None or model.get("init_args") is None:
            return
        given = model.init_args.as_dict()
        model_class = import_object(model.class_path)
        overrides = list(config.get("resume_overrides") or [])
        merged = reconcile(config.ckpt_path, saved, given, model_class, overrides)
        record = checkpoint_entry(config.ckpt_path, LORA_RECORD)
        if record is not None:  # LoRA: the base weights come from their file
            callbacks = config.trainer.get("callbacks")
            merged["weights"] = resume_base(
                config.ckpt_path, record, merged.get("weights"), callbacks, launching_rank()
            )
        elif merged.get("weights") is not None:  # the checkpoint's replace them: never read
            merged["weights"] = None
        taken = {k: v for k, v in merged.items() if v is not given.get(k)}
        if taken:
            update = {subcommand: {"model": {"class_path": model.class_path, "init_args": taken}}}
            self.config = self.parser.parse_object(update, self.config)

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config.get(str(self.subcommand), self.config)
        check_strategy_name(config.trainer.strategy)
        if strategy_class(config.trainer.strategy) is not None:  # a class path alone: its
            # defaults, as LightningCLI users write it
            update = {"trainer": {"strategy": {"class_path": config.trainer.strategy}}}
            if self.subcommand is not None:
                update = {str(self.subcommand): update}
            self.config = self.parser.parse_object(update, self.config)
            config = self.config.get(str(self.subcommand), self.config)
        check_loggers(config.trainer.logger)
        _fill_checkpoint_dir(config)

    @override
    def after_instantiate_classes(self) -> None:
        # Strategies that can check the model against their layout (hybrid: heads, vocab,
        # seq_len divisible by tp) and callbacks that can check it (LoRA) do it here,
        # before any process is launched.
        check_model = getattr(self.trainer.strategy, "check_model", None)
        if callable(check_model):
            check_model(self.model, self.datamodule)
        for callback in self.trainer.callbacks:  # LoRA: its globs against the model's modules
            check = getattr(callback, "check_model", None)
            if callable(check):
                check(self.model, self.trainer.strategy)
        check_launch = getattr(self.model, "check_launch", None)  # PreferenceLM: its data,
        if callable(check_launch):  # reference and pipeline micro-batches
            check_launch(self.trainer, self.datamodule)
        super().after_instantiate_classes()

    @override
    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        _use_our_precision_plugin(config)
        _use_our_checkpoint_io(config)
        _set_matmul_precision(self._get(self.config_init, "matmul_precision"))
        profiler = _phase_profiler(bool(self._get(self.config_init, "profile_phases")), config)
        stop = _graceful_stop(config, callbacks)
        return super()._instantiate_trainer(
            config, [*callbacks, *profiler, *stop, *_display_callbacks(config, callbacks)]
        )

    @override
    def _run_subcommand(self, subcommand: str) -> None:
        self._launched = True  # from here on, errors are the run's, with their tracebacks
        super()._run_subcommand(subcommand)
        stopped = [c.status for c in self.trainer.callbacks if isinstance(c, GracefulStop)]
        self.exit_status = next((s for s in stopped if s is not None), 0)


class _ParserBuilt(Exception):
    """Ends :class:`_ParserOnlyCLI` once its parser exists, carrying it."""


class _ParserOnlyCLI(PluginTrainCLI):
    """:class:`PluginTrainCLI` that stops as soon as its parser is built."""

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        raise _ParserBuilt(parser)


def training_parser(documented: bool = False) -> LightningArgumentParser:
    """The parser of ``plugintrain fit|validate|test|predict``, built exactly as a run
    builds it, with nothing parsed, instantiated or run.

    The documentation's CLI reference prints its help, and the documentation's command
    check parses every training command the docs show with it (``parser.parse_args(["fit",
    "--config", ...])``), a fraction of a second each instead of a whole start-up.

    Args:
        documented: Also read the config dataclasses' attribute docstrings, as ``--help``
            does (slower; only help text needs them).
    """
    try:
        _ParserOnlyCLI(args=["--help"] if documented else [], parser_kwargs={"prog": "plugintrain"})
    except _ParserBuilt as built:
        return built.args[0]
    raise AssertionError("_ParserOnlyCLI always stops at its parser")
