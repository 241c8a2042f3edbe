"""The ``plugintrain`` command line: LightningCLI for training, small tools beside it.

``plugintrain fit|validate|test|predict --config recipes/<recipe>.yaml`` runs through
:class:`PluginTrainCLI`; ``plugintrain prepare|generate`` are plain tools that need no
Trainer. Both halves share one entry point, :func:`main`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jsonargparse import set_parsing_settings
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins.precision import Precision
from typing_extensions import override

import plugintrain.strategies  # noqa: F401  (registers zero1/zero2/... with Lightning)
from plugintrain.callbacks import TokenThroughputMonitor
from plugintrain.precision_plugins import canonical_precision_name, precision_plugin_from_name

# Config dataclasses document their fields with attribute docstrings; show them in --help.
set_parsing_settings(docstring_parse_attribute_docstrings=True)


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


def _shared_checkpoint_dir(logger: Any) -> str | None:
    """``<save_dir>/<name>/checkpoints`` of a configured logger, shared by its versions.

    Lightning's default puts checkpoints under the logger's new ``version_N``, where
    ``--ckpt_path last`` of a later run cannot find them. A directory per recipe keeps
    ``last`` working; ModelCheckpoint writes ``last-v1.ckpt`` rather than overwrite an
    earlier run's ``last.ckpt``, and ``last`` resolves to the newest.
    """
    init_args = getattr(logger, "init_args", None)
    save_dir = getattr(init_args, "save_dir", None)
    if save_dir is None:
        return None
    return str(Path(save_dir) / (getattr(init_args, "name", None) or "") / "checkpoints")


def _model_attribute(name: str) -> Callable[[Any], Any]:
    """Read ``name`` off the built model; None for models without it (e.g. MNIST)."""
    return lambda model: getattr(model, name, None)


class PluginTrainCLI(LightningCLI):
    """LightningCLI with plugintrain's defaults.

    Always present (configurable under their own keys): ``checkpoint`` (ModelCheckpoint,
    keeps ``last.ckpt``), ``lr_monitor`` and ``throughput``. The logger defaults to
    TensorBoard under ``runs/``, and the resolved ``config.yaml`` is saved beside the logs.
    Checkpoints go to ``<save_dir>/<name>/checkpoints`` (shared by the logger's versions,
    so ``--ckpt_path last`` resumes the newest run). The model's ``vocab_size`` and
    ``max_seq_len`` are linked into the datamodule so token files are checked against the
    model before training starts. ``trainer.precision``
    names (``32-true``, ``bf16-true``, ``bf16-mixed``, ``16-mixed``) select plugintrain's
    precision plugins, and importing this module registers plugintrain's strategy names.
    """

    def __init__(self, args: Any = None, run: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("auto_configure_optimizers", False)
        super().__init__(args=args, run=run, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.save_last": True})
        parser.add_lightning_class_args(LearningRateMonitor, "lr_monitor")
        parser.add_lightning_class_args(TokenThroughputMonitor, "throughput")
        parser.set_defaults(
            {
                "trainer.logger": {
                    "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                    "init_args": {"save_dir": "runs", "name": "default"},
                }
            }
        )
        for name in ("vocab_size", "max_seq_len"):
            # Linked on instantiation: the value comes from the built model, so a preset
            # name and config overrides are already resolved. Datamodules without the
            # argument (MNIST) are left alone by the link.
            parser.link_arguments(
                "model", f"data.init_args.{name}", _model_attribute(name), apply_on="instantiate"
            )

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config.get(str(self.subcommand), self.config)
        if config.get("checkpoint") is not None and config.checkpoint.dirpath is None:
            config.checkpoint.dirpath = _shared_checkpoint_dir(config.trainer.logger)

    @override
    def after_instantiate_classes(self) -> None:
        # Strategies that can check the model against their layout (hybrid: heads, vocab,
        # seq_len divisible by tp) do it here, before any process is launched.
        check_model = getattr(self.trainer.strategy, "check_model", None)
        if callable(check_model):
            check_model(self.model, self.datamodule)
        super().after_instantiate_classes()

    @override
    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        _use_our_precision_plugin(config)
        return super()._instantiate_trainer(config, callbacks)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``plugintrain`` console script and ``python -m plugintrain``."""
    from plugintrain.tools import TOOLS, print_overview

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print_overview()
        return 0
    if args[0] in TOOLS:
        return TOOLS[args[0]](args[1:])
    # LightningCLI reads sys.argv itself; passing it again only earns a warning.
    PluginTrainCLI(args=None if argv is None else args)
    return 0
