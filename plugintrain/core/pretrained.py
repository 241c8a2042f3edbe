"""The seam between models and weight files: a model starts from pretrained weights named
by a path or a pretrained name, without importing any file format.

:class:`~plugintrain.model_zoo.CausalLM` takes ``weights="smollm2-135m"`` and asks
:func:`open_pretrained` for them. :mod:`plugintrain.formats` (which reads the model zoo's
weight plans, so it sits above the zoo) implements the opener, and the package root
(``plugintrain/__init__.py``) installs it: the arrow from models to formats is this
protocol, not an import.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import nn


class PretrainedWeights(Protocol):
    """Weights a model starts from (:class:`plugintrain.formats.Weights`)."""

    path: Path
    """The file or directory read."""
    config: Any
    """The architecture the weights hold (a ``TransformerConfig``), naming the tokenizer
    that came with them."""

    def check_architecture(self, config: Any) -> None:
        """Raise a one-line error naming each field in which ``config`` differs from
        :attr:`config` (what a run may choose apart from the weights aside)."""
        ...

    def load_into(self, model: nn.Module, config: Any) -> None:
        """Copy the weights into the parts of ``model`` (of ``config``: whole, a pipeline
        stage, DTensor shards) this rank holds, one tensor at a time."""
        ...


Opener = Callable[[str], PretrainedWeights]
_opener: Opener | None = None


def install_opener(opener: Opener) -> None:
    """Make ``opener`` what :func:`open_pretrained` calls."""
    global _opener
    _opener = opener


def open_pretrained(source: str) -> PretrainedWeights:
    """The weights ``source`` (a path or a pretrained name) names, through the installed
    opener."""
    if _opener is None:
        raise RuntimeError("no weight opener installed: import plugintrain (the package root)")
    return _opener(source)
