"""LoRA adapters as PEFT writes and reads them: a directory with ``adapter_config.json``
and ``adapter_model.safetensors``, tensors named after the Hugging Face model's modules
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``). This is what
``peft.PeftModel.from_pretrained``, ``transformers``' ``load_adapter`` and vLLM's
multi-LoRA serving load.

An adapter is ``scaling * B A`` added to a weight; a Hugging Face weight is built from
ours by the family's export plan (renamed, transposed for GPT-2's ``Conv1D``, or several
of ours fused, as GPT-2's ``c_attn`` holds q, k and v). Where that plan moves rows, the
adapters' ``B`` rows move with them, found by running the plan on tensors of row
numbers: a fused module's adapter is the adapters of its parts with their ``A``s stacked
and their ``B``s block-diagonal (rank = the sum of theirs, scaling unchanged), and a PEFT
adapter on a fused module becomes one per part, each with the whole ``A`` and its rows of
``B``. Every update ``scaling * B A`` is kept exactly.

Beside them, as peft's ``save_pretrained`` does, a model card (``README.md``, the run's:
:mod:`plugintrain.formats.model_card`); for a QLoRA run's adapters its "Training
procedure" section lists the ``bitsandbytes`` quantization config that holds the base as
the run held it, in peft's words, and reading an adapter takes the quantization back from
there (:func:`card_quantization`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from plugintrain.formats.base import WeightFormatError
from plugintrain.formats.model_card import CARD, CardFacts, checkpoint_facts, model_card
from plugintrain.formats.safetensors_io import write_safetensors
from plugintrain.model_zoo.config import TransformerConfig
from plugintrain.model_zoo.families import family_of
from plugintrain.model_zoo.lora import LoRASpec

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
QUANTIZATION_PREFIX = "The following `bitsandbytes` quantization config was used during training:"
"""The line of peft's model card (``PeftModel.create_or_update_model_card``) before the
``- name: value`` lines of a quantized base's ``BitsAndBytesConfig``."""
_PEFT_PREFIX = "base_model.model."
_PROBE_IN = 2  # input width of the row-number tensors the plans run on


def is_peft_dir(path: str | Path) -> bool:
    """Whether ``path`` is a PEFT adapter directory."""
    return Path(path).is_dir() and (Path(path) / CONFIG).is_file()


def _row_map(build: Callable[..., Tensor], outs: list[int], transposed_out: bool) -> Tensor:
    """Which input row each output row of ``build`` is: ``build`` run on tensors whose
    rows hold their (global, concatenated) row number.

    Raises:
        ValueError: If ``build`` mixes columns (not a row selection of its inputs).
    """
    offsets = [0, *itertools.accumulate(outs)]
    columns = torch.arange(_PROBE_IN, dtype=torch.float64)
    probes = [
        torch.arange(offsets[k], offsets[k] + n, dtype=torch.float64)[:, None] * _PROBE_IN + columns
        for k, n in enumerate(outs)
    ]
    built = build(*probes)
    built = built.t() if transposed_out else built
    if (
        built.ndim != 2
        or built.shape[1] != _PROBE_IN
        or not bool((built[:, 1] - built[:, 0] == 1).all())
    ):
        raise ValueError("not a row selection")
    return (built[:, 0] / _PROBE_IN).long()


def _module(weight_name: str) -> str:
    return weight_name.removesuffix(".weight")


def _conv1d_family(config: TransformerConfig) -> bool:
    """Whether the family's Hugging Face model keeps its projections as ``Conv1D``
    (``(in, out)`` weights, PEFT's ``fan_in_fan_out``)."""
    return bool(family_of(config).hf_conv1d)


def peft_tensors(
    config: TransformerConfig, spec: LoRASpec, adapters: dict[str, Tensor]
) -> tuple[dict[str, Tensor], dict[str, int]]:
    """PEFT's tensors (``base_model.model.<hf module>.lora_A.weight`` / ``lora_B``) and
    each Hugging Face module's rank, from our ``adapters`` (``layers.0.attention.wq.lora_A``
    -> tensor, every adapter of the model).

    Raises:
        ValueError: One line naming the module, if a Hugging Face module fuses layers of
            which only some are adapted, or its weight is not a row selection of ours.
    """
    plan = family_of(config).hf_export_plan(config)
    adapted = {name.removesuffix(".lora_A") for name in adapters if name.endswith(".lora_A")}
    conv1d = _conv1d_family(config)
    out: dict[str, Tensor] = {}
    ranks: dict[str, int] = {}
    for hf_name, rule in plan.items():
        parts = [_module(s) for s in rule.sources if s.endswith(".weight")]
        held = [p for p in parts if p in adapted]
        if not held or not hf_name.endswith(".weight"):
            continue
        if len(held) != len(parts):
            raise ValueError(
                f"{_module(hf_name)} fuses {parts} in the Hugging Face model, but only"
                f" {held} have adapters; adapt all of them or none to export PEFT adapters"
            )
        a = [adapters[f"{p}.lora_A"].float() for p in parts]
        b = [adapters[f"{p}.lora_B"].float() for p in parts]
        try:
            rows = _row_map(rule.build, [x.shape[0] for x in b], transposed_out=conv1d)
        except ValueError:
            raise ValueError(
                f"{_module(hf_name)}'s weight is not a row selection of {parts}; its adapters"
                " cannot be written as PEFT's (export --format hf --merge-lora instead)"
            ) from None
        module = f"{_PEFT_PREFIX}{_module(hf_name)}"
        out[f"{module}.lora_A.weight"] = torch.cat(a)
        out[f"{module}.lora_B.weight"] = torch.block_diag(*b)[rows]
        ranks[_module(hf_name)] = sum(x.shape[0] for x in a)
    missing = adapted - {p for name in plan for p in _parts_of(plan[name])}
    if missing:
        raise ValueError(f"{sorted(missing)[0]} has no Hugging Face module to carry its adapter")
    return out, ranks


def _parts_of(rule: Any) -> list[str]:
    return [_module(s) for s in rule.sources if s.endswith(".weight")]


def peft_config(
    spec: LoRASpec, ranks: dict[str, int], base: str | None, conv1d: bool
) -> dict[str, Any]:
    """``adapter_config.json``: rank and alpha (a fused module's in ``rank_pattern`` /
    ``alpha_pattern``, alpha scaled with its rank so ``alpha / r`` stays), the Hugging
    Face modules adapted, dropout."""
    scaling = spec.alpha / spec.r
    leaves: dict[str, set[str]] = {}
    for module in ranks:
        leaves.setdefault(module.rpartition(".")[2], set()).add(module)
    rank_pattern = {m: r for m, r in ranks.items() if r != spec.r}
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": spec.r,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted(ranks),
        "rank_pattern": dict(rank_pattern),
        "alpha_pattern": {m: scaling * r for m, r in rank_pattern.items()},
        "bias": "none",
        "fan_in_fan_out": conv1d,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "revision": None,
    }


def export_problem(spec: LoRASpec) -> str | None:
    """Why a LoRA run of ``spec`` cannot be written as PEFT adapters; None if it can."""
    if spec.trainable:
        return (
            f"the run also trained {list(spec.trainable)} whole, which PEFT adapters do not"
            " hold; export --format hf --merge-lora instead"
        )
    if spec.bias != "none":
        return (
            f"the run trained biases (bias: {spec.bias}); export --format hf --merge-lora instead"
        )
    return None


def write_peft(
    out: Path,
    config: TransformerConfig,
    spec: LoRASpec,
    adapters: dict[str, Tensor],
    base: str | None,
    card: CardFacts | None = None,
    record: dict[str, Any] | None = None,
) -> None:
    """Write our ``adapters`` (of a model of ``config`` with LoRA ``spec``) into the new
    directory ``out`` as a PEFT adapter, float32, with its model card (``README.md``) of
    the run's ``record`` and the export's facts ``card`` (default: the base and the spec).

    Raises:
        ValueError: Before ``out`` is made, one line (see :func:`peft_tensors`).
    """
    problem = export_problem(spec)
    if problem is not None:
        raise ValueError(problem)
    tensors, ranks = peft_tensors(config, spec, adapters)
    out.mkdir(parents=True)
    cfg = peft_config(spec, ranks, base, _conv1d_family(config))
    (out / CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
    dtype = next(iter(adapters.values())).dtype
    card = card or CardFacts("peft", name=out.name, base=base, adapter=_spec_facts(spec))
    card = dataclasses.replace(card, sections=card_sections(spec.quantize, dtype))
    (out / CARD).write_text(model_card(record, card))
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    with open(out / WEIGHTS, "wb") as stream:
        write_safetensors(stream, shapes.items(), torch.float32, tensors.__getitem__)


def _spec_facts(spec: LoRASpec) -> dict[str, Any]:
    return {"r": spec.r, "alpha": spec.alpha, "target_modules": list(spec.target_modules)}


def bnb_config(kind: str, compute_dtype: torch.dtype) -> dict[str, object]:
    """The ``bitsandbytes`` config (``transformers.BitsAndBytesConfig(...).to_dict()``) that
    holds a base as a QLoRA run of ``kind`` held it: ``nf4`` in 4 bits with the block
    scales double-quantized; ``int8`` per-row absmax without LLM.int8()'s outlier split
    (``llm_int8_threshold: 0.0``)."""
    four = kind == "nf4"
    return {
        "quant_method": "bitsandbytes",
        "_load_in_8bit": not four,
        "_load_in_4bit": four,
        "llm_int8_threshold": 6.0 if four else 0.0,
        "llm_int8_skip_modules": None,
        "llm_int8_enable_fp32_cpu_offload": False,
        "llm_int8_has_fp16_weight": False,
        "bnb_4bit_quant_type": "nf4" if four else "fp4",
        "bnb_4bit_use_double_quant": four,
        "bnb_4bit_compute_dtype": str(compute_dtype).removeprefix("torch."),
        "bnb_4bit_quant_storage": "uint8",
        "load_in_4bit": four,
        "load_in_8bit": not four,
    }


def card_sections(quantize: str | None, compute_dtype: torch.dtype) -> tuple[str, ...]:
    """What peft's model card adds for a QLoRA run (``quantize``): the ``bitsandbytes``
    config its base was held in, under "Training procedure" (read back by
    :func:`card_quantization`); nothing otherwise."""
    if quantize is None:
        return ()
    lines = ["## Training procedure", "", QUANTIZATION_PREFIX]
    lines += [f"- {k}: {v}" for k, v in bnb_config(quantize, compute_dtype).items()]
    return (*lines, "")


# -- in -----------------------------------------------------------------------------------


def card_quantization(path: str | Path) -> str | None:
    """The quantization (``nf4``, ``int8``) a PEFT adapter's base was held in while it
    trained, as its model card names it (peft's "Training procedure" section, see
    :data:`QUANTIZATION_PREFIX`); None without one. A base quantized in a way plugintrain
    does not hold (bitsandbytes' ``fp4``) is warned about, and read unquantized."""
    config = _card_bnb_config(Path(path) / CARD)
    if config.get("load_in_8bit") == "True":
        return "int8"
    if config.get("load_in_4bit") != "True":
        return None
    if config.get("bnb_4bit_quant_type") == "nf4":
        return "nf4"
    warnings.warn(
        f"{Path(path) / CARD}: the adapter was trained on a base held in bitsandbytes' 4-bit"
        f" {config.get('bnb_4bit_quant_type')}, which plugintrain does not hold (it holds nf4"
        " and int8); its base is read unquantized",
        stacklevel=2,
    )
    return None


def _card_bnb_config(card: Path) -> dict[str, str]:
    """The ``- name: value`` lines after :data:`QUANTIZATION_PREFIX` in the model card
    ``card`` (none if it has no such section, or no card)."""
    if not card.is_file():
        return {}
    lines = [line.strip() for line in card.read_text(errors="replace").splitlines()]
    if QUANTIZATION_PREFIX not in lines:
        return {}
    config = {}
    for line in lines[lines.index(QUANTIZATION_PREFIX) + 1 :]:
        match = re.fullmatch(r"- (\w+): (.*)", line)
        if match is None:
            break
        config[match[1]] = match[2]
    return config


def read_peft_config(path: str | Path) -> dict[str, Any]:
    """A PEFT directory's ``adapter_config.json``, checked for what plugintrain runs."""
    file = Path(path) / CONFIG
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise WeightFormatError(f"{file}: not readable JSON ({error}).") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise WeightFormatError(
            f"{file}: peft_type {config['peft_type']!r}; plugintrain reads LORA adapters."
        )
    if config.get("use_dora"):
        raise WeightFormatError(
            f"{file}: a DoRA adapter (use_dora: true); plugintrain reads plain LoRA."
        )
    if config.get("modules_to_save"):
        raise WeightFormatError(
            f"{file}: modules_to_save {config['modules_to_save']} are whole trained modules,"
            " which plugintrain's adapters do not hold; merge them into the base with peft first."
        )
    return config


def _scaling(config: dict[str, Any], module: str, rank: int) -> float:
    alpha = config.get("lora_alpha", 8)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.search(pattern, module) or module.endswith(pattern):
            alpha = value
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _read_pairs(path: Path) -> dict[str, dict[str, Tensor]]:
    """A PEFT directory's tensors: Hugging Face module -> ``{"A": ..., "B": ...}``."""
    weights = path / WEIGHTS
    if not weights.is_file():
        raise WeightFormatError(
            f"{path}: no {WEIGHTS} beside {CONFIG}; save the adapter with peft's save_pretrained."
        )
    pairs: dict[str, dict[str, Tensor]] = {}
    with safe_open(str(weights), framework="pt") as handle:
        for key in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
            match = re.fullmatch(
                r"(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key
            )
            if match is None:
                raise WeightFormatError(f"{weights}: tensor {key} is not a LoRA A or B weight.")
            pairs.setdefault(match[1], {})[match[2]] = handle.get_tensor(key).float()
    return pairs


def read_peft(path: str | Path, config: TransformerConfig) -> tuple[LoRASpec, dict[str, Tensor]]:
    """A PEFT adapter as our LoRA spec and adapter tensors (``layers.0.attention.wq.lora_A``
    -> tensor) for a model of ``config``. Modules of other ranks are zero-padded to the
    largest (the update ``scaling * B A`` is unchanged); every module must have the same
    scaling. The spec's ``quantize`` is the model card's (:func:`card_quantization`).

    Raises:
        WeightFormatError: One line, for a file plugintrain cannot run as it is.
    """
    # Real CPU tensors under any default device: a QLoRA run builds its model, and checks
    # the adapter it starts from, under torch.device("meta").
    with torch.device("cpu"):
        return _read_peft(Path(path), config)


def _read_peft(path: Path, config: TransformerConfig) -> tuple[LoRASpec, dict[str, Tensor]]:
    peft = read_peft_config(path)
    pairs = _read_pairs(path)
    import_plan = family_of(config).hf_import_plan(config)
    by_source: dict[str, list[str]] = {}
    for ours, rule in import_plan.items():
        if ours.endswith(".weight") and len(rule.sources) == 1:
            by_source.setdefault(_module(rule.sources[0]), []).append(ours)
    conv1d = bool(peft.get("fan_in_fan_out"))
    weights = path / WEIGHTS
    scalings, adapters = set(), {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"} or module not in by_source:
            raise WeightFormatError(
                f"{weights}: {module} is not a module of {config.name}'s Hugging Face model"
                " with both lora_A and lora_B; pass the adapter trained on this base."
            )
        a, b = ab["A"], ab["B"]
        scalings.add(round(_scaling(peft, module, a.shape[0]), 12))
        for ours in by_source[module]:
            rule = import_plan[ours]
            build = (lambda t, r=rule: r.build(t.t())) if conv1d else rule.build
            try:  # our weight from a Conv1D's (in, out) one, or a Linear's (out, in)
                rows = _row_map(build, [b.shape[0]], transposed_out=False)
            except ValueError:
                raise WeightFormatError(
                    f"{weights}: {module} feeds {ours} in a way plugintrain cannot split;"
                    " merge the adapter with peft first."
                ) from None
            adapters[_module(ours)] = (a, b[rows])
    if len(scalings) != 1:
        raise WeightFormatError(
            f"{weights}: its modules scale their updates differently ({sorted(scalings)});"
            " plugintrain's adapters share one alpha / r: merge the adapter with peft first."
        )
    rank = max(a.shape[0] for a, _ in adapters.values())
    tensors = {}
    for module, (a, b) in adapters.items():
        pad = rank - a.shape[0]
        tensors[f"{module}.lora_A"] = torch.cat([a, a.new_zeros(pad, a.shape[1])])
        tensors[f"{module}.lora_B"] = torch.cat([b, b.new_zeros(b.shape[0], pad)], dim=1)
    scaling = scalings.pop()
    targets = tuple(sorted(f"model.{m}" for m in adapters))
    spec = LoRASpec(
        r=rank,
        alpha=scaling * rank,
        dropout=float(peft.get("lora_dropout", 0.0)),
        target_modules=targets,
        quantize=card_quantization(path),
    )
    return spec, tensors


def export_peft(checkpoint: str | Path, out: Path, overwrite: bool = False) -> dict[str, Any]:
    """Write the adapters of a LoRA run's checkpoint (a ``.ckpt`` file or sharded
    directory) as the PEFT adapter directory ``out``, atomically (``out.partial``, then a
    rename); returns the ``adapter_config.json`` written.

    Raises:
        ValueError: One line, before anything is written: not a LoRA run's checkpoint,
            or adapters PEFT cannot hold.
    """
    from plugintrain.core.atomic_files import PARTIAL_SUFFIX, fsync_tree, publish, remove, sibling
    from plugintrain.formats.conversion import check_output
    from plugintrain.formats.lora_checkpoints import read_lora_run

    check_output(out, overwrite)
    reader, spec = read_lora_run(
        checkpoint, "export it with --format hf, or pass a LoRA run's checkpoint"
    )
    names = [n for n in reader.names() if n.endswith((".lora_A", ".lora_B"))]
    adapters = {name: reader.read(name) for name in names}
    problem = export_problem(spec)
    if problem is None:
        peft_tensors(reader.config, spec, adapters)  # refuses before anything is written
    else:
        raise ValueError(problem)
    partial = sibling(out, PARTIAL_SUFFIX)
    remove(partial)
    facts = checkpoint_facts(reader.hparams, reader.lora, "peft", name=out.resolve().name)
    base = reader.lora.get("base")
    try:
        write_peft(partial, reader.config, spec, adapters, base, facts, reader.run)
    except BaseException:
        remove(partial)
        raise
    fsync_tree(partial)
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    publish(partial, out)
    return json.loads((out / CONFIG).read_text())
