"""The model card (``README.md``) that ``plugintrain export`` writes beside what it exports.

:func:`model_card` is a pure function of two things: the run's record (what the
``RunRecord`` callback of ``plugintrain fit`` keeps in every checkpoint under
:data:`RUN_RECORD_KEY`: the resolved recipe, the data and its ``meta.json``, steps,
hardware, the last metrics and the evaluation) and :class:`CardFacts` (what the export
itself knows: the kind written, the base weights, the dtype). The record may be missing
(a checkpoint of an older plugintrain, or not written by ``fit``) or partial: every field
is read where it is and left out where it is not.

The YAML front matter is the Hugging Face Hub's model card metadata: ``base_model`` and
``license`` only where the base is a known Hub repository (:func:`hub_model`: a pretrained
name of :data:`~plugintrain.data.assets.PRETRAINED_ORIGINS`, or a directory of the Hub's
download cache), ``library_name`` (``transformers``, ``peft``; none for GGUF, which the
Hub lists as a file format, not a library, and tags ``gguf``), ``tags``, ``datasets``,
``pipeline_tag`` and, when the run was evaluated, ``model-index`` results, in the layout
``huggingface_hub``'s ``ModelCardData`` reads into ``EvalResult`` objects.

A GGUF export is one file, often in a folder that holds other things: its card is the
folder's ``README.md`` (what the Hub shows for a repository of GGUF files) unless a
``README.md`` that plugintrain did not write for this same file is there; then it is
``<stem>.README.md`` beside the file (:func:`gguf_card_path`). A card plugintrain wrote
ends with :func:`export_marker`, which is how it is told from a user's.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import yaml

from plugintrain.data.assets import PRETRAINED_ORIGINS, HubModel
from plugintrain.formats.registry import CardSpec, format_spec

CARD = "README.md"
"""The card's file name in a directory export (what the Hub shows for a repository)."""
RUN_RECORD_KEY = "plugintrain_run"
"""The checkpoint's top-level entry holding the run's record."""
# The evaluation's measures: key of `plugintrain evaluate --json` -> (metric type, name).
_EVALUATION_METRICS = {
    "loss": ("loss", "loss (nats per token)"),
    "perplexity": ("perplexity", "perplexity"),
    "bits_per_byte": ("bits_per_byte", "bits per byte"),
    "exact_match": ("exact_match", "exact match"),
    "contains": ("contains", "answer contains the reference"),
    "preference_accuracy": ("preference_accuracy", "preference accuracy"),
    "reward_margin": ("reward_margin", "reward margin"),
    "reference_accuracy": ("reference_accuracy", "reference's preference accuracy"),
}
_TASK = {"type": "text-generation", "name": "Text Generation"}


class _Dumper(yaml.SafeDumper):
    """Plain YAML: a value used twice is written twice, not as an anchor and an alias."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


@dataclass(frozen=True)
class CardFacts:
    """What an export knows without the run's record."""

    kind: str
    """The format written: one whose :class:`~plugintrain.formats.registry.FormatSpec` has
    a :attr:`~plugintrain.formats.registry.FormatSpec.card` (``hf``, ``peft``, ``gguf``)."""
    name: str = "model"
    """The output's name (the card's title and its ``model-index`` name)."""
    base: str | None = None
    """The base weights as the run named them (a pretrained name or a path); None for a
    model trained from scratch (:attr:`from_scratch`) or when unknown."""
    from_scratch: bool = False
    """The run started from no pretrained weights (known: not merely unrecorded)."""
    architecture: str | None = None
    """The model's config name (``smollm2-135m``, ``gpt2-debug``)."""
    dtype: str | None = None
    """The weight type written."""
    adapter: dict[str, Any] | None = None
    """A LoRA run's spec (``r``, ``alpha``, ``target_modules``) when the record has none."""
    merged: bool = False
    """A LoRA run's adapters merged into the base (``--merge-lora``)."""
    sections: tuple[str, ...] = ()
    """Markdown lines added before the versions (a PEFT adapter's training procedure)."""


def checkpoint_facts(
    hparams: dict[str, Any], lora: dict[str, Any] | None, kind: str, **known: Any
) -> CardFacts:
    """What a checkpoint of ``plugintrain fit`` tells without a run record: the base (a
    LoRA run's record, else the model's ``weights`` hyperparameter; none at all means a
    run from scratch) and a LoRA run's spec; ``known`` adds the export's own facts."""
    lora = lora or {}
    base = lora.get("base") or hparams.get("weights")
    spec = _dict(lora.get("spec"))
    adapter = {k: spec.get(k) for k in ("r", "alpha", "target_modules")} if spec else None
    scratch = base is None and "weights" in hparams
    return CardFacts(kind, base=base, from_scratch=scratch, adapter=adapter, **known)


def hub_model(base: str | None) -> HubModel | None:
    """The Hub repository of the base weights ``base``: a pretrained name's, or the repo
    whose snapshot in the Hub's download cache (``models--ORG--NAME/snapshots/REV``) the
    path lies in; None for anything else (a local directory, a file of unknown origin)."""
    if base is None:
        return None
    if base in PRETRAINED_ORIGINS:
        return PRETRAINED_ORIGINS[base]
    match = re.search(r"models--([^/]+?)--([^/]+)/snapshots/", Path(base).as_posix())
    return HubModel(f"{match[1]}/{match[2]}") if match else None


def export_marker(facts: CardFacts) -> str:
    """The last line of a card plugintrain wrote (an HTML comment: not shown)."""
    return f"<!-- written by plugintrain export: {facts.kind} {facts.name} -->"


def gguf_card_path(out: Path) -> Path:
    """Where the card of the GGUF file ``out`` goes: ``README.md`` beside it, unless one
    is there that is not plugintrain's card of this same file; then ``<stem>.README.md``.

    Raises:
        ValueError: If both are there and neither is plugintrain's card of ``out`` (one
            line: nothing is overwritten that export did not write).
    """
    marker = export_marker(CardFacts("gguf", out.name))
    candidates = (out.parent / CARD, out.with_name(f"{out.stem}.{CARD}"))
    for path in candidates:
        if not path.exists() or (path.is_file() and marker in path.read_text(errors="replace")):
            return path
    raise ValueError(
        f"{candidates[0]} and {candidates[1]} exist and are not plugintrain's card of"
        f" {out.name}; move one of them away, or export into another directory"
    )


def model_card(record: dict[str, Any] | None, facts: CardFacts) -> str:
    """The model card of an export: YAML front matter (:func:`card_metadata`), then the
    body: what it is, training, data, results, the recipe, how to load it, versions."""
    record = record if isinstance(record, dict) else {}
    front = yaml.dump(
        card_metadata(record, facts), Dumper=_Dumper, sort_keys=False, allow_unicode=True
    )
    body = [*_summary(record, facts), *_training(record), *_data(record), *_results(record)]
    body += [*_recipe(record), *_usage(record, facts), *facts.sections, *_versions(record)]
    return "\n".join(["---", front.rstrip("\n"), "---", "", *body, export_marker(facts), ""])


def card_metadata(record: dict[str, Any], facts: CardFacts) -> dict[str, Any]:
    """The Hub metadata of the card, keys without a value left out."""
    hub = hub_model(_base(record, facts))
    tags = ["plugintrain", "text-generation", *_card_spec(facts).tags]
    tags += ["lora"] if _adapter(record, facts) is not None else []
    if hub is not None and format_spec(facts.kind).adapters:  # as peft tags an adapter
        tags.append(f"base_model:adapter:{hub.repo_id}")
    datasets = [d["name"] for d in _data_entries(record) if d.get("name")]
    meta = {
        "base_model": hub.repo_id if hub else None,
        "library_name": _card_spec(facts).library,
        "license": hub.license if hub else None,
        "pipeline_tag": "text-generation",
        "tags": list(dict.fromkeys(tags)),
        "datasets": datasets or None,
        "model-index": _model_index(record, facts.name),
    }
    return {k: v for k, v in meta.items() if v is not None}


def _model_index(record: dict[str, Any], name: str) -> list[dict[str, Any]] | None:
    """The evaluation as ``model-index`` results: the evaluated data's measures as one
    result, each lm-eval task's as one more; None without an evaluation."""
    entries = []
    measures = _measures(record)
    if measures:
        data, split = _evaluated_data(record)
        dataset = {"name": data, "type": data} | ({"split": split} if split else {})
        metrics = [{"type": kind, "name": label, "value": v} for kind, label, v in measures]
        entries.append({"task": _TASK, "dataset": dataset, "metrics": metrics})
    tasks: dict[str, list[dict[str, Any]]] = {}
    for task, key, value in _task_scores(record):
        metric = {"type": key.partition(",")[0], "name": _task_metric(key), "value": value}
        tasks.setdefault(task, []).append(metric)
    for task, metrics in tasks.items():
        dataset = {"name": task, "type": task}
        entries.append({"task": _TASK, "dataset": dataset, "metrics": metrics})
    return [{"name": name, "results": entries}] if entries else None


def _measures(record: dict[str, Any]) -> list[tuple[str, str, float]]:
    """``(metric type, name, value)`` of each measure of ``plugintrain evaluate`` the
    record's evaluation took."""
    results = _dict(_dict(record.get("evaluation")).get("results"))
    return [
        (kind, label, results[key])
        for key, (kind, label) in _EVALUATION_METRICS.items()
        if _number(results.get(key))
    ]


def _evaluated_data(record: dict[str, Any]) -> tuple[str, str | None]:
    """The name of the data the evaluation measured, and its split."""
    evaluation = _dict(record.get("evaluation"))
    results = _dict(evaluation.get("results"))
    data = _label(evaluation.get("data") or results.get("data")) or "evaluation data"
    split = results.get("split")
    return data, str(split) if split else None


def _task_scores(record: dict[str, Any]) -> list[tuple[str, str, float]]:
    """``(task, lm-eval metric key, value)`` of each lm-eval score (standard errors left
    out: the model-index holds one value per metric)."""
    tasks = _dict(_dict(record.get("evaluation")).get("tasks"))
    return [
        (str(task), str(key), value)
        for task, scores in tasks.items()
        for key, value in _dict(scores).items()
        if _number(value) and "_stderr" not in str(key)
    ]


def _task_metric(key: str) -> str:
    """An lm-eval metric's name: ``acc,none`` -> ``acc``, ``exact_match,strict-match`` ->
    ``exact_match (strict-match)``."""
    metric, _, variant = key.partition(",")
    return metric if variant in ("", "none") else f"{metric} ({variant})"


# -- the body -----------------------------------------------------------------------------


def _summary(record: dict[str, Any], facts: CardFacts) -> list[str]:
    """The title and what the export is: base, method, kind."""
    base = _base(record, facts)
    hub = hub_model(base)
    if hub is not None:
        origin = f"[{hub.repo_id}](https://huggingface.co/{hub.repo_id})"
        origin += f", {hub.note}" if hub.note else ""
    elif base:
        origin = f"`{Path(base).name}` (local weights)"
    else:
        origin = "none: trained from scratch" if _from_scratch(record, facts) else "not recorded"
    what = _card_spec(facts).what
    lines = [f"# {facts.name}", "", f"{what[0].upper()}{what[1:]}, trained with plugintrain."]
    lines += ["", f"- **Base model**: {origin}", f"- **Method**: {_method(record, facts)}"]
    lines.append(f"- **Export**: {what}" + (f" ({facts.dtype})" if facts.dtype else ""))
    architecture = facts.architecture or _dict(record.get("model")).get("config")
    if architecture:
        lines.append(f"- **Architecture**: `{architecture}`")
    if not record:
        lines += ["", "The checkpoint carries no record of its run (a checkpoint of an older"]
        lines[-1] += " plugintrain, or not written by `plugintrain fit`): this card holds what"
        lines[-1] += " the export knows."
    return [*lines, ""]


def _method(record: dict[str, Any], facts: CardFacts) -> str:
    adapter = _adapter(record, facts)
    if adapter is None:
        if _base(record, facts):
            return "full fine-tuning"
        return "training from scratch" if _from_scratch(record, facts) else "full training"
    spec = f"r={adapter.get('r')}, alpha={adapter.get('alpha')}"
    targets = ", ".join(f"`{t}`" for t in adapter.get("target_modules") or [])
    spec += f", on {targets}" if targets else ""
    merged = "; adapters merged into the base" if facts.merged else ""
    return f"LoRA ({spec}){merged}"


def _training(record: dict[str, Any]) -> list[str]:
    """Steps, epochs, hardware, strategy and precision."""
    hardware = _dict(record.get("hardware"))
    rows = [("Steps", record.get("step")), ("Epochs", record.get("epoch"))]
    if hardware:
        devices = f"{hardware.get('devices', '?')} x {hardware.get('device_name', '?')}"
        nodes = hardware.get("num_nodes")
        where = f" on {nodes} nodes" if isinstance(nodes, int) and nodes > 1 else ""
        rows.append(("Hardware", f"{devices} ({hardware.get('accelerator', '?')}){where}"))
    rows += [("Strategy", record.get("strategy")), ("Precision", record.get("precision"))]
    lines = [f"- **{k}**: {v}" for k, v in rows if v is not None]
    return ["## Training", "", *lines, ""] if lines else []


def _data(record: dict[str, Any]) -> list[str]:
    """One row per data folder: name, kind, tokenizer, tokens per split, meta.json's sha256."""
    rows = []
    for entry in _data_entries(record):
        meta = _dict(entry.get("meta"))
        tokens = ", ".join(f"{s} {n:,}" for s, n in _split_tokens(meta).items())
        digest = entry.get("meta_sha256")
        kind = meta.get("kind") or ("text" if meta else "")  # prepare shakespeare names none
        rows.append(
            (
                entry.get("name") or _label(entry.get("path")),
                kind,
                _text(meta.get("tokenizer")),
                tokens,
                f"`{digest}`" if digest else "",
            )
        )
    if not rows:
        return []
    head = ("data", "kind", "tokenizer", "tokens", "sha256 of meta.json")
    return ["## Data", "", *_table(head, rows), ""]


def _split_tokens(meta: dict[str, Any]) -> dict[str, int]:
    """Tokens per split as ``meta.json`` records them (``splits.S.tokens`` of ``prepare``,
    ``S_tokens`` of ``prepare shakespeare``)."""
    splits = {s: _dict(v).get("tokens") for s, v in _dict(meta.get("splits")).items()}
    splits |= {k.removesuffix("_tokens"): v for k, v in meta.items() if k.endswith("_tokens")}
    return {s: n for s, n in splits.items() if isinstance(n, int)}


def _results(record: dict[str, Any]) -> list[str]:
    """The last logged metrics, the evaluation's measures and its lm-eval tasks."""
    lines = []
    metrics = [(k, _value(v)) for k, v in sorted(_dict(record.get("metrics")).items())]
    if metrics:
        lines += ["## Final metrics", "", *_table(("metric", "value"), metrics), ""]
    measures = [(label, _value(value)) for _, label, value in _measures(record)]
    if measures:
        data, split = _evaluated_data(record)
        step = _dict(record.get("evaluation")).get("step")
        where = data + (f", split {split}" if split else "")
        where += f", at step {step}" if step is not None else ""
        lines += ["## Evaluation", "", f"`plugintrain evaluate` on {where}:", ""]
        lines += [*_table(("measure", "value"), measures), ""]
    tasks = [(task, _task_metric(key), _value(v)) for task, key, v in _task_scores(record)]
    if tasks:
        head = ("task", "metric", "value")
        lines += ["### lm-evaluation-harness", "", *_table(head, tasks), ""]
    return lines


def _recipe(record: dict[str, Any]) -> list[str]:
    """The resolved recipe the run was started with, fenced (a fence longer than any run
    of backticks in it)."""
    recipe = record.get("recipe")
    if not isinstance(recipe, str) or not recipe.strip():
        return []
    fence = "`" * max(3, 1 + max((len(r) for r in re.findall(r"`+", recipe)), default=0))
    intro = "The run's resolved configuration, as `plugintrain fit` saved it (`config.yaml`):"
    return ["## Recipe", "", intro, "", f"{fence}yaml", recipe.rstrip("\n"), fence, ""]


def _usage(record: dict[str, Any], facts: CardFacts) -> list[str]:
    """How to load it, in the tools that read the kind."""
    language, code = _card_spec(facts).usage
    hub = hub_model(_base(record, facts))
    base = f'"{hub.repo_id}")' if hub else '"BASE")  # the base it was trained on'
    code = code.format(where=facts.name, base=base)
    return ["## How to use", "", f"```{language}", code, "```", ""]


def _versions(record: dict[str, Any]) -> list[str]:
    """plugintrain's version and commit of the run, and the one that exported it."""
    lines = ["### Framework versions", ""]
    if record.get("plugintrain_version"):
        commit = record.get("git_commit")
        at = f" (git commit `{commit}`)" if commit else ""
        lines.append(f"- Trained with plugintrain {record['plugintrain_version']}{at}")
    return [*lines, f"- Exported with plugintrain {plugintrain_version()}", ""]


def plugintrain_version() -> str:
    """plugintrain's installed version (the package metadata: formats sit below the package
    root, which must not be imported from here)."""
    try:
        return version("plugintrain")
    except PackageNotFoundError:
        return "(not installed)"


# -- reading a record that may lack anything ----------------------------------------------


def _card_spec(facts: CardFacts) -> CardSpec:
    """What the registry says of the card of the format written.

    Raises:
        ValueError: For a format ``export`` writes no card for (one line).
    """
    card = format_spec(facts.kind).card
    if card is None:
        raise ValueError(f"--format {facts.kind} has no model card; export writes none")
    return card


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _number(value: Any) -> bool:
    """A finite number (not a flag): what a metric's value may be."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _data_entries(record: dict[str, Any]) -> list[dict[str, Any]]:
    data = record.get("data")
    return [d for d in data if isinstance(d, dict)] if isinstance(data, list) else []


def _base(record: dict[str, Any], facts: CardFacts) -> str | None:
    weights = _dict(record.get("model")).get("weights")
    return str(weights) if weights else facts.base


def _from_scratch(record: dict[str, Any], facts: CardFacts) -> bool:
    model = _dict(record.get("model"))
    return ("weights" in model and model["weights"] is None) or facts.from_scratch


def _adapter(record: dict[str, Any], facts: CardFacts) -> dict[str, Any] | None:
    adapter = record.get("adapter")
    return adapter if isinstance(adapter, dict) else facts.adapter


def _label(path: Any) -> str | None:
    """A data path's folder or file name (what a card may show of a local path)."""
    return (Path(str(path)).name or str(path)) if path else None


def _text(value: Any) -> str:
    return value if isinstance(value, str) else "" if value is None else json.dumps(value)


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return _text(value)


def _table(head: tuple[str, ...], rows: Iterable[tuple[Any, ...]]) -> list[str]:
    """A Markdown table, ``|`` in cells escaped."""

    def row(cells: Iterable[Any]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return [row(head), row("---" for _ in head), *(row(r) for r in rows)]
