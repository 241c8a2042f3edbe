"""`plugintrain evaluate`: losses against plain ``F.cross_entropy`` on the model's logits,
one window or example at a time; answers scored against references the test controls;
the JSON it writes; and the one-line errors for data it cannot read.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from plugintrain.model_zoo import TransformerConfig
from plugintrain.model_zoo.generation import PretrainedLM

TOKENIZER = "smollm2-135m"
KEYS = {
    "weights", "adapter", "data", "split", "examples", "tokens", "loss", "perplexity",
    "bits_per_byte", "exact_match", "contains", "preference_accuracy", "reward_margin",
    "reference_accuracy",
}  # fmt: skip


def _encoder():
    from plugintrain.data import get_tokenizer
    from plugintrain.data.tokenizers.chat_templates import ChatEncoder, load_chat_template

    return ChatEncoder(get_tokenizer(TOKENIZER), load_chat_template(TOKENIZER))


def _text_model() -> PretrainedLM:
    torch.manual_seed(0)
    config = TransformerConfig.from_name("gpt2-debug", vocab_size=64, block_size=16, n_layer=1)
    return PretrainedLM(config).eval()


def _chat_model(block_size: int = 256) -> PretrainedLM:
    torch.manual_seed(0)
    config = TransformerConfig.from_name(
        "llama3-debug",
        vocab_size=49152,
        block_size=block_size,
        n_layer=1,
        tokenizer=TOKENIZER,
        init_std=0.2,  # spread logits: greedy answers of varied tokens
    )
    return PretrainedLM(config).eval()


def _evaluate(monkeypatch, tmp_path, lm, data: Path, *options: str, status: int = 0) -> None:
    """Run `plugintrain evaluate` on ``lm`` (or on what a loader function returns); it must
    exit with ``status``."""
    from plugintrain.cli import main
    from plugintrain.tools import _models

    load = lm if not isinstance(lm, torch.nn.Module) else lambda path: lm
    monkeypatch.setattr(_models, "load_causal_lm", load)
    (tmp_path / "last.ckpt").write_bytes(b"stands for the model above")
    args = [f"--weights={tmp_path / 'last.ckpt'}", f"--data={data}", "--device=cpu"]
    assert main(["evaluate", *args, *options]) == status


def _run_json(monkeypatch, tmp_path, capsys, lm, data: Path, *options: str) -> dict:
    """Run `plugintrain evaluate --json -` on ``lm``; the JSON it prints."""
    _evaluate(monkeypatch, tmp_path, lm, data, "--json=-", *options)
    return json.loads(capsys.readouterr().out)


# ---- text folders ----------------------------------------------------------------------------


def _llmc_folder(folder: Path, tokens: np.ndarray, token_bytes: np.ndarray) -> Path:
    from plugintrain.data import write_token_bin, write_token_bytes

    folder.mkdir()
    write_token_bin(folder / "train.bin", tokens[::-1].copy())
    write_token_bin(folder / "val.bin", tokens)
    write_token_bytes(folder, token_bytes)
    return folder


def _shards_folder(folder: Path, tokens: np.ndarray, token_bytes: np.ndarray) -> Path:
    """The layout of `plugintrain prepare text`: meta.json lists each split's shards."""
    from plugintrain.data import write_token_bin, write_token_bytes
    from plugintrain.data.datamodules.token_shards import TEXT_SHARDS_FORMAT

    folder.mkdir()
    half = len(tokens) // 2
    shards = {"val_000.bin": tokens[:half], "val_001.bin": tokens[half:], "train_000.bin": tokens}
    for name, part in shards.items():
        write_token_bin(folder / name, part)
    splits = {
        split: {"shards": [{"file": name} for name in shards if name.startswith(split)]}
        for split in ("train", "val")
    }
    meta = {"format": TEXT_SHARDS_FORMAT, "splits": splits}
    (folder / "meta.json").write_text(json.dumps(meta))
    write_token_bytes(folder, token_bytes)
    return folder


@torch.no_grad()
def _window_losses(lm: PretrainedLM, tokens: np.ndarray, seq_len: int, token_bytes: np.ndarray):
    """Summed NLL, targets and their bytes over the whole windows, one window at a time."""
    ids = torch.from_numpy(tokens.astype(np.int64))
    nll, targets, nbytes = 0.0, 0, 0
    for start in range(0, (len(ids) - 1) // seq_len * seq_len, seq_len):
        x, y = ids[start : start + seq_len], ids[start + 1 : start + seq_len + 1]
        nll += float(F.cross_entropy(lm.model(x[None])[0], y, reduction="sum"))
        targets += len(y)
        nbytes += int(token_bytes[y.numpy()].sum())
    return nll, targets, nbytes


@pytest.mark.parametrize("layout", [_llmc_folder, _shards_folder], ids=["llm.c", "prepare-text"])
@pytest.mark.parametrize("seq_len", [None, 8])
def test_text_loss_perplexity_and_bits_per_byte(monkeypatch, tmp_path, capsys, layout, seq_len):
    lm = _text_model()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, 203).astype(np.uint16)
    token_bytes = rng.integers(1, 5, 64).astype(np.int32)
    data = layout(tmp_path / "data", tokens, token_bytes)
    options = ["--batch_size=4", *([f"--seq_len={seq_len}"] if seq_len else [])]
    results = _run_json(monkeypatch, tmp_path, capsys, lm, data, *options)
    nll, targets, nbytes = _window_losses(lm, tokens, seq_len or 16, token_bytes)
    assert results["tokens"] == targets and results["examples"] == targets // (seq_len or 16)
    assert results["loss"] == pytest.approx(nll / targets, rel=1e-5)
    assert results["perplexity"] == pytest.approx(math.exp(nll / targets), rel=1e-5)
    assert results["bits_per_byte"] == pytest.approx(nll / (math.log(2) * nbytes), rel=1e-5)
    assert results["split"] == "val" and results["exact_match"] is None


def test_limit_and_split_pick_the_windows(monkeypatch, tmp_path, capsys):
    lm = _text_model()
    tokens = np.random.default_rng(1).integers(0, 64, 203).astype(np.uint16)
    data = _llmc_folder(tmp_path / "data", tokens, np.ones(64, np.int32))
    results = _run_json(monkeypatch, tmp_path, capsys, lm, data, "--split=train", "--limit=3")
    nll, targets, _ = _window_losses(lm, tokens[::-1].copy()[: 3 * 16 + 1], 16, np.ones(64))
    assert results["examples"] == 3 and results["tokens"] == targets == 48
    assert results["loss"] == pytest.approx(nll / targets, rel=1e-5)


# ---- chat folders and files ----------------------------------------------------------------


def _chat_folder(folder: Path, examples: list[tuple[np.ndarray, np.ndarray]], **meta) -> Path:
    """The layout of `plugintrain prepare chat` (its val split)."""
    folder.mkdir()
    lengths = [len(ids) for ids, _ in examples]
    np.save(folder / "val.ids.npy", np.concatenate([ids for ids, _ in examples]).astype(np.uint32))
    np.save(folder / "val.mask.npy", np.concatenate([m for _, m in examples]).astype(np.uint8))
    np.save(folder / "val.offsets.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    meta = {"kind": "chat", "tokenizer": TOKENIZER, "vocab_size": 49152, "seq_len": 256, **meta}
    meta["splits"] = {"val": {"examples": len(examples)}}
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder


@torch.no_grad()
def _masked_losses(lm: PretrainedLM, examples) -> tuple[float, int]:
    """Summed NLL and number of the targets each example trains on, one example at a time."""
    nll, targets = 0.0, 0
    for ids, mask in examples:
        ids = torch.from_numpy(ids.astype(np.int64))
        per_token = F.cross_entropy(lm.model(ids[None, :-1])[0], ids[1:], reduction="none")
        scored = torch.from_numpy(mask[1:].astype(bool))
        nll += float(per_token[scored].sum())
        targets += int(scored.sum())
    return nll, targets


def test_chat_folder_loss_counts_only_the_target_tokens(monkeypatch, tmp_path, capsys):
    lm = _chat_model()
    rng = np.random.default_rng(0)
    examples = []
    for length in (9, 30, 17, 5, 24):  # rows of a batch padded on the right
        mask = np.zeros(length, bool)
        mask[rng.integers(1, length - 1) :] = True  # the answer: the last tokens
        examples.append((rng.integers(0, 49152, length), mask))
    data = _chat_folder(tmp_path / "chat", examples)
    results = _run_json(monkeypatch, tmp_path, capsys, lm, data, "--batch_size=2")
    nll, targets = _masked_losses(lm, examples)
    assert results["examples"] == 5 and results["tokens"] == targets
    assert results["loss"] == pytest.approx(nll / targets, rel=1e-5)
    assert results["perplexity"] == pytest.approx(math.exp(nll / targets), rel=1e-5)
    assert results["bits_per_byte"] is None and results["exact_match"] is None  # no answers


def _conversations(references: list[str]) -> list[dict]:
    return [
        {"messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": f"Question number {n}?"},
            {"role": "assistant", "content": reference},
        ]}
        for n, reference in enumerate(references)
    ]  # fmt: skip


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_answers_are_scored_by_exact_match_and_contains(monkeypatch, tmp_path, capsys):
    from plugintrain.data import get_tokenizer
    from plugintrain.model_zoo import generation

    references = ["Paris", " paris ", "4", "Rome", "blue whale"]
    given = ["Paris", "Paris.", "The answer is 4", "Milan", "  blue whale\n"]
    tokenizer, asked = get_tokenizer(TOKENIZER), {}

    def complete(model, prompts, max_new_tokens, stop_ids, batch_size, **sampling):
        asked.update(prompts=prompts, max_new_tokens=max_new_tokens, **sampling)
        return [tokenizer.encode(text) for text in given]

    monkeypatch.setattr(generation, "complete", complete)
    rows = _conversations(references)
    data = _write_jsonl(tmp_path / "qa.jsonl", rows)
    results = _run_json(monkeypatch, tmp_path, capsys, _chat_model(), data, "--max_new_tokens=7")
    assert results["exact_match"] == pytest.approx(2 / 5)  # Paris, blue whale
    assert results["contains"] == pytest.approx(4 / 5)  # and " paris " in "Paris.", 4
    expected = [_encoder().encode_prompt(row["messages"][:-1]) for row in rows]
    assert asked == {"prompts": expected, "max_new_tokens": 7, "temperature": 0.0}


@torch.no_grad()
def _greedy_answer(lm: PretrainedLM, prompt: list[int], steps: int, stop_ids) -> list[int]:
    idx, new = torch.tensor([prompt]), []
    for _ in range(steps):
        token = int(lm.model(idx)[0, -1].argmax())
        if token in stop_ids:
            break
        new.append(token)
        idx = torch.cat((idx, torch.tensor([[token]])), dim=1)
    return new


def test_a_reference_equal_to_the_greedy_answer_matches(monkeypatch, tmp_path, capsys):
    from plugintrain.data import get_tokenizer

    lm, encoder = _chat_model(), _encoder()
    rows = _conversations(["", "", ""])
    answers = [
        get_tokenizer(TOKENIZER).decode(
            _greedy_answer(lm, encoder.encode_prompt(row["messages"][:-1]), 6, encoder.stop_ids)
        )
        for row in rows
    ]
    assert all(answer.strip() for answer in answers)
    rows[0]["messages"][-1]["content"] = answers[0]  # the answer itself
    rows[1]["messages"][-1]["content"] = answers[1].strip()[:4]  # a part of it
    rows[2]["messages"][-1]["content"] = "not what it says"
    data = _write_jsonl(tmp_path / "qa.jsonl", rows)
    options = ["--max_new_tokens=6", "--batch_size=2"]
    results = _run_json(monkeypatch, tmp_path, capsys, lm, data, *options)
    assert results["exact_match"] == pytest.approx(1 / 3)
    assert results["contains"] == pytest.approx(2 / 3)


def test_chat_file_loss_is_on_the_reference_answer(monkeypatch, tmp_path, capsys):
    lm = _chat_model()
    rows = _conversations(["Paris is the capital.", "Four.", "I do not know."])
    data = _write_jsonl(tmp_path / "qa.jsonl", rows)
    results = _run_json(monkeypatch, tmp_path, capsys, lm, data, "--max_new_tokens=2")
    encoder = _encoder()
    examples = [encoder.encode(row["messages"], train_on="completion") for row in rows]
    nll, targets = _masked_losses(lm, examples)
    assert results["examples"] == 3 and results["tokens"] == targets > 0
    assert results["loss"] == pytest.approx(nll / targets, rel=1e-5)
    assert results["split"] is None


def test_chat_folder_answers_its_val_messages(monkeypatch, tmp_path, capsys):
    encoder = _encoder()
    rows = _conversations(["Yes.", "No.", "Maybe."])
    examples = [encoder.encode(row["messages"]) for row in rows]
    data = _chat_folder(tmp_path / "chat", examples)
    _write_jsonl(data / "val.messages.jsonl", rows)
    options = ["--limit=2", "--max_new_tokens=4"]
    results = _run_json(monkeypatch, tmp_path, capsys, _chat_model(), data, *options)
    assert results["examples"] == 2
    assert results["exact_match"] == 0.0 and results["contains"] == 0.0  # a random model


def test_answers_prompted_unlike_the_folder_are_noted(monkeypatch, tmp_path, capsys):
    rows = _conversations(["Yes."])
    template = {"origin": "an old template", "sha256": "0" * 64}
    data = _chat_folder(
        tmp_path / "chat", [_encoder().encode(rows[0]["messages"])], template=template
    )
    _write_jsonl(data / "val.messages.jsonl", rows)
    _evaluate(monkeypatch, tmp_path, _chat_model(), data, "--max_new_tokens=2")
    assert capsys.readouterr().err == (
        f"plugintrain evaluate: {data} was prepared with the chat template of an old template;"
        f" the answers are prompted with another ({_encoder().template.origin}); pass"
        " --template to choose\n"
    )


def test_a_folder_of_prepare_chat_is_read_as_it_was_written(monkeypatch, tmp_path, capsys):
    """`plugintrain prepare chat` writes the folder (in the plain template, which the
    model's tokenizer does not carry): the loss is on its masks, and the answers are
    prompted in the template it was prepared with."""
    from plugintrain.cli import main
    from plugintrain.data import get_tokenizer
    from plugintrain.data.tokenizers.chat_templates import ChatEncoder, load_chat_template
    from plugintrain.model_zoo import generation

    rows = _conversations([f"Answer {n}." for n in range(8)])
    source = _write_jsonl(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "chat"
    prepare = ["prepare", "chat", str(source), f"--tokenizer={TOKENIZER}", f"--out={out}"]
    assert main([*prepare, "--template=plain", "--val_examples=3", "--seq_len=64"]) == 0
    capsys.readouterr()
    asked = []
    real = generation.complete

    def complete(model, prompts, *args, **kwargs):
        asked.append(prompts)
        return real(model, prompts, *args, **kwargs)

    monkeypatch.setattr(generation, "complete", complete)
    lm = _chat_model()
    results = _run_json(monkeypatch, tmp_path, capsys, lm, out, "--max_new_tokens=3")
    ids, mask = np.load(out / "val.ids.npy"), np.load(out / "val.mask.npy")
    offsets = np.load(out / "val.offsets.npy")
    examples = [(ids[a:b], mask[a:b].astype(bool)) for a, b in itertools.pairwise(offsets)]
    nll, targets = _masked_losses(lm, examples)
    assert results["examples"] == 3 and results["tokens"] == targets
    assert results["loss"] == pytest.approx(nll / targets, rel=1e-5)
    val = [json.loads(line)["messages"] for line in (out / "val.messages.jsonl").open()]
    plain = ChatEncoder(get_tokenizer(TOKENIZER), load_chat_template(TOKENIZER, "plain"))
    assert asked == [[plain.encode_prompt(messages[:-1]) for messages in val]]
    assert capsys.readouterr().err == ""  # the folder's own template: nothing to note


# ---- what it prints and writes ---------------------------------------------------------------


def test_json_file_and_table(monkeypatch, tmp_path, capsys):
    lm = _text_model()
    tokens = np.random.default_rng(2).integers(0, 64, 100).astype(np.uint16)
    data = _llmc_folder(tmp_path / "data", tokens, np.ones(64, np.int32))
    out = tmp_path / "results.json"
    _evaluate(monkeypatch, tmp_path, lm, data, f"--json={out}")
    assert capsys.readouterr().out == ""
    results = json.loads(out.read_text())
    assert set(results) == KEYS
    assert results["weights"] == str(tmp_path / "last.ckpt") and results["adapter"] is None
    assert results["data"] == str(data) and isinstance(results["examples"], int)
    assert all(isinstance(results[k], float) for k in ("loss", "perplexity", "bits_per_byte"))
    _evaluate(monkeypatch, tmp_path, lm, data)
    table = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in table] == [
        "weights", "data", "examples", "tokens", "loss", "perplexity", "bits"
    ]  # fmt: skip
    assert table[4].split()[-1] == f"{results['loss']:.4f}"


# ---- one-line errors ---------------------------------------------------------------------------


def _error(monkeypatch, tmp_path, capsys, lm, data: Path, *options: str) -> str:
    _evaluate(monkeypatch, tmp_path, lm, data, *options, status=2)
    (line,) = capsys.readouterr().err.splitlines()
    prefix = "plugintrain evaluate: error: "
    assert line.startswith(prefix)
    return line[len(prefix) :]


def _not_loaded(path: str) -> PretrainedLM:
    raise AssertionError("the model was loaded")


def test_data_that_is_no_prepared_data_is_refused_before_loading(monkeypatch, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    message = _error(monkeypatch, tmp_path, capsys, _not_loaded, tmp_path / "empty")
    out = tmp_path / "empty"
    assert message == (
        f"--data {out}: holds no prepared data; pass a folder written by `plugintrain prepare"
        f" text ... --out {out}`, `plugintrain prepare shakespeare --tokenizer T --out {out}`"
        f" or `plugintrain prepare chat FILE.jsonl --tokenizer T --out {out}`, or a .jsonl"
        ' file of {"messages": [...]} conversations'
    )
    assert "no such file or directory" in _error(
        monkeypatch, tmp_path, capsys, _not_loaded, tmp_path / "missing"
    )


def test_a_missing_split_is_refused_before_loading(monkeypatch, tmp_path, capsys):
    tokens = np.zeros(40, np.uint16)
    data = _llmc_folder(tmp_path / "data", tokens, np.ones(64, np.int32))
    message = _error(monkeypatch, tmp_path, capsys, _not_loaded, data, "--split=test")
    assert message == (
        f"{data} holds no test split (it holds train, val); pass --split train, or prepare the"
        " data again"
    )
    chat = _chat_folder(tmp_path / "chat", [(np.arange(5), np.ones(5, bool))])
    message = _error(monkeypatch, tmp_path, capsys, _not_loaded, chat, "--split=train")
    assert message.startswith(f"{chat} holds no train split (it holds val)")


def test_a_chat_folder_of_another_tokenizer_is_refused(monkeypatch, tmp_path, capsys):
    chat = _chat_folder(tmp_path / "chat", [(np.arange(5), np.ones(5, bool))], tokenizer="gpt2")
    message = _error(monkeypatch, tmp_path, capsys, _chat_model(), chat)
    assert message == (
        f"{chat} holds gpt2 tokens (its meta.json) but the model reads {TOKENIZER} tokens;"
        f" prepare the data again with --tokenizer {TOKENIZER}"
    )


def test_conversations_without_a_reference_answer_are_refused(monkeypatch, tmp_path, capsys):
    rows = _conversations(["Paris"])
    rows[0]["messages"].pop()
    data = _write_jsonl(tmp_path / "qa.jsonl", rows)
    message = _error(monkeypatch, tmp_path, capsys, _not_loaded, data)
    assert message == (
        f"{data} conversation 1 ends with user message; end each with the reference answer,"
        " an assistant message after the prompt's messages"
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--seq_len=8"], "--seq_len cuts text into windows; {data} holds chat examples: drop it"),
        (["--split=val"], "--split val picks a folder's split; drop it for {data}"),
        (["--batch_size=0"], "--batch_size must be >= 1, got 0"),
    ],
    ids=["seq_len", "split", "batch_size"],
)
def test_options_that_do_not_apply_are_refused(monkeypatch, tmp_path, capsys, options, message):
    data = _write_jsonl(tmp_path / "qa.jsonl", _conversations(["Paris"]))
    got = _error(monkeypatch, tmp_path, capsys, _not_loaded, data, *options)
    assert got == message.format(data=data)


# ---- preference folders ----------------------------------------------------------------------


def _preference_folder(tmp_path: Path) -> Path:
    from plugintrain.data import PreferencePrepareOptions, prepare_preference

    rows = tmp_path / "pairs.jsonl"
    with rows.open("w") as out:
        for n in range(6):
            pair = {"prompt": f"Count to {n + 2}.", "chosen": " ".join(map(str, range(1, n + 3)))}
            pair["rejected"] = f"No, {n} is enough." if n % 2 else "I will not."
            out.write(json.dumps(pair) + "\n")
    options = PreferencePrepareOptions(tokenizer=TOKENIZER, seq_len=64, val_examples=4)
    prepare_preference([str(rows)], tmp_path / "pref", options)
    return tmp_path / "pref"


def _plain_logps(lm: PretrainedLM, folder: Path) -> np.ndarray:
    """Each held-out sequence's answer log-prob from plain ``log_softmax`` of ``lm``'s
    logits, one sequence at a time."""
    ids = np.load(folder / "val.ids.npy")
    mask = np.load(folder / "val.mask.npy").astype(bool)
    logps = []
    with torch.no_grad():
        for start, end in itertools.pairwise(np.load(folder / "val.offsets.npy")):
            row = torch.as_tensor(ids[start:end].astype(np.int64))
            picked = F.log_softmax(lm(row[None, :-1])[0].double(), -1)[
                torch.arange(len(row) - 1), row[1:]
            ]
            logps.append(picked[torch.as_tensor(mask[start + 1 : end])].sum().item())
    return np.array(logps)


def test_preference_folder_against_plain_log_softmax(monkeypatch, tmp_path, capsys):
    """Each held-out sequence's answer log-prob from plain ``log_softmax`` of the model's
    logits, one sequence at a time; the accuracies and margin from those and from the
    reference log-probs the folder stores (written here); the answers scored against the
    chosen ones."""
    folder = _preference_folder(tmp_path)
    mask = np.load(folder / "val.mask.npy").astype(bool)
    offsets = np.load(folder / "val.offsets.npy")
    lm = _chat_model()
    logps = _plain_logps(lm, folder)
    reference = np.random.default_rng(0).normal(-20, 5, len(logps))
    np.save(folder / "val.ref_logps.npy", reference)
    results = _run_json(
        monkeypatch, tmp_path, capsys, lm, folder, "--max_new_tokens=2", "--beta=0.5"
    )
    assert set(results) == KEYS
    gain = logps - reference
    assert results["examples"] == len(logps) // 2 == 4
    assert results["preference_accuracy"] == np.mean(gain[0::2] > gain[1::2])
    assert results["reward_margin"] == pytest.approx(0.5 * np.mean(gain[0::2] - gain[1::2]))
    assert results["reference_accuracy"] == np.mean(reference[0::2] > reference[1::2])
    chosen_tokens = sum(
        mask[start + 1 : end].sum()
        for start, end in zip(offsets[0:-1:2], offsets[1::2], strict=True)
    )
    assert results["loss"] == pytest.approx(-logps[0::2].sum() / chosen_tokens, rel=1e-5)
    assert results["exact_match"] is not None


def test_a_named_reference_gives_the_margin_of_a_full_fine_tuning_run(
    monkeypatch, tmp_path, capsys
):
    """A folder without stored reference log-probs (a run whose reference came from its
    first pass) and ``--reference BASE``: the margin and the reference's accuracy from
    BASE's plain ``log_softmax`` log-probs; with a text folder, refused in one line."""
    folder = _preference_folder(tmp_path)
    policy, base = _chat_model(), _chat_model()
    with torch.no_grad():
        for param in base.parameters():
            param.add_(0.05 * torch.randn_like(param))
    (tmp_path / "base.ckpt").write_bytes(b"stands for the base")
    load = lambda path: base if Path(path).name == "base.ckpt" else policy  # noqa: E731
    reference = f"--reference={tmp_path / 'base.ckpt'}"
    results = _run_json(
        monkeypatch, tmp_path, capsys, load, folder, reference, "--max_new_tokens=1"
    )
    logps, base_logps = _plain_logps(policy, folder), _plain_logps(base, folder)
    gain = logps - base_logps
    assert not np.allclose(logps, base_logps)
    assert results["reward_margin"] == pytest.approx(
        0.1 * np.mean(gain[0::2] - gain[1::2]), rel=1e-5
    )
    assert results["reference_accuracy"] == np.mean(base_logps[0::2] > base_logps[1::2])
    assert results["preference_accuracy"] == np.mean(gain[0::2] > gain[1::2])
    tokens = np.random.default_rng(0).integers(0, 64, 200).astype(np.uint16)
    text = _llmc_folder(tmp_path / "text", tokens, np.ones(64, dtype=np.int64))
    _evaluate(monkeypatch, tmp_path, load, text, reference, status=2)
    assert "--reference scores a preference folder's pairs" in capsys.readouterr().err


def test_beta_goes_with_a_preference_folder(monkeypatch, tmp_path, capsys):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, 200).astype(np.uint16)
    data = _llmc_folder(tmp_path / "text", tokens, np.ones(64, dtype=np.int64))
    _evaluate(monkeypatch, tmp_path, _text_model(), data, "--beta=0.5", status=2)
    assert "--beta scales a preference folder's reward margin" in capsys.readouterr().err


def test_an_adapter_alone_has_no_reference(tmp_path, capsys):
    """A preference folder without stored reference log-probs, an adapter and no
    --weights: the reference (the adapter's base) is not known, so the command says to
    pass it, in one line, before any model loads."""
    from plugintrain.cli import main

    folder = _preference_folder(tmp_path)
    (tmp_path / "adapter").mkdir()
    args = ["evaluate", f"--adapter={tmp_path / 'adapter'}", f"--data={folder}"]
    assert main(args) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert "pass --weights BASE (the weights the adapter was trained on)" in line
