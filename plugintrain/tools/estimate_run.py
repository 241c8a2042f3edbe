"""What ``plugintrain estimate`` does with its options (:mod:`plugintrain.tools.estimate`):
the model and layout, the estimate or the layouts that fit, the dry run, the scaling
calculator's prediction, and their tables and JSON."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from plugintrain.cli_messages import ConfigError
from plugintrain.estimate.names import SINGLE

if TYPE_CHECKING:
    from plugintrain.estimate import Estimate, Layout
    from plugintrain.estimate.timing import Cluster, Prediction
    from plugintrain.model_zoo import TransformerConfig

_ROWS = (
    ("parameters", "parameters"),
    ("gradients", "gradients"),
    ("optimizer", "optimizer state (AdamW)"),
    ("activations", "activations (peak)"),
    ("communication", "reduction buffers"),
)


def _counts(text: str) -> tuple[int, ...]:
    """``5,3`` -> (5, 3)."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(
            f"--layers_per_stage: not comma-separated block counts: {text!r}"
        ) from None


def load_config(model: str) -> TransformerConfig:
    """A preset by name, or the ``TransformerConfig`` fields in a JSON or YAML file."""
    from plugintrain.model_zoo import TransformerConfig

    path = Path(model)
    if path.suffix not in (".json", ".yaml", ".yml"):
        return TransformerConfig.from_name(model)
    if not path.is_file():
        raise ValueError(f"config file {model!r} does not exist; give a preset or a file")
    import yaml

    text = path.read_text()
    # YAML 1.1 reads JSON's `1e-05` as a string: JSON files go through json.
    fields = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if not isinstance(fields, dict):
        raise ValueError(f"{model} holds no mapping of TransformerConfig fields")
    try:
        return TransformerConfig.from_dict(fields)
    except TypeError as error:
        raise ValueError(f"{model}: {error}; use TransformerConfig's field names") from None


def _model_and_layout(
    args: SimpleNamespace, recipe_clashes: list[str]
) -> tuple[TransformerConfig, Layout]:
    """From ``--config RECIPE``, or from MODEL and the layout options."""
    if (args.recipe is None) == (args.model is None):
        raise ValueError("give MODEL (a preset or config file) or --config RECIPE, one of them")
    if args.recipe is not None:
        from plugintrain.estimate.recipe import recipe_layout

        if recipe_clashes:
            raise ValueError(
                f"--config takes the layout from the recipe; leave out {', '.join(recipe_clashes)}"
                " (or edit the recipe)"
            )
        return recipe_layout(args.recipe)
    config = load_config(args.model)
    return config, _layout(args, config)


def _layout(args: SimpleNamespace, config: TransformerConfig) -> Layout:
    from plugintrain.estimate import Layout
    from plugintrain.strategies import ParallelDims

    cp = getattr(args, "cp", 1)  # --cp: see plugintrain.tools.estimate
    world = args.dp * cp * args.tp * args.pp
    strategy = args.strategy or (SINGLE if world == 1 and args.fit is None else "hybrid")
    if args.dp % args.ep:  # a model without experts is told so, not that dp is too small
        ParallelDims(expert_parallel=args.ep).validate_experts(config)
    counts = None if args.layers_per_stage is None else _counts(args.layers_per_stage)
    return Layout.of(
        strategy,
        dp=args.dp,
        tp=args.tp,
        sp=args.sp,
        pp=args.pp,
        vpp=args.vpp,
        ep=args.ep,
        cp=cp,
        zero_stage=args.zero_stage,
        precision=args.precision,
        micro_batch=args.micro_batch,
        seq_len=args.seq_len or min(2048, config.block_size),
        microbatches=args.microbatches,
        layers_per_stage=counts,
        schedule=args.schedule,
        recompute=args.recompute,
        every_n_layers=args.every_n_layers,
        lora_r=args.lora_r,
        lora_targets=args.lora_targets,
        lora_quantize=args.lora_quantize,
        bucket_size_mb=args.bucket_size_mb,
    )


def size(n: float) -> str:
    """Bytes as ``12.3 GiB`` (binary units, three significant digits)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"


def describe(layout: Layout) -> str:
    """The layout on one line: ``hybrid dp=8 x tp=2 (sp) x pp=1, zero_stage=1, ...``
    (``x cp=N`` after dp with context parallelism)."""
    named = layout.as_json()
    sp = " (sp)" if named["sp"] else ""
    cp = f" x cp={named['cp']}" if named["cp"] > 1 else ""
    vpp = f" x vpp={named['vpp']}" if named["vpp"] > 1 else ""
    zero = f", zero_stage={layout.stage}" if layout.stage is not None else ""
    pipe = f", {named['microbatches']} micro-batches" if named["pp"] > 1 else ""
    if named["layers_per_stage"] is not None:
        pipe += f", layers_per_stage={named['layers_per_stage']}"
    lora = f", LoRA r={named['lora_r']}" if named["lora_r"] else ""
    lora += f" on a {named['lora_quantize']} base" if named["lora_quantize"] else ""
    every = f" every {named['every_n_layers']}" if named["every_n_layers"] > 1 else ""
    return (
        f"{layout.strategy} dp={named['dp']}{cp} x tp={named['tp']}{sp} x pp={named['pp']}{vpp}"
        f"{zero}, {layout.precision}, micro_batch={layout.micro_batch} x seq_len="
        f"{layout.seq_len}{pipe}, recompute={named['recompute']}{every}{lora}"
    )


def table(result: Estimate) -> str:
    """The per-rank table: one row per part, one column per pipeline stage."""
    stages = result.stage_peaks()
    heads = ["per rank"] if len(stages) == 1 else [f"stage {r.pp_rank}" for r in stages]
    rows = [(label, [size(getattr(r, key)) for r in stages]) for key, label in _ROWS]
    rows.append(("total", [size(r.total) for r in stages]))
    width = max(len(label) for label, _ in rows)
    cols = [max(len(h), *(len(v[i]) for _, v in rows)) for i, h in enumerate(heads)]
    lines = [
        f"{result.config.name}: {describe(result.layout)}",
        "",
        f"{'':<{width}}  " + "  ".join(f"{h:>{c}}" for h, c in zip(heads, cols, strict=True)),
    ]
    for label, values in rows:
        cells = "  ".join(f"{v:>{c}}" for v, c in zip(values, cols, strict=True))
        lines.append(f"{label:<{width}}  {cells}")
    return "\n".join(lines)


def to_json(result: Estimate) -> dict[str, Any]:
    """The estimate as plain JSON types: the layout, each stage's largest rank, the peak."""
    stages = [{**dataclasses.asdict(r), "total": r.total} for r in result.stage_peaks()]
    peak = result.peak
    return {
        "model": result.config.name,
        "layout": result.layout.as_json(),
        "stages": stages,
        "peak": {**dataclasses.asdict(peak), "total": peak.total},
    }


def fit_table(
    results: list[Estimate],
    memory: int,
    gpus: int,
    top: int,
    predictions: list[Prediction] | None = None,
    cluster: str = "",
) -> str:
    """The layouts that fit, one per line, in the given order (with ``predictions``: the
    predicted tokens/s and MFU on ``cluster`` too). With LoRA, a ``base`` column says how
    each layout holds the frozen base (``-``: as the precision says; ``nf4``/``int8``:
    quantized: :func:`~plugintrain.estimate.fitting_layouts` proposes that where the base
    does not fit as it is), and a last line says what to set in the recipe."""
    if not results:
        return f"No layout of up to {gpus} devices fits in {size(memory)} per device."
    lora = results[0].layout.lora is not None
    heads = ("gpus", "dp", "tp", "sp", "pp", "zero", *(("base",) if lora else ()))
    columns = (*(k for k, _ in _ROWS), "total")
    speed = ("tokens/s", "/gpu", "mfu") if predictions else ()
    order = f", fastest first on {cluster}" if predictions else ""
    lines = [
        f"{len(results)} layouts of up to {gpus} devices fit in {size(memory)} per device"
        f" (largest rank{order}; showing {min(top, len(results))}):",
        "  ".join(
            [
                *(f"{h:>4}" for h in heads),
                *(f"{h:>11}" for h in columns),
                *(f"{h:>9}" for h in speed),
            ]
        ),
    ]
    for i, result in enumerate(results[:top]):
        layout, peak = result.layout, result.peak
        dims = layout.dims
        cells = [
            layout.world_size,
            dims.dp,
            dims.tp,
            "y" if dims.sequence_parallel else "n",
            dims.pp,
        ]
        cells.append("fsdp" if layout.stage == 3 else str(layout.stage or 0))
        cells += [layout.quantize or "-"] if lora else []
        parts = [size(getattr(peak, key)) for key, _ in _ROWS] + [size(peak.total)]
        row = [*(f"{c!s:>4}" for c in cells), *(f"{p:>11}" for p in parts)]
        if predictions:
            p = predictions[i]
            speeds = (p.tokens_per_second, p.tokens_per_second_per_gpu)
            row += [*(f"{_count(v):>9}" for v in speeds), f"{p.mfu:>9.1%}"]
        lines.append("  ".join(row))
    return "\n".join(lines + _quantize_note(results[:top]))


def _quantize_note(results: list[Estimate]) -> list[str]:
    """For each quantization in the layouts shown, what to set in the recipe."""
    kinds = sorted({r.layout.quantize for r in results if r.layout.quantize is not None})
    return [
        f"base {kind}: LoRA's frozen base held as {kind} (QLoRA); set quantize: {kind} in the"
        f" LoRA callback's init_args (estimate: --lora_quantize {kind}); tokens/s leave out"
        " the dequantization's time"
        for kind in kinds
    ]


def _count(n: float) -> str:
    """``1.46M``, ``178``, ``12.1k``."""
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def _fit_json(
    results: list[Estimate], memory: int, gpus: int, predictions: list[Prediction]
) -> dict[str, Any]:
    layouts = [
        {**to_json(r), "prediction": dataclasses.asdict(p)}
        for r, p in zip(results, predictions, strict=True)
    ]
    return {"memory": memory, "gpus": gpus, "layouts": layouts}


def cluster_of(args: SimpleNamespace) -> Cluster:
    """The named ``--cluster`` with the options that override it.

    Raises:
        ValueError: On a value out of range, naming it.
    """
    from plugintrain.estimate.timing import CLUSTERS, Link

    cluster = CLUSTERS[args.cluster]
    ranges = {  # option: (lowest, highest, whether the lowest is allowed)
        "gpus_per_node": (1, None, True),
        "intra_bw": (0, None, False),
        "inter_bw": (0, None, False),
        "intra_latency": (0, None, True),
        "inter_latency": (0, None, True),
        "matmul_efficiency": (0, 1, False),
        "attention_efficiency": (0, 1, False),
    }
    for name, (low, high, closed) in ranges.items():
        value = getattr(args, name)
        if value is None:
            continue
        if value < low or (value == low and not closed) or (high is not None and value > high):
            bound = f"in (0, {high}]" if high else f">= {low}" if closed else f"> {low}"
            raise ValueError(f"--{name}={value} must be {bound}")
    links = {}
    for name in ("intra", "inter"):
        link = getattr(cluster, name)
        bw, latency = getattr(args, f"{name}_bw"), getattr(args, f"{name}_latency")
        links[name] = Link(
            link.bandwidth if bw is None else bw * 1e9,
            link.latency if latency is None else latency * 1e-6,
        )
    changes = {
        k: getattr(args, k)
        for k in ("gpus_per_node", "matmul_efficiency", "attention_efficiency")
        if getattr(args, k) is not None
    }
    return dataclasses.replace(cluster, **links, **changes)


def prediction_text(prediction: Prediction, cluster: Cluster, name: str, source: str) -> str:
    """The prediction in a few lines: the cluster, the step, and where its time goes."""
    from plugintrain.estimate.timing import MODELLED

    p, c = prediction, cluster
    parts = "  ".join(f"{k} {v:.3g} s" for k, v in p.breakdown.items())
    return "\n".join(
        [
            f"predicted on {name} ({source}): {c.chip}, matmuls at {c.matmul_efficiency:.0%} and"
            f" attention at {c.attention_efficiency:.0%} of the dense peak; {c.gpus_per_node} GPUs"
            f" per node, NVLink {c.intra.bandwidth / 1e9:.4g} GB/s, network"
            f" {c.inter.bandwidth / 1e9:.4g} GB/s per GPU",
            f"  step {p.step_time:.4g} s for {_count(p.tokens_per_step)} tokens:"
            f" {_count(p.tokens_per_second)} tokens/s, {_count(p.tokens_per_second_per_gpu)} per"
            f" GPU, {p.tflops_per_gpu:.4g} TFLOP/s per GPU, MFU {p.mfu:.1%}",
            f"  {parts}",
            f"  {MODELLED}",
        ]
    )


def run(args: SimpleNamespace, recipe_clashes: list[str]) -> int:
    """``plugintrain estimate``'s work on its parsed options (``recipe_clashes``: the layout
    options given beside ``--config RECIPE``); 0, or 2 after the dry run's problems.

    Raises:
        ConfigError: On bad input, one line naming the value and the fix.
    """
    from plugintrain.estimate import estimate, fitting_layouts, parse_bytes
    from plugintrain.estimate.timing import formula_costs, predict

    try:
        cluster = cluster_of(args)
        config, layout = _model_and_layout(args, recipe_clashes)
        if args.dry_run:
            return _dry_run(args, config, layout, cluster)
        if args.trace or args.memory or args.ranks != "sample":
            raise ValueError("--trace, --memory and --ranks go with --dry_run; add it")
        if args.fit is None:
            result = estimate(config, layout)
            if args.time:
                prediction = predict(formula_costs(config, layout, result), config, layout, cluster)
        else:
            memory, gpus = parse_bytes(args.fit), args.gpus or 8
            if gpus < 1 or args.top < 1:
                raise ValueError(f"--gpus={gpus} and --top={args.top} must be >= 1")
            layout.check(config)  # the options that stay fixed, checked once
            fits = fitting_layouts(config, gpus, memory, layout, args.microbatches)
            fits, predictions = _ranked(fits, cluster)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if args.fit is None:
        if args.json:
            out = to_json(result)
            if args.time:
                out["prediction"] = dataclasses.asdict(prediction)
            print(json.dumps(out))
        else:
            print(table(result))
            if args.time:
                print()
                print(prediction_text(prediction, cluster, args.cluster, "from the shapes"))
    elif args.json:
        print(json.dumps(_fit_json(fits, memory, gpus, predictions)))
    else:
        print(fit_table(fits, memory, gpus, args.top, predictions, args.cluster))
    return 0


def _ranked(fits: list[Estimate], cluster: Cluster) -> tuple[list[Estimate], list[Prediction]]:
    """The layouts that fit, fastest (predicted tokens/s) first; ties: fewer devices."""
    from plugintrain.estimate.timing import formula_costs, predict

    predicted = [
        (predict(formula_costs(e.config, e.layout, e), e.config, e.layout, cluster), e)
        for e in fits
    ]
    predicted.sort(key=lambda pe: (-pe[0].tokens_per_second, pe[1].layout.world_size))
    return [e for _, e in predicted], [p for p, _ in predicted]


MIXED_TRACE = (
    "the traced step runs on meta tensors, where autocast does not run: its collectives"
    " and activations are fp32's (an upper bound under mixed precision); the figures from"
    " the shapes use autocast's dtypes"
)


def _dry_run(
    args: SimpleNamespace, config: TransformerConfig, layout: Layout, cluster: Cluster
) -> int:
    """``--dry_run``: the chosen ranks built (see :mod:`plugintrain.estimate.dry_run`), their
    bytes next to the estimate's, then every problem found, one line each (exit 2); with
    ``--time`` the traced step priced on the cluster, next to the formula's price."""
    from plugintrain.estimate import parse_bytes
    from plugintrain.estimate.dry_run import dry_run, parse_ranks
    from plugintrain.estimate.timing import formula_costs, predict, traced_costs

    if args.fit is not None:
        raise ValueError("--dry_run checks one layout; leave out --fit (or run --fit alone)")
    if args.trace and layout.strategy == "single":
        raise ValueError("--trace runs a distributed step; give a layout over several ranks")
    if args.time and not args.trace:
        raise ValueError("--time with --dry_run prices the traced step; add --trace")
    memory = None if args.memory is None else parse_bytes(args.memory)
    ranks = parse_ranks(args.ranks, layout)
    if layout.seq_len > config.block_size:
        layout.check(config)  # the one check no rank makes
    report = dry_run(config, layout, ranks, memory, args.trace)
    predictions = {}
    if args.time:
        predictions = {
            "from the traced step": predict(
                traced_costs(report, config, layout), config, layout, cluster
            ),
            "from the shapes": predict(formula_costs(config, layout), config, layout, cluster),
        }
    if args.json:
        out = report.as_json()
        if args.trace and layout.precision.endswith("-mixed"):
            out["note"] = MIXED_TRACE
        if predictions:
            out["prediction"] = {k: dataclasses.asdict(v) for k, v in predictions.items()}
        print(json.dumps(out))
    else:
        print(f"{config.name}: {describe(layout)}")
        print(report.table(size))
        if args.trace and layout.precision.endswith("-mixed"):
            print(f"\nnote: {MIXED_TRACE}")
        for source, prediction in predictions.items():
            print()
            print(prediction_text(prediction, cluster, args.cluster, source))
    for line in report.problems:
        print(f"plugintrain estimate: {line}", file=sys.stderr)
    return 2 if report.problems else 0
