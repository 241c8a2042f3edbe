"""``plugintrain estimate``: per-rank memory of a model on a layout, and the layouts that fit.

For a preset (or a JSON/YAML file of ``TransformerConfig`` fields) and a layout (``--dp``,
``--tp``, ``--sp``, ``--pp``, ``--vpp``, ``--ep``, the strategy and ZeRO stage, precision,
micro-batch, sequence length, pipeline micro-batches, recomputation, LoRA) it prints the
bytes each rank holds: parameters, gradients, optimizer state, activations (with the
micro-batches a pipeline rank holds at once) and buffers of the reductions, with the
total; one column per pipeline stage. ``--json`` prints the same as one JSON object.
``--fit 80GiB --gpus 64`` lists the layouts of up to 64 devices whose largest rank fits,
fastest first by the scaling calculator's prediction. Nothing is allocated: the model is
only built on the meta device (:mod:`plugintrain.estimate`). ``--config RECIPE`` (or
``--recipe``) takes the model and layout from a ``plugintrain fit`` recipe instead; a
``--config`` file of estimate's own options (as ``--print_config`` writes it) works too.

``--time`` predicts the step time, tokens/s and MFU of the layout on ``--cluster`` (named
presets of devices and links, each value overridable; :mod:`plugintrain.estimate.timing`).

``--dry_run`` builds chosen ranks (``--ranks sample|all|R,R``) on the real code path, one
CPU process playing each rank through torch's fake process group, and prints what each
holds next to the estimate, then every problem found, one line each (exit 2): a rank over
``--memory``, an unbalanced pipeline, bytes that differ from the estimate, and with
``--ranks all`` a parameter not stepped exactly once per replica; ``--trace`` also runs
one training step on meta tensors (FLOPs, activation peak, collectives per mesh
dimension) and pairs the pipeline's sends and receives
(:mod:`plugintrain.estimate.dry_run`); with ``--time`` the traced step is priced too.

Exit status: 0 on success, 2 on bad input (a layout the model cannot train on).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

from plugintrain.estimate.names import CLUSTER_NAMES, ENGINE_STAGE, PRECISIONS, SINGLE, STRATEGIES
from plugintrain.tools._command import config_file, shared_help

# The choices, from the registries (plain data: `--help` imports no torch). The work is in
# plugintrain.tools.estimate_run, imported when the command runs: jsonargparse reads this
# module's imports (TYPE_CHECKING ones too) to resolve the signature.
StrategyName = Literal[STRATEGIES]  # type: ignore[valid-type]
PrecisionName = Literal[PRECISIONS]  # type: ignore[valid-type]
ClusterName = Literal[CLUSTER_NAMES]  # type: ignore[valid-type]


def _strategy_help() -> str:
    """``--strategy``'s help: the names of the estimate's strategies, from the registry."""
    data = ", ".join(ENGINE_STAGE)
    hybrid = " or ".join(n for n in STRATEGIES if n not in ENGINE_STAGE and n != SINGLE)
    return (
        f"{SINGLE} (one device), {data} (data parallel only) or {hybrid}; default: {SINGLE}"
        " on one device, else hybrid"
    )


def _link_help(what: str) -> dict[str, str]:
    return {
        "bw": f"bus bandwidth per GPU over {what} in GB/s, as nccl-tests reports it",
        "latency": f"microseconds per collective over {what}",
    }


# The help of each option (the command's Args, 40 of them): a table, so that the function
# stays its signature, readable as the list of the options.
OPTION_HELP = {
    "model": "a preset (plugintrain.model_zoo presets) or a .json/.yaml config file",
    "recipe": "a `plugintrain fit` recipe: its model and layout (devices x num_nodes, the"
    " strategy and its options, precision, seq_len, batch_size) instead of MODEL and the"
    " layout options; --config RECIPE says the same",
    "strategy": _strategy_help(),
    "dp": "data-parallel replicas",
    "tp": "tensor-parallel ranks",
    "sp": "sequence parallelism (needs --tp > 1)",
    "pp": "pipeline stages",
    "vpp": "model chunks per pipeline rank",
    "ep": "expert-parallel ranks (models with experts only)",
    "cp": "context-parallel ranks: each holds 1/cp of every sequence (hybrid)",
    "zero_stage": "hybrid: 0, 1, 2 or 3 (FSDP2); default 0",
    "precision": "the training precision",
    "micro_batch": "sequences per micro-batch and rank",
    "seq_len": "tokens per sequence (default 2048, or a shorter block_size)",
    "microbatches": "micro-batches per step (default pp; with --fit, of every pipeline)",
    "schedule": "pipeline schedule (default 1f1b, interleaved with --vpp > 1)",
    "layers_per_stage": "blocks of each virtual stage, N,N,..., e.g. 5,3 (default: equal)",
    "recompute": "activation recomputation of each block",
    "every_n_layers": "with --recompute full: every n-th block",
    "lora_r": "LoRA rank; 0 (default): full fine-tuning",
    "lora_targets": "LoRA's Linear layers (default *.attention.wq *.attention.wv)",
    "lora_quantize": "hold LoRA's frozen base quantized (QLoRA, the LoRA callback's quantize)",
    "bucket_size_mb": "gradient bucket size",
    "fit": "list the layouts whose largest rank fits this MEMORY (80GiB, 141GB, bytes)",
    "gpus": "with --fit: up to this many devices (default 8)",
    "top": "with --fit: print this many layouts",
    "json": "print one JSON object instead of a table",
    "dry_run": "build the ranks on the real code path (fake process group, meta tensors) and"
    " report what each holds next to the estimate, and every problem found",
    "ranks": "with --dry_run: sample (one rank of each kind), all (every rank; also checks"
    " that every parameter is stepped exactly once) or R,R,... (these global ranks)",
    "trace": "with --dry_run: also run one training step on meta tensors: FLOPs, activation"
    " peak, collectives per mesh dimension, pipeline sends paired",
    "memory": "with --dry_run: report each rank over this MEMORY (80GiB, 141GB)",
    "time": "scaling calculator: predict the step time, tokens/s and MFU on --cluster"
    " (plugintrain.estimate.timing); --fit ranks the layouts that fit by it, and with"
    " --dry_run --trace it prices the traced step",
    "cluster": "devices and links (h100-ib: H100 SXM, NVLink 4, 400 Gb/s a GPU)",
    "gpus_per_node": "GPUs joined by NVLink (default 8)",
    **{f"intra_{k}": text for k, text in _link_help("NVLink").items()},
    **{f"inter_{k}": text for k, text in _link_help("the network").items()},
    "matmul_efficiency": "fraction of the dense peak large matmuls reach (h100 0.75, a100 0.85)",
    "attention_efficiency": "fraction of the dense peak attention reaches (h100 0.35, a100 0.6)",
}


def _is_recipe(path: str) -> bool:
    """Whether ``--config PATH`` names a ``plugintrain fit`` recipe rather than a file of
    estimate's options: a ``trainer`` section, or a ``model`` with a class. A file that does
    not exist or does not parse is taken for a recipe, which then says what is wrong."""
    import yaml

    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return True
    return not isinstance(doc, dict) or "trainer" in doc or isinstance(doc.get("model"), dict)


def _recipe_or_options() -> type:
    """``--config``'s action: a fit recipe goes to ``recipe`` (what ``estimate --config``
    meant before every command took a file of its options); any other file is read as
    estimate's own options (what ``--print_config`` writes)."""
    from jsonargparse import ActionConfigFile

    class RecipeOrOptions(ActionConfigFile):
        def __call__(self, parser: Any, cfg: Any, values: Any, option_string: Any = None) -> None:
            if isinstance(values, str) and _is_recipe(values):
                cfg["recipe"] = values
            else:
                super().__call__(parser, cfg, values, option_string)

    return RecipeOrOptions


@config_file(
    _recipe_or_options,
    "a `plugintrain fit` recipe (as --recipe) or a YAML or JSON file of these options",
)
@shared_help(**OPTION_HELP)
def estimate(
    model: str | None = None,
    *,
    recipe: str | None = None,
    strategy: StrategyName | None = None,
    dp: int = 1,
    tp: int = 1,
    sp: bool = False,
    pp: int = 1,
    vpp: int = 1,
    ep: int = 1,
    cp: int = 1,
    zero_stage: int = 0,
    precision: PrecisionName = "bf16-mixed",
    micro_batch: int = 1,
    seq_len: int | None = None,
    microbatches: int | None = None,
    schedule: Literal["gpipe", "1f1b", "interleaved"] | None = None,
    layers_per_stage: str | None = None,
    recompute: Literal["none", "full", "selective"] = "none",
    every_n_layers: int = 1,
    lora_r: int = 0,
    lora_targets: list[str] | None = None,
    lora_quantize: Literal["nf4", "int8"] | None = None,
    bucket_size_mb: float = 25.0,
    fit: str | None = None,
    gpus: int | None = None,
    top: int = 20,
    json: bool = False,
    dry_run: bool = False,
    ranks: str = "sample",
    trace: bool = False,
    memory: str | None = None,
    time: bool = False,
    cluster: ClusterName = "h100-ib",
    gpus_per_node: int | None = None,
    intra_bw: float | None = None,
    intra_latency: float | None = None,
    inter_bw: float | None = None,
    inter_latency: float | None = None,
    matmul_efficiency: float | None = None,
    attention_efficiency: float | None = None,
) -> int:
    """Per-rank memory of a model on a parallel layout; --fit lists the layouts that fit a device.

    Exit status: 0 on success, 2 on bad input (a layout the model cannot train on), or with
    --dry_run, on a problem found.
    """
    from plugintrain.tools.estimate_run import run

    # The options as one value, as the steps read them (their help: OPTION_HELP).
    args = SimpleNamespace(**locals())
    return run(args, _recipe_clashes(args))


def _layout_options() -> list[str]:
    """The options a ``--config`` recipe gives instead: the signature's from ``--strategy``
    to ``--bucket_size_mb``."""
    names = list(inspect.signature(estimate).parameters)
    return names[names.index("strategy") : names.index("bucket_size_mb") + 1]


def _recipe_clashes(args: SimpleNamespace) -> list[str]:
    """The layout options given with a recipe (which gives the layout itself)."""
    defaults = inspect.signature(estimate).parameters
    return [f"--{k}" for k in _layout_options() if getattr(args, k) != defaults[k].default]
