"""plugintrain: Lightning plugins for training LLMs with hybrid parallelism.

The package root wires the one seam whose implementation sits above its users: models
open pretrained weights through :mod:`plugintrain.core.pretrained`, implemented by
:mod:`plugintrain.formats` (imported on first use, so ``import plugintrain`` stays cheap).
"""

from plugintrain.core import pretrained as _pretrained

__version__ = "0.1.0"


def _open_with_formats(source: str) -> _pretrained.PretrainedWeights:
    from plugintrain.formats import open_pretrained

    return open_pretrained(source)


_pretrained.install_opener(_open_with_formats)
