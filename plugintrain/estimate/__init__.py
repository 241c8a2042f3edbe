"""Per-rank memory of a training layout, computed from the config: no weights are built.

:func:`estimate` answers "how many bytes does each rank hold?" for a
:class:`~plugintrain.model_zoo.TransformerConfig` and a :class:`Layout` (the strategies'
own option objects), rank by rank, in five parts: parameters, gradients and optimizer
state (:mod:`~plugintrain.estimate.state`, laid out by the gradient engine's own bucket
code on a meta-device model: :mod:`~plugintrain.estimate.parameters`), activations by
schedule (:mod:`~plugintrain.estimate.activations`) and communication buffers. The
biggest rank decides whether a layout fits (:meth:`Estimate.peak`);
:func:`fitting_layouts` enumerates layouts over up to N devices under a memory limit.
:mod:`~plugintrain.estimate.dry_run` checks a layout rank by rank on the real code path
(torch's fake process group, meta tensors); :mod:`~plugintrain.estimate.recipe` reads a
fit recipe's model and layout; :mod:`~plugintrain.estimate.timing` predicts a layout's step
time, tokens/s and MFU on a named cluster (the scaling calculator).
"""

import importlib
from typing import TYPE_CHECKING, Any

from plugintrain.estimate.names import PRECISIONS, STRATEGIES

if TYPE_CHECKING:
    from plugintrain.estimate.activations import activation_bytes, block_saved_bytes
    from plugintrain.estimate.layout import Layout
    from plugintrain.estimate.search import (
        Estimate,
        RankMemory,
        candidate_layouts,
        estimate,
        fitting_layouts,
        parse_bytes,
    )

_HOME = {
    "activation_bytes": "activations",
    "block_saved_bytes": "activations",
    "Layout": "layout",
    "Estimate": "search",
    "RankMemory": "search",
    "candidate_layouts": "search",
    "estimate": "search",
    "fitting_layouts": "search",
    "parse_bytes": "search",
}

__all__ = [
    "PRECISIONS",
    "STRATEGIES",
    "Estimate",
    "Layout",
    "RankMemory",
    "activation_bytes",
    "block_saved_bytes",
    "candidate_layouts",
    "estimate",
    "fitting_layouts",
    "parse_bytes",
]


def __getattr__(name: str) -> Any:
    """Each public name from its module, imported (with the strategies and the model zoo)
    when first asked for."""
    if name in _HOME:
        return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
