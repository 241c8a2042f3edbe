"""``plugintrain prepare chat``: rows of every format read and converted, arrays that
decode back to the rendered conversations with the answers marked, a held-out split that
does not depend on the rows' order, truncation counted, and one-line errors that leave
nothing written, each with a fix that works."""

from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from plugintrain.cli import main as cli_main
from plugintrain.data import fetch_asset, get_tokenizer
from plugintrain.data.prepare.chat_formats import (
    ChatDataError,
    detect_format,
    read_chat_rows,
    to_messages,
)
from plugintrain.data.tokenizers.chat_templates import ChatEncoder, load_chat_template

SYSTEM = {"role": "system", "content": "Be brief."}
ROWS = {
    "messages": {
        "messages": [
            SYSTEM,
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "2 + 2?"},
            {"role": "assistant", "content": "4"},
        ]
    },
    "prompt_response": {
        "prompt": "Capital of France?",
        "response": "Paris.",
        "system": "Be brief.",
    },
    "alpaca": {"instruction": "Translate to French.", "input": "cat", "output": "chat"},
    "sharegpt": {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Name a colour."},
            {"from": "gpt", "value": "Blue. ⟦not a mark⟧"},
        ]
    },
}
MESSAGES = {
    "messages": ROWS["messages"]["messages"],
    "prompt_response": [
        SYSTEM,
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
    ],
    "alpaca": [
        {"role": "user", "content": "Translate to French.\n\ncat"},
        {"role": "assistant", "content": "chat"},
    ],
    "sharegpt": [
        SYSTEM,
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue. ⟦not a mark⟧"},
    ],
}


def prepare_main(argv: list[str]) -> int:
    return cli_main(["prepare", *argv])


def _conversation(n: int) -> dict:
    return {
        "messages": [
            {"role": "user", "content": f"Question {n}: what is {n} squared?"},
            {"role": "assistant", "content": f"{n * n}, since {n} × {n} = {n * n}."},
        ]
    }


def _write(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def _run(inputs, out: Path, *extra: str, tokenizer="gpt2", template="plain") -> int:
    argv = ["chat", *map(str, inputs), "--tokenizer", tokenizer, "--out", str(out)]
    argv += ["--template", template] if template else []
    return prepare_main([*argv, *extra])


def _examples(out: Path, split: str) -> list[tuple[np.ndarray, np.ndarray]]:
    ids = np.load(out / f"{split}.ids.npy")
    mask = np.load(out / f"{split}.mask.npy")
    offsets = np.load(out / f"{split}.offsets.npy")
    assert (ids.dtype, mask.dtype, offsets.dtype) == (np.uint32, np.uint8, np.int64)
    assert offsets[0] == 0 and offsets[-1] == len(ids) == len(mask)
    return [(ids[a:b], mask[a:b].astype(bool)) for a, b in itertools.pairwise(offsets)]


def _trained(tokenizer, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    runs = np.split(np.arange(len(ids)), np.flatnonzero(np.diff(mask.astype(int))) + 1)
    return [tokenizer.decode(ids[run].tolist()) for run in runs if mask[run[0]]]


@pytest.mark.parametrize("fmt", list(ROWS))
def test_each_format_is_detected_and_converted(fmt, tmp_path):
    assert detect_format(ROWS[fmt], "x:1") == fmt
    assert to_messages(ROWS[fmt], fmt, "x:1") == MESSAGES[fmt]
    out = tmp_path / "out"
    assert _run([_write(tmp_path / "in.jsonl", [ROWS[fmt]])], out, "--val_fraction", "0") == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["format"] == fmt
    ((ids, mask),) = _examples(out, "train")
    gpt2, plain = get_tokenizer("gpt2"), load_chat_template("gpt2", "plain")
    assert gpt2.decode(ids.tolist()) == plain.render(MESSAGES[fmt])
    answers = [m["content"] + "<|endoftext|>" for m in MESSAGES[fmt] if m["role"] == "assistant"]
    assert _trained(gpt2, ids, mask) == answers


def test_alpaca_without_input_asks_the_instruction_alone():
    row = {"instruction": "Say hi.", "input": "", "output": "hi"}
    assert to_messages(row, "alpaca", "x")[0] == {"role": "user", "content": "Say hi."}


def test_rows_are_read_from_every_file_shape(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "in"
    _write(folder / "a.jsonl", [ROWS["messages"], ROWS["alpaca"]])
    (folder / "b.json").write_text(json.dumps([ROWS["sharegpt"]]))
    (folder / "c.jsonl.gz").write_bytes(gzip.compress(json.dumps(ROWS["alpaca"]).encode()))
    pq.write_table(pa.Table.from_pylist([ROWS["messages"]]), folder / "d.parquet")
    datasets.Dataset.from_list([ROWS["sharegpt"]]).save_to_disk(folder / "e")
    rows = list(read_chat_rows([str(folder)]))
    assert [where for where, _ in rows] == [
        f"{folder / 'a.jsonl'}:1",
        f"{folder / 'a.jsonl'}:2",
        f"{folder / 'b.json'} (record 1)",
        f"{folder / 'c.jsonl.gz'}:1",
        f"{folder / 'd.parquet'} (record 1)",
        f"{folder / 'e'} (record 1)",
    ]
    assert [row for _, row in rows] == [
        ROWS["messages"],
        ROWS["alpaca"],
        ROWS["sharegpt"],
        ROWS["alpaca"],
        ROWS["messages"],
        ROWS["sharegpt"],
    ]


def test_the_folder_decodes_to_the_rendered_conversations(tmp_path):
    rows = [_conversation(n) for n in range(12)]
    out = tmp_path / "out"
    assert _run([_write(tmp_path / "in.jsonl", rows)], out, "--val_examples", "3") == 0
    meta = json.loads((out / "meta.json").read_text())
    gpt2, plain = get_tokenizer("gpt2"), load_chat_template("gpt2", "plain")
    val = [json.loads(line)["messages"] for line in (out / "val.messages.jsonl").open()]
    train = [r["messages"] for r in rows if r["messages"] not in val]
    for split, conversations in (("train", train), ("val", val)):
        examples = _examples(out, split)
        assert len(examples) == len(conversations) == meta["splits"][split]["examples"]
        for (ids, mask), messages in zip(examples, conversations, strict=True):
            assert gpt2.decode(ids.tolist()) == plain.render(messages)
            assert _trained(gpt2, ids, mask) == [messages[1]["content"] + "<|endoftext|>"]
    counts = {}
    for split in ("train", "val"):
        examples = _examples(out, split)
        counts[split] = {
            "examples": len(examples),
            "tokens": sum(len(ids) for ids, _ in examples),
            "targets": sum(int(mask.sum()) for _, mask in examples),
            "truncated": 0,
            "dropped": 0,
        }
    assert meta == {
        "kind": "chat",
        "version": 1,
        "tokenizer": "gpt2",
        "vocab_size": 50257,
        "seq_len": 2048,
        "pack": True,
        "truncate": "right",
        "train_on": "assistant",
        "format": "messages",
        "template": {"origin": "plain", "sha256": plain.sha256},
        "eos_id": 50256,
        "pad_id": 50256,
        "stop_ids": [50256],
        "inputs": [str(tmp_path / "in.jsonl")],
        "splits": counts,
    }


def test_show_prints_the_trained_text_marked_then_ids_and_mask(tmp_path, capsys):
    out = tmp_path / "out"
    rows = [ROWS["messages"], {"messages": MESSAGES["alpaca"]}, ROWS["messages"]]
    path = _write(tmp_path / "in.jsonl", rows)
    assert _run([path], out, "--val_fraction", "0", "--show", "2") == 0
    lines = capsys.readouterr().out.split("\n")
    assert lines[0] == "trained tokens are shown between ⟦ and ⟧"
    records = [json.loads(line) for line in lines if line.startswith('{"ids"')]
    assert len(records) == 2
    for record, (ids, mask) in zip(records, _examples(out, "train"), strict=False):
        assert (record["ids"], record["mask"]) == (ids.tolist(), mask.astype(int).tolist())
    assert f"--- {path}:2 (train): {len(records[1]['ids'])} tokens, 2 trained" in lines
    assert f"--- {path}:3 (train)" not in "\n".join(lines)
    text = "\n".join(lines)
    assert "<|assistant|>\n⟦Hello!<|endoftext|>⟧\n<|user|>\n2 + 2?" in text
    assert "<|assistant|>\n⟦chat<|endoftext|>⟧\n" in text


def test_truncation_is_counted(tmp_path, capsys):
    long_answer = {"prompt": "Count.", "response": " ".join(["one"] * 60)}
    long_prompt = {"prompt": " ".join(["why"] * 60), "response": "Because."}
    rows = [ROWS["prompt_response"], long_answer, long_prompt]
    path = _write(tmp_path / "in.jsonl", rows)
    encoder = ChatEncoder(get_tokenizer("gpt2"), load_chat_template("gpt2", "plain"))
    prompt = len(encoder.encode_prompt([{"role": "user", "content": "Count."}]))
    counts = {}
    for truncate in ("right", "drop"):
        out = tmp_path / truncate
        assert _run([path], out, "--seq_len", "40", "--truncate", truncate) == 0
        meta = json.loads((out / "meta.json").read_text())
        both = [meta["splits"][s] for s in ("train", "val")]
        counts[truncate] = {k: sum(split[k] for split in both) for k in both[0] if k != "tokens"}
        assert all(len(ids) <= 40 for ids, _ in _examples(out, "train"))
    assert counts == {
        "right": {"examples": 2, "targets": 3 + 40 - prompt, "truncated": 1, "dropped": 1},
        "drop": {"examples": 1, "targets": 3, "truncated": 0, "dropped": 2},  # Paris . EOS
    }


def test_the_held_out_split_does_not_depend_on_the_rows_order(tmp_path):
    rows = [_conversation(n) for n in range(40)]
    held = {}
    for name, order in (("forward", rows), ("backward", rows[::-1])):
        for flag, value in (("--val_fraction", "0.3"), ("--val_examples", "5")):
            out = tmp_path / f"{name}{flag}"
            path = _write(tmp_path / f"{name}.jsonl", order)
            assert _run([path], out, flag, value, "--seed", "3") == 0
            lines = (out / "val.messages.jsonl").read_text().splitlines()
            held[name, flag] = sorted(lines)
    assert held["forward", "--val_fraction"] == held["backward", "--val_fraction"]
    assert 0 < len(held["forward", "--val_fraction"]) < 40
    assert held["forward", "--val_examples"] == held["backward", "--val_examples"]
    assert len(held["forward", "--val_examples"]) == 5


def _last_error(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def _gemma() -> str:
    return str(fetch_asset("chat-templates") / "google-gemma-2-2b-it.jinja")


def _bad_template(tmp_path: Path) -> str:
    path = tmp_path / "halve.jinja"
    path.write_text("{% for m in messages %}{{ m.content / 2 }}{% endfor %}")
    return str(path)


ASKING = [{"role": "user", "content": "Hi"}]
ANSWERED = [*ASKING, {"role": "assistant", "content": "Hello"}]
# (rows, options, the error, rows and options that fix it)
ERRORS = {
    "missing field": (
        [{"prompt": "p"}],
        [],
        "in.jsonl:1: no 'response' field (found ['prompt']), which a prompt_response row needs;"
        " add it, or name the row's format with --format",
        ([{"prompt": "p", "response": "r"}], []),
    ),
    "unknown role": (
        [{"messages": [{"role": "tool", "content": "42"}, *ANSWERED]}],
        [],
        "in.jsonl:1: message 1 has the role 'tool'; chat data holds system, user and"
        " assistant messages: rename or drop it",
        ([{"messages": [{"role": "user", "content": "42"}, *ANSWERED]}], []),
    ),
    "role the template refuses": (
        [{"messages": [SYSTEM, *ANSWERED]}],
        ["--template", _gemma, "--train_on", "all"],
        "in.jsonl:1: the chat template ({gemma}) failed on the conversation: System role not"
        " supported",
        ([{"messages": ANSWERED}], ["--template", _gemma, "--train_on", "all"]),
    ),
    "no answer": (
        [{"messages": ASKING}],
        [],
        "in.jsonl:1: the conversation ends with a user message, not an assistant's, so"
        " train_on=assistant has no answer to train on; end it with the assistant's answer,"
        " or pass --train_on all",
        ([{"messages": ASKING}], ["--train_on", "all"]),
    ),
    "template fails": (
        [{"messages": ANSWERED}],
        ["--template", _bad_template],
        "in.jsonl:1: the chat template ({template}) failed on the conversation: TypeError:"
        " unsupported operand type(s) for /: 'str' and 'int'",
        ([{"messages": ANSWERED}], []),
    ),
    "too long": (
        [
            {"messages": ANSWERED},
            {"messages": [*ASKING, {"role": "assistant", "content": "a " * 50}]},
        ],
        ["--truncate", "error", "--seq_len", "30"],
        "in.jsonl:2: 68 tokens, over --seq_len 30; raise --seq_len, or pass --truncate right"
        " (cut its end) or --truncate drop",
        (None, ["--truncate", "right", "--seq_len", "30"]),
    ),
    "no template": (
        [{"messages": ANSWERED}],
        ["--template", None],
        "plugintrain prepare chat: error: tokenizer gpt2 has no chat template; pass --template"
        " FILE, or --template plain for a base model",
        (None, ["--template", "plain"]),
    ),
}


def _options(options: list, tmp_path: Path) -> tuple[list[str], str | None]:
    """Command-line options (callables made into paths), and the template among them."""
    values = [o(tmp_path) if o is _bad_template else o() if callable(o) else o for o in options]
    template = "plain"
    if "--template" in values:
        at = values.index("--template")
        template = values[at + 1]
        values = values[:at] + values[at + 2 :]
    return values, template


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_is_one_line_leaves_nothing_and_the_fix_works(case, tmp_path, capsys):
    rows, options, message, (fixed_rows, fix) = ERRORS[case]
    path = _write(tmp_path / "in.jsonl", rows)
    extra, template = _options(options, tmp_path)
    out = tmp_path / "out"
    assert _run([path], out, *extra, template=template) == 2
    expected = message.replace("in.jsonl", str(path))
    expected = expected.format(gemma=_gemma(), template=tmp_path / "halve.jinja")
    assert expected in _last_error(capsys)
    assert not out.exists() and not list(tmp_path.glob("out*"))
    if fixed_rows is not None:
        _write(path, fixed_rows)
    extra, template = _options(fix, tmp_path)
    assert _run([path], out, *extra, template=template) == 0


def test_a_text_folder_is_no_chat_folder_and_back(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("Some text to prepare.")
    text, chat = tmp_path / "text", tmp_path / "chat"
    argv = ["text", str(tmp_path / "a.txt"), "--tokenizer", "gpt2", "--quiet", "--num_proc", "1"]
    assert prepare_main([*argv, "--out", str(text)]) == 0
    before = sorted(p.name for p in text.iterdir())
    rows = _write(tmp_path / "in.jsonl", [{"messages": ANSWERED}])
    assert _run([rows], text, "--overwrite") == 2
    assert _last_error(capsys).startswith(
        f"plugintrain prepare chat: error: --out {text}: holds text prepared by `plugintrain"
        " prepare text`; write chat data to a folder of its own"
    )
    assert sorted(p.name for p in text.iterdir()) == before
    assert _run([rows], chat) == 0
    assert prepare_main([*argv, "--out", str(chat), "--overwrite"]) == 2
    assert _last_error(capsys).startswith(
        f"plugintrain prepare text: error: --out {chat}: holds chat data prepared by `plugintrain"
        " prepare chat`; write text to a folder of its own"
    )
    assert json.loads((chat / "meta.json").read_text())["kind"] == "chat"


def test_nothing_already_in_out_is_lost(tmp_path, capsys):
    rows = _write(tmp_path / "in.jsonl", [{"messages": ANSWERED}])
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert _run([rows], out, "--overwrite") == 2
    assert "is not empty and holds no chat data" in _last_error(capsys)
    (out / "notes.txt").unlink()
    assert _run([rows], out) == 0  # an empty folder is taken
    assert _run([rows], out, "--seq_len", "100") == 2
    assert "holds chat data already; add --overwrite to rebuild it" in _last_error(capsys)
    assert _run([rows], out, "--seq_len", "100", "--overwrite") == 0
    assert json.loads((out / "meta.json").read_text())["seq_len"] == 100
    (out / "notes.txt").write_text("mine")
    assert _run([rows], out, "--overwrite") == 2
    assert "holds chat data and other files (notes.txt)" in _last_error(capsys)
    assert (out / "notes.txt").read_text() == "mine"


def test_pack_is_recorded_and_spelled_out(tmp_path, capsys):
    rows = _write(tmp_path / "in.jsonl", [{"messages": ANSWERED}])
    assert _run([rows], tmp_path / "out", "--pack", "false") == 0
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["pack"] is False
    assert _run([rows], tmp_path / "other", "--pack", "maybe") == 2
    assert "--pack maybe: expected a bool" in _last_error(capsys)
    assert not (tmp_path / "other").exists()


def test_format_errors_name_the_row():
    with pytest.raises(ChatDataError, match=r"^x:3: no conversation \(found \['text'\]\)"):
        detect_format({"text": "plain"}, "x:3")
    with pytest.raises(ChatDataError, match="x:1: conversation turn 1 is from 'bot'"):
        to_messages({"conversations": [{"from": "bot", "value": "?"}]}, "sharegpt", "x:1")


def test_an_out_inside_the_input_folder_is_not_read(tmp_path):
    folder = tmp_path / "data"
    _write(folder / "in.jsonl", [_conversation(n) for n in range(6)])
    out = folder / "chat"
    for again in ([], ["--overwrite"]):
        assert _run([folder], out, "--val_examples", "2", *again) == 0
        meta = json.loads((out / "meta.json").read_text())
        assert [meta["splits"][s]["examples"] for s in ("train", "val")] == [4, 2]
