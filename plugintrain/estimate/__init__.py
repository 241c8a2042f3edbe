"""Per-rank memory of a training layout, computed from the config: no weights are built.

:func:`estimate` answers "how many bytes does each rank hold?" for a
:class:`~plugintrain.model_zoo.TransformerConfig` and a :class:`Layout` (the strategies'
own option objects), rank by rank, in five parts: parameters, gradients and optimizer
state (:mod:`~plugintrain.estimate.state`, laid out by the gradient engine's own bucket
code on a meta-device model: :mod:`~plugintrain.estimate.parameters`), activations by
schedule (:mod:`~plugintrain.estimate.activations`) and communication buffers. The
biggest rank decides whether a layout fits (:meth:`Estimate.peak`);
:func:`fitting_layouts` enumerates layouts over up to N devices under a memory limit (with
LoRA, proposing a quantized base, QLoRA, where only that fits). A QLoRA base is counted at
its packed bytes (block scales and padding included; FSDP2 shards them like any parameter).
:mod:`~plugintrain.estimate.dry_run` checks a layout rank by rank on the real code path
(torch's fake process group, meta tensors); :mod:`~plugintrain.estimate.recipe` reads a
fit recipe's model and layout; :mod:`~plugintrain.estimate.timing` predicts a layout's step
time, tokens/s and MFU on a named cluster (the scaling calculator).
"""

from plugintrain.core.lazy import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "activations": ("activation_bytes", "block_saved_bytes"),
        "layout": ("Layout",),
        "names": ("PRECISIONS", "STRATEGIES"),
        "search": (
            "Estimate",
            "RankMemory",
            "candidate_layouts",
            "estimate",
            "fitting_layouts",
            "parse_bytes",
        ),
    },
)
