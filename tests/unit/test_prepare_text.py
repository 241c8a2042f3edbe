"""``plugintrain prepare text``: the user's documents in every supported shape, tokenized as
the tokenizer library itself encodes them plus the documented boundary tokens, the same
shards however the work is split, atomic and resumable, and one-line errors that leave
nothing behind."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest
import tiktoken

from plugintrain.cli import main as cli_main
from plugintrain.data import get_tokenizer, read_token_bin
from plugintrain.data.prepare.corpus import PrepareOptions, prepare_text

DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé: naïve café, 東京, emoji 🦊 and <|endoftext|> as plain text.",
    "Line one\nLine two\n\n  indented line\ttab",
    "Short.",
    "A longer document. " * 40,
    "Numbers 12345 and 3.14159; code: def f(x): return x**2",
]


def prepare_main(argv: list[str]) -> int:
    return cli_main(["prepare", *argv])


def _corpus(root: Path) -> list[str]:
    """The documents above in every input shape, in the order ``prepare text`` reads them
    (INPUT ``root``: its files sorted by relative path)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    root.mkdir(parents=True, exist_ok=True)
    (root / "a.txt").write_text(DOCS[0], encoding="utf-8")
    (root / "b.md.gz").write_bytes(gzip.compress(DOCS[1].encode()))
    lines = [json.dumps({"text": DOCS[2], "id": 1}), "", json.dumps({"text": DOCS[3]})]
    (root / "c.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (root / "d.json").write_text(json.dumps([{"text": DOCS[4]}]), encoding="utf-8")
    pq.write_table(pa.table({"text": [DOCS[5]], "n": [5]}), root / "e.parquet")
    compressed = zstandard.ZstdCompressor().compress(json.dumps({"text": DOCS[0]}).encode())
    (root / "f.jsonl.zst").write_bytes(compressed)
    (root / "skipped.bin").write_bytes(b"\x00\x01")  # not a known suffix: a folder walk skips it
    return [DOCS[0], DOCS[1], DOCS[2], DOCS[3], DOCS[4], DOCS[5], DOCS[0]]


def _tokens(out: Path, split: str = "train") -> np.ndarray:
    meta = json.loads((out / "meta.json").read_text())
    shards = [read_token_bin(out / s["file"]) for s in meta["splits"][split]["shards"]]
    return np.concatenate(shards).astype(np.int64) if shards else np.zeros(0, np.int64)


def _run(inputs, out, tokenizer="gpt2", **kwargs) -> dict:
    run = {k: kwargs.pop(k) for k in ("num_proc", "num_tasks", "task_index") if k in kwargs}
    options = PrepareOptions(tokenizer=tokenizer, **{"val_fraction": 0.0, **kwargs})
    return prepare_text([str(i) for i in inputs], out, options, progress=False, **run)


def _reference(name: str) -> tiktoken.Encoding:
    """tiktoken's own encoding over the same rank file (the library, not our wrapper)."""
    ours = get_tokenizer(name).encoding
    return tiktoken.Encoding(
        name,
        pat_str=ours._pat_str,
        mergeable_ranks=ours._mergeable_ranks,
        special_tokens=ours._special_tokens,
    )


@pytest.mark.parametrize(("name", "bos"), [("gpt2", None), ("llama3", 128000)])
def test_tokens_are_the_library_s_encoding_with_the_family_s_boundaries(tmp_path, name, bos):
    docs = _corpus(tmp_path / "in")
    meta = _run([tmp_path / "in"], tmp_path / "out", name, num_proc=1)
    reference = _reference(name)
    eos = reference.encode_single_token("<|endoftext|>" if name == "gpt2" else "<|end_of_text|>")
    expected = []
    for doc in docs:
        expected += ([bos] if bos is not None else []) + reference.encode_ordinary(doc) + [eos]
    assert _tokens(tmp_path / "out").tolist() == expected
    assert meta["add_bos"] is (bos is not None) and meta["eos_id"] == eos
    assert meta["splits"]["train"]["documents"] == len(docs)
    assert meta["splits"]["train"]["text_bytes"] == sum(len(d.encode()) for d in docs)
    # Bits per byte count the source text's bytes: the ids' bytes add up to it exactly.
    token_bytes = np.load(tmp_path / "out" / "token_bytes.npy")
    assert token_bytes[_tokens(tmp_path / "out")].sum() == meta["splits"]["train"]["text_bytes"]


def test_a_separator_splits_text_files_into_documents(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "book.txt").write_text("one\n\n\ntwo\n\n\n\n\nthree", encoding="utf-8")
    _run([tmp_path / "in"], tmp_path / "out", read=_read(separator="\n\n\n"), num_proc=1)
    reference = _reference("gpt2")
    expected = []
    for doc in ["one", "two", "\n\nthree"]:
        expected += [*reference.encode_ordinary(doc), 50256]
    assert _tokens(tmp_path / "out").tolist() == expected


def _read(**kwargs):
    from plugintrain.data.prepare.text_sources import ReadOptions

    return ReadOptions(**kwargs)


def test_datasets_save_to_disk_and_a_local_dataset_through_load_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"body": DOCS[:3]}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "hub").mkdir()
    rows = "\n".join(json.dumps({"body": d}) for d in DOCS[3:5])
    (tmp_path / "hub" / "train.jsonl").write_text(rows + "\n")
    read = _read(text_field="body")
    _run([tmp_path / "saved", f"hf:{tmp_path / 'hub'}"], tmp_path / "out", read=read, num_proc=1)
    reference = _reference("gpt2")
    expected = [t for d in DOCS[:5] for t in [*reference.encode_ordinary(d), 50256]]
    assert _tokens(tmp_path / "out").tolist() == expected


def test_two_processes_and_three_merged_tasks_write_the_same_shards(tmp_path):
    """Small shards and groups (``shard_tokens=8``: a group per ~32 bytes) so the tasks
    really split the files; held-out documents too."""
    _corpus(tmp_path / "in")
    common = {"shard_tokens": 8, "val_docs": 2}
    one = _run([tmp_path / "in"], tmp_path / "one", num_proc=1, **common)
    two = _run([tmp_path / "in"], tmp_path / "two", num_proc=2, **common)
    tasks = [tmp_path / f"task{i}" for i in range(3)]
    for i, task in enumerate(tasks):
        _run([tmp_path / "in"], task, num_tasks=3, task_index=i, num_proc=1, **common)
    assert prepare_main(["merge", *map(str, tasks), "--out", str(tmp_path / "merged")]) == 0
    merged = json.loads((tmp_path / "merged" / "meta.json").read_text())
    assert len(one["splits"]["train"]["shards"]) >= 5
    assert all(json.loads((t / "meta.json").read_text())["groups"] for t in tasks)
    for split in ("train", "val"):
        files = [
            [(root / s["file"]).read_bytes() for s in meta["splits"][split]["shards"]]
            for root, meta in (
                (tmp_path / "one", one),
                (tmp_path / "two", two),
                (tmp_path / "merged", merged),
            )
        ]
        assert files[0] == files[1] == files[2]
    assert one["splits"]["val"]["documents"] == 2


def test_the_held_out_split_is_by_document_and_seeded(tmp_path):
    (tmp_path / "in").mkdir()
    for i in range(200):
        (tmp_path / "in" / f"{i:03d}.txt").write_text(f"document number {i}")
    a = _run([tmp_path / "in"], tmp_path / "a", val_fraction=0.1, num_proc=1)
    _run([tmp_path / "in"], tmp_path / "b", val_fraction=0.1, seed=1, num_proc=1)
    held = a["splits"]["val"]["documents"]
    assert 8 <= held <= 35  # 200 documents at 10%
    assert a["splits"]["train"]["documents"] + held == 200
    assert not np.array_equal(_tokens(tmp_path / "a", "val"), _tokens(tmp_path / "b", "val"))
    exact = _run([tmp_path / "in"], tmp_path / "c", val_docs=7, num_proc=1)
    assert exact["splits"]["val"]["documents"] == 7
    # Documents are whole on one side: every held-out document is framed by its EOS.
    val = _tokens(tmp_path / "c", "val")
    assert (val == 50256).sum() == 7 and val[-1] == 50256


def test_a_rerun_skips_finished_groups_and_redoes_the_rest(tmp_path):
    _corpus(tmp_path / "in")
    first = _run([tmp_path / "in"], tmp_path / "out", shard_tokens=8, num_proc=1)
    shards = [tmp_path / "out" / s["file"] for s in first["splits"]["train"]["shards"]]
    # A run killed in the middle: the last groups' records are gone, a shard was cut short
    # and an unfinished temporary file is left.
    records = sorted((tmp_path / "out" / "progress").glob("group_*.json"))
    for record in records[3:]:
        record.unlink()
    shards[-1].write_bytes(shards[-1].read_bytes()[:-2])
    (tmp_path / "out" / "train_000009.bin.abc.partial").write_bytes(b"half")
    (tmp_path / "out" / "meta.json").unlink()
    stamps = {p: p.stat().st_mtime_ns for p in shards}
    again = _run([tmp_path / "in"], tmp_path / "out", shard_tokens=8, num_proc=1)
    assert again["splits"] == first["splits"]
    kept = json.loads(records[0].read_text())["train"][0]["file"]
    assert (tmp_path / "out" / kept).stat().st_mtime_ns == stamps[tmp_path / "out" / kept]
    assert shards[-1].stat().st_mtime_ns != stamps[shards[-1]]
    assert not list((tmp_path / "out").glob("*.partial"))


def test_other_settings_are_refused_without_overwrite(tmp_path, capsys):
    _corpus(tmp_path / "in")
    args = ["text", str(tmp_path / "in"), "--tokenizer", "gpt2", "--out", str(tmp_path / "o")]
    assert prepare_main([*args, "--quiet", "--num_proc", "1"]) == 0
    before = (tmp_path / "o" / "meta.json").read_bytes()
    assert prepare_main([*args, "--quiet", "--num_proc", "1", "--seed", "5"]) == 2
    assert "seed differ" in capsys.readouterr().err.splitlines()[-1]
    assert (tmp_path / "o" / "meta.json").read_bytes() == before
    stale = tmp_path / "o" / "train_000007.bin"  # a shard of the old settings' run
    stale.write_bytes(b"old")
    assert prepare_main([*args, "--quiet", "--num_proc", "1", "--seed", "5", "--overwrite"]) == 0
    assert not stale.exists()


def _zst(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor().compress(data)


def _flipped(data: bytes) -> bytes:
    """A byte in the middle of a compressed stream changed."""
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :]


def _half(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _bad(tmp_path: Path, name: str, content: bytes) -> Path:
    (tmp_path / "in").mkdir(exist_ok=True)
    (tmp_path / "in" / name).write_bytes(content)
    return tmp_path / "in" / name


def _parquet_without_text(tmp_path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "in").mkdir(exist_ok=True)
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "in" / "p.parquet")
    return tmp_path / "in" / "p.parquet"


@pytest.mark.parametrize(
    ("make", "extra", "message"),
    [
        (lambda t: t / "nowhere", [], "nowhere: no such file or directory"),
        (lambda t: _bad(t, "e.txt", b""), [], "no document with text to train on"),
        (lambda t: _bad(t, "u.txt", b"ok \xff bad"), [], "not UTF-8 at byte 3"),
        (lambda t: _bad(t, "j.jsonl", b'{"text": "a"}\n{oops\n'), [], "j.jsonl:2: not JSON"),
        (
            lambda t: _bad(t, "f.jsonl", b'{"text": "a"}\n{"body": "b"}\n'),
            [],
            "f.jsonl:2: no 'text'",
        ),
        (_parquet_without_text, [], "no column 'text' (columns: body)"),
        (lambda t: _bad(t, "big.txt", b"x" * 2000), ["--max_doc_bytes", "1000"], "2000 bytes"),
        (lambda t: _bad(t, "a.txt", b"a"), ["--num_tasks", "2", "--task_index", "2"], "[0, 2)"),
        (lambda t: _bad(t, "a.txt", b"a"), ["--eos", "<|nope|>"], "not a special token"),
        (
            lambda t: _bad(
                t, "z.txt.zst", _half(_zst(b"".join(b"line %d\\n" % i for i in range(3000))))
            ),
            [],
            "ends early",
        ),
        (lambda t: _bad(t, "y.txt.zst", b"not zstd at all"), [], "not a whole zstd file"),
        (lambda t: _bad(t, "arr.json", b'["a", "b"]'), [], "arr.json (record 1): no 'text'"),
        (
            lambda t: _bad(t, "big.json", b'[{"text": "' + b"x" * 3000 + b'"}]'),
            ["--max_doc_bytes", "1000"],
            "a JSON array is read whole",
        ),
        (
            lambda t: _bad(t, "long.jsonl", b'{"text": "' + b"x" * 9000 + b'"}\n'),
            ["--max_doc_bytes", "1000"],
            "long.jsonl:1: a document of over",
        ),
        (
            lambda t: _bad(t, "s.txt", b"one\n\n\ntwo\n\n\n"),
            ["--separator", "\\n\\n\\n", "--val_docs", "2"],
            "holds 2 documents with text",
        ),
        (lambda t: _bad(t, "a.txt", b"a"), ["--shard_tokens", str(2**31)], "--shard_tokens"),
        (
            lambda t: _bad(t, "g.txt.gz", _flipped(gzip.compress(DOCS[4].encode() * 20))),
            [],
            "g.txt.gz: cannot read it",
        ),
        (
            lambda t: _bad(t, "h.json.gz", _half(gzip.compress(b'[{"text": "x"}]' * 50))),
            [],
            "h.json.gz: cannot read it",
        ),
    ],
)
def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, capsys, make, extra, message):
    path = make(tmp_path)
    out = tmp_path / "out"
    argv = ["text", str(path), "--tokenizer", "gpt2", "--out", str(out), "--quiet", *extra]
    assert prepare_main([*argv, "--num_proc", "1"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in last, last
    assert not out.exists()


def test_errors_replace_reads_bad_bytes_as_replacement_characters(tmp_path, capsys):
    path = _bad(tmp_path, "u.txt", b"ok \xff bad")
    out = tmp_path / "out"
    argv = ["text", str(path), "--tokenizer", "gpt2", "--out", str(out), "--quiet"]
    assert prepare_main([*argv, "--num_proc", "1", "--errors", "replace"]) == 0
    expected = [*_reference("gpt2").encode_ordinary("ok \ufffd bad"), 50256]
    assert _tokens(out).tolist() == expected


def test_the_fix_for_a_missing_field_works(tmp_path):
    path = _bad(tmp_path, "f.jsonl", b'{"body": "b"}\n')
    out = tmp_path / "out"
    argv = ["text", str(path), "--tokenizer", "gpt2", "--out", str(out), "--quiet"]
    assert prepare_main([*argv, "--num_proc", "1", "--text_field", "body"]) == 0


def test_the_command_line_prints_a_summary_and_records_the_command(tmp_path, capsys):
    _corpus(tmp_path / "in")
    out = tmp_path / "out"
    argv = ["text", str(tmp_path / "in"), "--tokenizer", "gpt2", "--out", str(out)]
    assert prepare_main([*argv, "--num_proc", "2", "--val_docs", "1"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["splits"]["val"]["documents"] == 1
    assert "documents" in captured.err and "tokens/s" in captured.err  # the progress line
    meta = json.loads((out / "meta.json").read_text())
    assert meta["command"].startswith("plugintrain prepare text ")
    for shard in meta["splits"]["train"]["shards"]:
        import hashlib

        assert hashlib.sha256((out / shard["file"]).read_bytes()).hexdigest() == shard["sha256"]
    assert (out / "token_bytes.npy").is_file()
    assert os.listdir(out / "progress")


def test_bad_input_into_an_existing_empty_folder_leaves_it_empty_and_the_fix_works(
    tmp_path, capsys
):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("good text " * 50)  # its own group
    (tmp_path / "in" / "b.txt").write_bytes(b"ok \xff bad")
    out = tmp_path / "out"
    out.mkdir()  # made beforehand, as a job script does
    argv = ["text", str(tmp_path / "in"), "--tokenizer", "gpt2", "--out", str(out), "--quiet"]
    argv += ["--num_proc", "1", "--shard_tokens", "8"]
    assert prepare_main(argv) == 2
    assert "not UTF-8 at byte 3" in capsys.readouterr().err.splitlines()[-1]
    assert out.is_dir() and not list(out.iterdir())
    assert prepare_main([*argv, "--errors", "replace"]) == 0


def test_a_bad_rerun_with_overwrite_keeps_the_prepared_folder(tmp_path, capsys):
    _corpus(tmp_path / "in")
    argv = ["text", str(tmp_path / "in"), "--tokenizer", "gpt2", "--out", str(tmp_path / "o")]
    argv += ["--quiet", "--num_proc", "1"]
    assert prepare_main(argv) == 0
    before = sorted((p.name, p.read_bytes()) for p in (tmp_path / "o").glob("*") if p.is_file())
    assert prepare_main([*argv, "--overwrite", "--val_docs", "1000"]) == 2
    assert "holds 7 documents with text" in capsys.readouterr().err.splitlines()[-1]
    after = sorted((p.name, p.read_bytes()) for p in (tmp_path / "o").glob("*") if p.is_file())
    assert after == before


def test_lone_surrogates_are_encoded_as_tiktoken_encodes_them(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "s.jsonl").write_text('{"text": "a\\ud800b"}\n')
    _run([tmp_path / "in"], tmp_path / "out", num_proc=2)
    expected = [*_reference("gpt2").encode_ordinary("a\ud800b"), 50256]
    assert _tokens(tmp_path / "out").tolist() == expected


def test_val_docs_counts_only_documents_with_text(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "s.txt").write_text("one\n\n\n\n\n\ntwo\n\n\nthree\n\n\n")
    (tmp_path / "in" / "empty.txt").write_text("")
    read = _read(separator="\n\n\n")
    for seed in range(6):
        meta = _run(
            [tmp_path / "in"], tmp_path / f"o{seed}", read=read, val_docs=2, seed=seed, num_proc=1
        )
        assert (meta["splits"]["val"]["documents"], meta["splits"]["train"]["documents"]) == (2, 1)


def test_same_names_in_two_folders_are_two_files_and_the_output_is_never_read(tmp_path):
    for name, text in (("a", "alpha text"), ("b", "beta text")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "part.txt").write_text(text)
    out = tmp_path / "a" / "prepared"  # inside an INPUT, and prepared twice
    for _ in range(2):
        meta = _run([tmp_path / "a", tmp_path / "b"], out, num_proc=1)
        assert meta["splits"]["train"]["documents"] == 2
    assert [s[0] for s in meta["settings"]["sources"]] == ["a/part.txt", "b/part.txt"]


def test_a_separator_outside_ascii_is_taken_as_typed(tmp_path):
    path = _bad(tmp_path, "s.txt", "one§§two§§three".encode())
    out = tmp_path / "out"
    argv = ["text", str(path), "--tokenizer", "gpt2", "--out", str(out), "--quiet"]
    assert prepare_main([*argv, "--num_proc", "1", "--separator", "§§"]) == 0
    assert json.loads((out / "meta.json").read_text())["splits"]["train"]["documents"] == 3


def test_merge_refuses_to_write_into_a_task_s_folder(tmp_path, capsys):
    _corpus(tmp_path / "in")
    tasks = [tmp_path / f"task{i}" for i in range(2)]
    for i, task in enumerate(tasks):
        _run([tmp_path / "in"], task, num_tasks=2, task_index=i, num_proc=1, shard_tokens=8)
    before = (tasks[1] / "meta.json").read_bytes()
    assert prepare_main(["merge", *map(str, tasks), "--out", str(tasks[1])]) == 2
    assert "is one of the tasks' folders" in capsys.readouterr().err.splitlines()[-1]
    assert (tasks[1] / "meta.json").read_bytes() == before


def test_lone_surrogates_through_the_tokenizers_library(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "s.jsonl").write_text('{"text": "a\\ud800b"}\n')
    _run([tmp_path / "in"], tmp_path / "out", tokenizer="smollm2-135m", num_proc=1)
    expected = [*get_tokenizer("smollm2-135m").encode("a\ufffdb"), 2]
    assert _tokens(tmp_path / "out").tolist() == expected


def test_an_input_folder_is_not_also_the_output(tmp_path, capsys):
    _corpus(tmp_path / "in")
    argv = ["text", str(tmp_path / "in"), "--tokenizer", "gpt2", "--out", str(tmp_path / "in")]
    assert prepare_main([*argv, "--quiet", "--overwrite"]) == 2
    assert "is also --out" in capsys.readouterr().err.splitlines()[-1]
