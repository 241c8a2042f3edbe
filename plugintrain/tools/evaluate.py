"""``plugintrain evaluate``: how well a model predicts held-out data, and how a chat model
answers.

``--data`` is one of:

- a text folder (``plugintrain prepare text`` or ``prepare shakespeare``, or llm.c's
  ``train.bin``/``val.bin``): the split is cut into non-overlapping windows of ``--seq_len``
  tokens (default: the model's ``block_size``; a tail shorter than a window is left out,
  as validation during ``fit`` does). Loss is the mean NLL per predicted token,
  perplexity its exponential, and bits per byte the NLL over the UTF-8 bytes the targets
  spell (the folder's ``token_bytes.npy``; left out without one).
- a chat folder (``plugintrain prepare chat``): loss and perplexity over the tokens its
  examples train on (``S.mask.npy``), and the greedy answers to ``S.messages.jsonl``'s
  conversations (all messages but the last, which is the reference answer).
- a ``.jsonl``/``.json`` file of conversations, each ending with the reference assistant
  message: loss on the reference's tokens and the same answers.
- a preference folder (``plugintrain prepare preference``): each held-out pair's answer
  log-probs under the model and under a reference, and from them the preference accuracy
  (the share of pairs whose chosen answer gains more log-probability over the reference
  than the rejected one: DPO's implicit reward ranks it first), the mean reward margin
  (``--beta`` times the difference of the two gains) and the reference's own accuracy
  (its chosen answer more likely than its rejected one). The reference is ``--reference
  WEIGHTS`` (scored here), else the folder's own (``prepare preference --reference``),
  else, with ``--adapter``, ``--weights`` without it; with none, the accuracy is the
  model's own. Loss and perplexity are
  over the chosen answers' tokens, and the answers to the pairs' prompts are scored
  against the chosen answers.

An answer ends at the template's end of turn or after ``--max_new_tokens``; it scores an
exact match when it equals the reference once surrounding whitespace is stripped, and
"contains" when the reference appears in it, ignoring case.

The results print as a table; ``--json OUT`` writes them to OUT as one JSON object instead
(``-``: to stdout), with every key present and null where the data has no such measure:
``weights, adapter, data, split, examples, tokens, loss, perplexity, bits_per_byte,
exact_match, contains, preference_accuracy, reward_margin, reference_accuracy``. Bad
options and data end the command with one line and exit status 2, before the model loads
where the model is not needed to tell.
"""

from __future__ import annotations

import itertools
import math
import shlex
import sys
from argparse import Namespace
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from json import dumps
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plugintrain.cli_messages import ConfigError
from plugintrain.tools._command import shared_help
from plugintrain.tools._models import (
    DEVICE_HELP,
    MERGED_ADAPTER_HELP,
    WEIGHTS_HELP,
    holds_conversations,
    load_model,
    missing_path,
    model_tokenizer,
    pick_device,
    read_conversations,
)

if TYPE_CHECKING:
    import numpy as np

    from plugintrain.data.tokenizers.chat_templates import ChatEncoder
    from plugintrain.model_zoo.generation import PretrainedLM
    from plugintrain.model_zoo.metrics import Totals

TEXT, CHAT_FOLDER, CHAT_FILE = "text folder", "chat folder", "chat file"
PREFERENCE_FOLDER = "preference folder"


def _argument_problem(args: Namespace) -> str | None:
    """What is wrong with the arguments, before any file is read; None when nothing is."""
    for option in ("seq_len", "max_new_tokens", "batch_size", "limit"):
        value = getattr(args, option)
        if value is not None and value < 1:
            return f"--{option} must be >= 1, got {value}"
    if args.weights is None and args.adapter is None:
        return "pass --weights (a checkpoint or pretrained weights), or --adapter"
    if (args.data is None) == (args.tasks is None):
        return (
            "pass --data (a prepared folder or a chat file) or --tasks (lm-eval tasks), one of them"
        )
    if args.tasks is None and (args.include_path or args.num_fewshot is not None):
        return "--include_path and --num_fewshot go with --tasks; drop them or pass --tasks"
    if args.include_path is not None and not Path(args.include_path).is_dir():
        return f"--include_path {args.include_path}: no such folder; pass your task YAMLs' folder"
    if args.template not in (None, "plain") and not Path(args.template).is_file():
        return f"--template {args.template}: no such file; pass a .jinja file, or plain"
    return (
        missing_path("--weights", args.weights)
        or missing_path("--adapter", args.adapter)
        or missing_path("--reference", args.reference)
    )


# ---- the data, read before the model loads ---------------------------------------------


@dataclass
class EvalData:
    """What ``--data`` names, checked.

    Args:
        path: The folder or file.
        kind: ``TEXT``, ``CHAT_FOLDER`` or ``CHAT_FILE``.
        split: A folder's split; None for a file.
        meta: A folder's ``meta.json`` (``{}`` for llm.c files and chat files).
        conversations: Conversations to answer (the first ``--limit``), each ending with
            its reference answer; None when there are none (text; a chat folder without
            ``S.messages.jsonl``).
    """

    path: Path
    kind: str
    split: str | None
    meta: dict[str, Any]
    conversations: list[list[dict[str, str]]] | None = None


def open_data(path: Path, split: str | None, limit: int | None = None) -> EvalData:
    """Recognize and check ``--data`` and ``--split``; of conversations, read the first
    ``limit``.

    Raises:
        ValueError: Naming the path and the command that prepares what it should hold.
    """
    from plugintrain.data.datamodules.token_shards import read_meta

    if path.is_file():
        if not holds_conversations(path):
            raise ValueError(_not_data(path))
        if split is not None:
            raise ValueError(f"--split {split} picks a folder's split; drop it for {path}")
        conversations = _with_references(read_conversations(path)[:limit], path)
        return EvalData(path, CHAT_FILE, None, {}, conversations)
    meta, split = read_meta(path) if path.is_dir() else {}, split or "val"
    if meta.get("kind") == "preference":
        _check_split(path, split, list(meta.get("splits", {})), f"{split}.ids.npy")
        _check_examples(path, meta, split)
        file = path / f"{split}.pairs.jsonl"
        conversations = _pair_prompts(file)[:limit] if file.is_file() else None
        return EvalData(path, PREFERENCE_FOLDER, split, meta, conversations)
    if meta.get("kind") == "chat":  # data.chat_datamodule.is_chat_folder, without Lightning
        _check_split(path, split, list(meta.get("splits", {})), f"{split}.ids.npy")
        _check_examples(path, meta, split)
        file = path / f"{split}.messages.jsonl"
        conversations = read_conversations(file)[:limit] if file.is_file() else None
        return EvalData(path, CHAT_FOLDER, split, meta, _with_references(conversations, file))
    splits = _text_splits(path, meta)
    if not splits:
        raise ValueError(_not_data(path))
    _check_split(path, split, splits, None)
    return EvalData(path, TEXT, split, meta)


def _text_splits(path: Path, meta: dict[str, Any]) -> list[str]:
    """The splits of a text folder: those its ``meta.json`` lists, else its llm.c files."""
    from plugintrain.data.datamodules.token_shards import is_text_shards

    if is_text_shards(meta):
        return list(meta["splits"])
    files = sorted(path.glob("*.bin")) if path.is_dir() else []
    return [file.name.removesuffix(".bin") for file in files]


def _check_split(path: Path, split: str, splits: list[str], file: str | None) -> None:
    if split not in splits or (file is not None and not (path / file).is_file()):
        raise ValueError(
            f"{path} holds no {split} split (it holds {', '.join(splits) or 'none'}); pass"
            f" --split {splits[0] if splits else 'val'}, or prepare the data again"
        )


def _pair_prompts(file: Path) -> list[list[dict[str, str]]]:
    """Each pair of a preference folder's ``S.pairs.jsonl`` as its prompt's messages and
    the chosen answer (the reference answer)."""
    import json

    with file.open() as lines:
        pairs = [json.loads(line) for line in lines if line.strip()]
    return [[*p["prompt"], {"role": "assistant", "content": p["chosen"]}] for p in pairs]


def _check_examples(path: Path, meta: dict[str, Any], split: str) -> None:
    """Refuse a chat or preference split that ``prepare`` left empty (its ``meta.json``
    counts)."""
    counts = meta["splits"][split]
    if counts.get("examples", counts.get("pairs", 1)) == 0:
        raise ValueError(
            f"{path} holds no {split} examples (its meta.json); prepare it again with a larger"
            " --val_fraction or --val_examples"
        )


def _not_data(path: Path) -> str:
    out = shlex.quote(str(path))
    what = (
        "no such file or directory"
        if not path.exists()
        else "not a file of conversations (.jsonl, .json, .parquet)"
        if path.is_file()
        else "holds no prepared data"
    )
    return (
        f"--data {path}: {what}; pass a folder written by `plugintrain prepare text ... --out"
        f" {out}`, `plugintrain prepare shakespeare --tokenizer T --out {out}` or `plugintrain"
        f" prepare chat FILE.jsonl --tokenizer T --out {out}`, or a .jsonl file of"
        ' {"messages": [...]} conversations'
    )


def _with_references(
    conversations: list[list[dict[str, str]]] | None, path: Path
) -> list[list[dict[str, str]]] | None:
    """``conversations`` (of ``path``), checked to end with an assistant message that
    follows another."""
    for n, messages in enumerate(conversations or [], 1):
        if len(messages) < 2 or messages[-1]["role"] != "assistant":
            last = f"a lone {messages[0]['role']}" if len(messages) < 2 else messages[-1]["role"]
            raise ValueError(
                f"{path} conversation {n} ends with {last} message; end each with the"
                " reference answer, an assistant message after the prompt's messages"
            )
    return conversations


def _check_tokenizer(data: EvalData, module: PretrainedLM) -> None:
    """Refuse a folder of another tokenizer's ids, or of a larger vocabulary."""
    from plugintrain.data.tokenizers.registry import tokenizer_spec

    recorded, reads = data.meta.get("tokenizer"), model_tokenizer(module)
    if recorded is not None and tokenizer_spec(recorded) != tokenizer_spec(reads):
        raise ValueError(
            f"{data.path} holds {recorded} tokens (its meta.json) but the model reads {reads}"
            f" tokens; prepare the data again with --tokenizer {reads}"
        )
    if int(data.meta.get("vocab_size", 0)) > module.vocab_size:
        raise ValueError(
            f"{data.path} holds token ids up to {data.meta['vocab_size'] - 1} (its meta.json),"
            f" outside the model's vocab_size={module.vocab_size}; prepare it with the model's"
            " tokenizer"
        )


# ---- losses --------------------------------------------------------------------------------


def text_totals(
    module: PretrainedLM, data: EvalData, seq_len: int, args: Namespace
) -> tuple[Totals, int]:
    """The totals over a text split's windows (the first ``--limit``), and their number."""
    import torch

    from plugintrain.data.datamodules.prepared_folders import PreparedFolders
    from plugintrain.data.tokenizers.token_bytes import read_token_bytes
    from plugintrain.model_zoo.metrics import window_totals

    name = f"{data.split}.bin"  # a folder of llm.c files; prepare text's meta.json lists shards
    windows = PreparedFolders([data.path], name, name, None).windows(
        data.split, seq_len, module.vocab_size
    )
    count = len(windows) if args.limit is None else min(args.limit, len(windows))
    counts = read_token_bytes(data.path)
    token_bytes = None if counts is None else torch.from_numpy(counts).to(module.device)
    return window_totals(module, windows, count, args.batch_size, token_bytes), count


def folder_examples(data: EvalData, limit: int | None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The ids and target mask of each example of a chat folder's split (the first
    ``limit``), memory-mapped."""
    import numpy as np

    ids = np.load(data.path / f"{data.split}.ids.npy", mmap_mode="r")  # (N,) uint32
    mask = np.load(data.path / f"{data.split}.mask.npy", mmap_mode="r")  # (N,) uint8
    offsets = np.load(data.path / f"{data.split}.offsets.npy")  # (n + 1,) int64
    count = len(offsets) - 1 if limit is None else min(limit, len(offsets) - 1)
    for start, end in itertools.pairwise(offsets[: count + 1]):
        yield np.asarray(ids[start:end]), np.asarray(mask[start:end]).astype(bool)


# ---- answers -------------------------------------------------------------------------------


def answers(
    module: PretrainedLM, encoder: ChatEncoder, data: EvalData, args: Namespace
) -> list[list[int]]:
    """The model's greedy answer (ids) to each of the data's conversations but its last
    message.

    Raises:
        ValueError: If a prompt and ``--max_new_tokens`` do not fit in ``block_size``.
    """
    from plugintrain.model_zoo.generation import complete

    prompts = [encoder.encode_prompt(messages[:-1]) for messages in data.conversations]
    limit = module.max_seq_len
    for n, prompt in enumerate(prompts, 1):
        if len(prompt) + args.max_new_tokens > limit:
            fix = (
                f"pass --max_new_tokens {limit - len(prompt)}"
                if len(prompt) < limit
                else "drop it from the data"
            )
            raise ValueError(
                f"{data.path} conversation {n}: its prompt's {len(prompt)} tokens +"
                f" --max_new_tokens {args.max_new_tokens} exceed the model's"
                f" block_size={limit}; {fix}"
            )
    return complete(
        module.model,
        prompts,
        args.max_new_tokens,
        encoder.stop_ids,
        args.batch_size,
        temperature=0.0,
    )


def score(answers: Sequence[str], references: Sequence[str]) -> tuple[float, float]:
    """The fraction of ``answers`` that equal their reference (whitespace around either
    stripped), and the fraction that contain it (ignoring case)."""
    pairs = list(zip(answers, references, strict=True))
    exact = sum(a.strip() == r.strip() for a, r in pairs)
    contains = sum(r.strip().lower() in a.lower() for a, r in pairs)
    return exact / len(pairs), contains / len(pairs)


# ---- the command ---------------------------------------------------------------------------


def evaluate(module: PretrainedLM, data: EvalData, args: Namespace) -> dict[str, Any]:
    """The results of ``module`` (in eval mode, on its device) on ``data``."""
    import torch

    from plugintrain.model_zoo.metrics import chat_totals

    with torch.inference_mode():
        if data.kind == TEXT:
            totals, examples = text_totals(module, data, args.seq_len or module.max_seq_len, args)
            return _results(args, data, totals, examples, None)
        if data.kind == PREFERENCE_FOLDER:
            return _preference_results(module, data, args)
        tokenizer, encoder = _chat_encoder(module, data, args.template)
        if data.kind == CHAT_FOLDER:
            examples = folder_examples(data, args.limit)
        else:
            examples = (encoder.encode(m, train_on="completion") for m in data.conversations)
        totals, count = chat_totals(module, examples, args.batch_size, data.path)
        scores = None
        if data.conversations:
            texts = [tokenizer.decode(a) for a in answers(module, encoder, data, args)]
            scores = score(texts, [messages[-1]["content"] for messages in data.conversations])
    return _results(args, data, totals, count, scores)


def _preference_results(module: PretrainedLM, data: EvalData, args: Namespace) -> dict[str, Any]:
    """A preference folder's results: the chosen answers' loss, the answers to the pairs'
    prompts, and the preference accuracy and margin over the reference."""
    import numpy as np

    from plugintrain.model_zoo.metrics import chat_totals
    from plugintrain.model_zoo.preference import scored_logps

    sequences = list(folder_examples(data, None if args.limit is None else 2 * args.limit))
    logps = scored_logps(module.model, sequences, args.batch_size)
    reference = getattr(args, "reference_logps", None)
    if reference is None:
        reference = _folder_reference(data, len(sequences))
    totals, _ = chat_totals(module, iter(sequences[0::2]), args.batch_size, data.path)
    scores = None
    if data.conversations:
        tokenizer, encoder = _chat_encoder(module, data, args.template)
        texts = [tokenizer.decode(a) for a in answers(module, encoder, data, args)]
        scores = score(texts, [messages[-1]["content"] for messages in data.conversations])
    results = _results(args, data, totals, len(sequences) // 2, scores)
    gain = logps if reference is None else logps - reference
    results["preference_accuracy"] = float(np.mean(gain[0::2] > gain[1::2]))
    if reference is not None:
        results["reward_margin"] = float(args.beta * np.mean(gain[0::2] - gain[1::2]))
        results["reference_accuracy"] = float(np.mean(reference[0::2] > reference[1::2]))
    return results


def _folder_reference(data: EvalData, count: int) -> np.ndarray | None:
    """The first ``count`` reference log-probs a preference folder holds, else None."""
    import numpy as np

    file = data.path / f"{data.split}.ref_logps.npy"
    return np.load(file)[:count] if file.is_file() else None


def _chat_encoder(
    module: PretrainedLM, data: EvalData, template: str | None
) -> tuple[Any, ChatEncoder]:
    """The model's tokenizer, and the encoder of conversations in ``template``; by default
    the template a chat folder was prepared with where its origin can be read again
    (``plain``, a file), else the model's own. A template other than the folder's (by
    sha256) is noted on stderr: the answers are then prompted unlike the training data."""
    from plugintrain.data import get_tokenizer
    from plugintrain.data.tokenizers.chat_templates import ChatEncoder, load_chat_template

    recorded = data.meta.get("template") or {}
    origin = recorded.get("origin")
    if template is None and (origin == "plain" or (origin and Path(origin).is_file())):
        template = origin
    spec = model_tokenizer(module)
    tokenizer = get_tokenizer(spec)
    chat_template = load_chat_template(spec, template)
    if recorded.get("sha256") not in (None, chat_template.sha256):
        print(
            f"plugintrain evaluate: {data.path} was prepared with the chat template of"
            f" {origin}; the answers are prompted with another ({chat_template.origin});"
            " pass --template to choose",
            file=sys.stderr,
        )
    return tokenizer, ChatEncoder(tokenizer, chat_template)


def _results(
    args: Namespace,
    data: EvalData,
    totals: Totals,
    examples: int,
    scores: tuple[float, float] | None,
) -> dict[str, Any]:
    loss = totals.loss
    return {
        "weights": args.weights,
        "adapter": args.adapter,
        "data": str(data.path),
        "split": data.split,
        "examples": examples,
        "tokens": totals.tokens,
        "loss": loss,
        "perplexity": None if loss is None else math.exp(loss),
        "bits_per_byte": totals.bits_per_byte,
        "exact_match": None if scores is None else scores[0],
        "contains": None if scores is None else scores[1],
        "preference_accuracy": None,
        "reward_margin": None,
        "reference_accuracy": None,
    }


_LABELS = {
    "bits_per_byte": "bits per byte",
    "exact_match": "exact match",
    "preference_accuracy": "preference accuracy",
    "reward_margin": "reward margin",
    "reference_accuracy": "reference accuracy",
}
_FORMATS = {
    "loss": "{:.4f}",
    "perplexity": "{:.3f}",
    "bits_per_byte": "{:.4f}",
    "exact_match": "{:.1%}",
    "contains": "{:.1%}",
    "preference_accuracy": "{:.1%}",
    "reward_margin": "{:.4f}",
    "reference_accuracy": "{:.1%}",
}


def table(results: dict[str, Any]) -> str:
    """``results`` as lines of name and value, the measures the data has."""
    split = f" ({results['split']})" if results["split"] else ""
    shown = {**results, "data": f"{results['data']}{split}", "split": None}
    rows = {
        _LABELS.get(key, key): _FORMATS.get(key, "{}").format(value)
        for key, value in shown.items()
        if value is not None
    }
    width = max(map(len, rows))
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows.items())


def _options_problem(args: Namespace, data: EvalData) -> str | None:
    """Options that do not apply to ``data``; None if none."""
    if not args.beta > 0:
        return f"--beta {args.beta}: must be > 0 (DPO's usual value is 0.1)"
    if data.kind != PREFERENCE_FOLDER and args.beta != 0.1:
        return f"--beta scales a preference folder's reward margin; {data.path} holds none: drop it"
    if data.kind != PREFERENCE_FOLDER and args.reference is not None:
        return f"--reference scores a preference folder's pairs; {data.path} holds none: drop it"
    if data.kind != TEXT and args.seq_len is not None:
        return f"--seq_len cuts text into windows; {data.path} holds chat examples: drop it"
    if data.kind == TEXT and args.template is not None:
        return f"--template renders conversations; {data.path} holds text: drop it"
    return None


def _load(args: Namespace, data: EvalData) -> PretrainedLM:
    """The model on its device, checked against ``data``; a mismatch ends the command."""
    try:
        device = pick_device(args.device)
        module = load_model(args.weights, args.adapter, merge=True)
        _check_tokenizer(data, module)
    except (FileNotFoundError, ValueError) as error:  # incl. unsafe or truncated files
        raise ConfigError(str(error)) from None
    if args.seq_len is not None and args.seq_len > module.max_seq_len:
        raise ConfigError(
            f"--seq_len {args.seq_len} exceeds the model's block_size={module.max_seq_len};"
            f" pass --seq_len {module.max_seq_len}, or drop it"
        )
    return module.to(device)


@shared_help(weights=WEIGHTS_HELP, adapter=MERGED_ADAPTER_HELP, device=DEVICE_HELP)
def evaluate_command(
    *,
    weights: str | None = None,
    adapter: str | None = None,
    data: str | None = None,
    tasks: str | None = None,
    include_path: str | None = None,
    num_fewshot: int | None = None,
    split: str | None = None,
    seq_len: int | None = None,
    max_new_tokens: int = 128,
    batch_size: int = 8,
    limit: int | None = None,
    template: str | None = None,
    beta: float = 0.1,
    reference: str | None = None,
    json: str | None = None,
    device: str | None = None,
) -> int:
    """Loss, perplexity, bits per byte, or a chat model's answers on held-out data.

    Loss, perplexity and bits per byte of a model on held-out data, or a chat model's
    answers against reference answers (or lm-evaluation-harness tasks: --tasks). Prints
    the results, or writes them as JSON with --json.

    Args:
        weights: the model's weights
        adapter: a LoRA run's or PEFT adapters on them
        data: a folder of `plugintrain prepare text`/`shakespeare` (text), `prepare chat`
            or `prepare preference`, or a .jsonl/.json file of conversations ending with
            the reference answer
        tasks: instead of --data: lm-evaluation-harness tasks, comma-separated (hellaswag,
            gsm8k, or your own from --include_path), run by lm_eval with plugintrain's model
        include_path: --tasks: a folder of your own lm-eval task YAMLs
        num_fewshot: --tasks: few-shot examples
        split: a folder's split (default: val)
        seq_len: text: tokens a window (default: block_size)
        max_new_tokens: chat: most tokens an answer
        batch_size: windows or examples a batch
        limit: the first N windows/examples
        template: chat: a .jinja chat template, or plain (default: the model's own)
        beta: preference: DPO's beta, the reward margin's scale
        reference: preference: the reference model's weights (a full fine-tuning run's
            starting weights), scored here; default: the folder's stored log-probs, or
            with --adapter the --weights it was trained on
        json: write the results as JSON to this file (-: stdout)
        device: where the model runs
    """
    args = Namespace(**locals())  # the helpers below read the options by name
    return _evaluate(args)


def _evaluate(args: Namespace) -> int:
    """``evaluate``'s work, its options checked first."""
    problem = _argument_problem(args)
    if problem is not None:
        raise ConfigError(problem)
    if args.tasks is not None:
        return _run_tasks(args)
    try:
        found = open_data(Path(args.data), args.split, args.limit)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    problem = _options_problem(args, found)
    if problem is not None:
        raise ConfigError(problem)
    args.reference_logps = None
    base_is_reference = args.adapter is not None and args.weights is not None
    cached = (found.path / f"{found.split}.ref_logps.npy").is_file()
    if args.reference is not None:  # the reference named: scored here, as the base would be
        args.reference_logps = _base_logps(
            Namespace(**{**vars(args), "weights": args.reference, "adapter": None}), found
        )
    elif found.kind == PREFERENCE_FOLDER and args.weights is None and not cached:
        raise ConfigError(
            f"--data {found.path} holds no reference log-probs, and the reference of an"
            " adapter is its base: pass --weights BASE (the weights the adapter was trained"
            " on) beside --adapter"
        )
    elif found.kind == PREFERENCE_FOLDER and base_is_reference and not cached:
        args.reference_logps = _base_logps(args, found)
    module = _load(args, found)
    try:
        results = evaluate(module, found, args)
    except (FileNotFoundError, ValueError) as error:  # the data, as the model reads it
        raise ConfigError(str(error)) from None
    if args.json is None:
        print(table(results))
    elif args.json == "-":
        print(dumps(results))
    else:
        Path(args.json).write_text(dumps(results, indent=2) + "\n")
    return 0


def _base_logps(args: Namespace, data: EvalData) -> np.ndarray:
    """The held-out pairs' log-probs under ``--weights`` without the adapter: the
    reference of a LoRA run (loaded, used and let go before the adapted model loads)."""
    import torch

    from plugintrain.model_zoo.preference import scored_logps

    base = _load(Namespace(**{**vars(args), "adapter": None}), data)
    count = None if args.limit is None else 2 * args.limit
    with torch.inference_mode():
        return scored_logps(base.model.eval(), folder_examples(data, count), args.batch_size)


def _run_tasks(args: Namespace) -> int:
    """``--tasks``: lm-evaluation-harness's tasks on plugintrain's model
    (:class:`plugintrain.tools.lm_eval_model.PluginTrainLM`); lm-eval's table, or its
    ``results`` as JSON. The tasks are checked before the model loads
    (:func:`plugintrain.tools.lm_eval_tasks.check_tasks`)."""
    from plugintrain.tools.lm_eval_tasks import check_tasks, run_tasks

    tasks = [t for t in args.tasks.split(",") if t]
    checked = check_tasks(tasks, args.include_path, args.num_fewshot)
    from plugintrain.tools.lm_eval_model import PluginTrainLM  # lm_eval: found by the check

    try:
        model = PluginTrainLM(
            weights=args.weights,
            adapter=args.adapter,
            device=args.device,
            batch_size=args.batch_size,
            max_gen_toks=args.max_new_tokens,
        )
    except (FileNotFoundError, ValueError) as error:
        raise ConfigError(str(error)) from None
    results = run_tasks(checked, model, limit=args.limit)
    if args.json is None:
        from lm_eval.utils import make_table

        print(make_table(results))
    else:
        text = dumps({"tasks": results["results"]}, indent=2, default=str)
        print(text) if args.json == "-" else Path(args.json).write_text(text + "\n")
    return 0
