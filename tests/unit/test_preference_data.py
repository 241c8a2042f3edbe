"""``plugintrain prepare preference`` and ``PreferenceDataModule``: each row layout read,
encodings equal to transformers' rendering of SmolLM2's template with the answer masked,
truncation as its rules say and counted, one-line errors that leave nothing written,
reference log-probs stored and batched, the batch contract and pairs kept together under
any data-parallel layout and resume."""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from test_data_position import _fake_trainer  # the trainer a datamodule sees
from test_prepare_chat import _examples, _last_error, _write, prepare_main  # the same CLI
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

from plugintrain.data import get_tokenizer, write_token_bin
from plugintrain.data.assets import resolve_model_path
from plugintrain.data.prepare import date_chat
from plugintrain.data.prepare.preference_formats import Pair, detect_layout, to_pair

Q = [{"role": "user", "content": "Capital of France?"}]
ROWS = {  # every layout of one pair
    "conversational": {
        "prompt": Q,
        "chosen": [{"role": "assistant", "content": "Paris."}],
        "rejected": [{"role": "assistant", "content": "Lyon."}],
    },
    "ultrafeedback": {
        "prompt": "Capital of France?",  # UltraFeedback's copy of the first turn: not read
        "chosen": [*Q, {"role": "assistant", "content": "Paris."}],
        "rejected": [*Q, {"role": "assistant", "content": "Lyon."}],
    },
    "text": {"prompt": "Capital of France?", "chosen": "Paris.", "rejected": "Lyon."},
    "hh": {
        "chosen": "\n\nHuman: Capital of France?\n\nAssistant: Paris.",
        "rejected": "\n\nHuman: Capital of France?\n\nAssistant: Lyon.",
    },
}
PAIR = Pair(Q, "Paris.", "Lyon.")


def _run(inputs, out: Path, *extra: str, tokenizer="gpt2", template="plain") -> int:
    argv = ["preference", *map(str, inputs), "--tokenizer", tokenizer, "--out", str(out)]
    argv += ["--template", template] if template else []
    return prepare_main([*argv, *extra])


def _sequences(out: Path, split: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """The ``(ids, mask)`` sequences of a split (a chat folder's arrays, read and checked
    as the chat tests read them), two a pair."""
    sequences = _examples(out, split)
    assert len(sequences) % 2 == 0
    return [(ids.astype(np.int64), mask) for ids, mask in sequences]


def _pairs(n: int, answer: str = "{n}") -> list[dict]:
    return [
        {"prompt": f"What is {n} + {n}?", "chosen": answer.format(n=2 * n), "rejected": "no"}
        for n in range(n)
    ]


# -- layouts ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ROWS))
def test_each_layout_is_detected_and_read(name):
    row = ROWS[name]
    layout = detect_layout(row, "x:1")
    assert layout == {"ultrafeedback": "conversational"}.get(name, name)
    assert to_pair(row, layout, "x:1") == PAIR


def test_hh_turns_become_messages_and_the_prompt_ends_at_the_last_shared_assistant():
    start = "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: 2 + 2?\n\nAssistant:"
    row = {"chosen": start + " 4", "rejected": start + " 5, I think."}
    assert to_pair(row, "hh", "x:1") == Pair(
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "2 + 2?"},
        ],
        "4",
        "5, I think.",
    )
    # Answers that share their first characters: the prompt still ends at "Assistant:".
    same_start = {"chosen": start + " 4.", "rejected": start + " 4, or 5."}
    assert to_pair(same_start, "hh", "x:1").chosen == "4."


def test_a_text_pair_with_a_system_turn():
    row = {"system": "Be brief.", **ROWS["text"]}
    assert to_pair(row, "text", "x:1").prompt == [{"role": "system", "content": "Be brief."}, *Q]


# -- encoding ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    """transformers' reading of SmolLM2's GGUF (each digit its own piece, as SmolLM2's
    tokenizer.json splits: see tests/unit/test_chat_templates.py)."""
    path = resolve_model_path("smollm2-135m")
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    backend = reference.backend_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer]
    )
    return reference


SYSTEM_TEXT = {
    "system": "One word.",
    "prompt": "Sky colour?",
    "chosen": "Blue",
    "rejected": "A nice blue",
}
MORE_ROWS = {
    "ultrafeedback": {
        **ROWS["ultrafeedback"],
        "chosen": [*Q, {"role": "assistant", "content": "Paris 😀"}],
    },
    "text": SYSTEM_TEXT,
}


@pytest.mark.parametrize("name", list(ROWS))
def test_sequences_equal_transformers_rendering_with_the_answer_masked(name, smollm2, tmp_path):
    rows = [ROWS[name], *([MORE_ROWS[name]] if name in MORE_ROWS else [])]
    out = tmp_path / "out"
    path = _write(tmp_path / "in.jsonl", rows)
    assert _run([path], out, "--val_fraction", "0", tokenizer="smollm2-135m", template=None) == 0
    sequences = _sequences(out, "train")
    assert len(sequences) == 2 * len(rows)
    layout = detect_layout(rows[0], "x")
    meta = json.loads((out / "meta.json").read_text())
    assert meta["format"] == layout and meta["splits"]["train"]["pairs"] == len(rows)
    for row, chosen, rejected in zip(rows, sequences[::2], sequences[1::2], strict=True):
        pair = to_pair(row, layout, "x")
        prompt = smollm2.apply_chat_template(
            pair.prompt, add_generation_prompt=True, return_dict=False
        )
        for (ids, mask), answer in ((chosen, pair.chosen), (rejected, pair.rejected)):
            conversation = [*pair.prompt, {"role": "assistant", "content": answer}]
            assert ids.tolist() == smollm2.apply_chat_template(conversation, return_dict=False)
            assert ids[: len(prompt)].tolist() == prompt
            assert not mask[: len(prompt)].any() and mask[len(prompt)]
            assert smollm2.decode(ids[mask]) == answer + "<|im_end|>"


def test_the_folder_holds_pairs_side_by_side_and_val_pairs_as_text(tmp_path):
    out = tmp_path / "out"
    rows = _pairs(12)
    assert _run([_write(tmp_path / "in.jsonl", rows)], out, "--val_examples", "3") == 0
    gpt2 = get_tokenizer("gpt2")
    seen = []
    for split in ("train", "val"):
        sequences = _sequences(out, split)
        for (c_ids, c_mask), (r_ids, r_mask) in zip(sequences[::2], sequences[1::2], strict=True):
            start = int(np.argmax(c_mask))
            assert start == int(np.argmax(r_mask)) and (c_ids[:start] == r_ids[:start]).all()
            prompt = gpt2.decode(c_ids[:start].tolist())
            chosen, rejected = (
                gpt2.decode(i[m].tolist()) for i, m in ((c_ids, c_mask), (r_ids, r_mask))
            )
            seen.append((split, prompt, chosen, rejected))
    expected = {
        (
            f"<|user|>\n{r['prompt']}\n<|assistant|>\n",
            f"{r['chosen']}<|endoftext|>",
            "no<|endoftext|>",
        )
        for r in rows
    }
    assert {s[1:] for s in seen} == expected and len(seen) == len(rows)
    val = [json.loads(line) for line in (out / "val.pairs.jsonl").read_text().splitlines()]
    assert [
        (f"<|user|>\n{v['prompt'][0]['content']}\n<|assistant|>\n", f"{v['chosen']}<|endoftext|>")
        for v in val
    ] == [s[1:3] for s in seen if s[0] == "val"]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["kind"] == "preference" and meta["version"] == 1 and meta["reference"] is None
    assert meta["splits"]["val"]["pairs"] == 3 and meta["splits"]["train"]["pairs"] == 9
    assert meta["settings"] == {
        "seq_len": 1024,
        "max_prompt": 512,
        "truncate": "right",
        "val_fraction": 0.0,
        "val_examples": 3,
        "seed": 0,
    }
    assert meta["splits"]["train"]["tokens"] == sum(len(i) for i, _ in _sequences(out, "train"))


def test_workers_write_the_same_bytes(tmp_path):
    path = _write(tmp_path / "in.jsonl", _pairs(150))  # three chunks of rows
    assert _run([path], tmp_path / "one") == 0
    assert _run([path], tmp_path / "two", "--workers", "2") == 0
    for name in sorted(p.name for p in (tmp_path / "one").iterdir()):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()


# -- truncation -------------------------------------------------------------------------

LONG_PROMPT = " ".join(f"w{i}" for i in range(40))  # 94 gpt2 tokens in the plain template
LONG_ANSWER = " ".join(f"a{i}" for i in range(30))


def test_truncation_cuts_the_prompt_s_start_then_the_answers_ends_and_counts(tmp_path, capsys):
    rows = [
        {"prompt": "short", "chosen": "yes", "rejected": "no"},  # fits
        {"prompt": LONG_PROMPT, "chosen": "yes", "rejected": "no"},  # prompt cut
        {"prompt": LONG_PROMPT, "chosen": LONG_ANSWER, "rejected": "no"},  # both cut
        {"prompt": "short", "chosen": LONG_ANSWER * 3, "rejected": "No: " + LONG_ANSWER * 3},
    ]
    path = _write(tmp_path / "in.jsonl", rows)
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert _run([path], full, "--val_fraction", "0") == 0
    assert _run([path], cut, "--val_fraction", "0", "--seq_len", "64", "--max_prompt", "20") == 0
    expected, prompts_cut, answers_cut = [], 0, 0
    whole = _sequences(full, "train")
    for (c_ids, c_mask), (r_ids, _) in zip(whole[::2], whole[1::2], strict=True):
        start = int(np.argmax(c_mask))
        prompt, answers = c_ids[:start], [c_ids[start:], r_ids[start:]]
        if start + max(map(len, answers)) > 64:
            prompts_cut += start > 20
            prompt = prompt[-20:]
            answers_cut += sum(len(a) > 64 - len(prompt) for a in answers)
            answers = [a[: 64 - len(prompt)] for a in answers]
        expected += [np.concatenate([prompt, a]).tolist() for a in answers]
    assert [ids.tolist() for ids, _ in _sequences(cut, "train")] == expected
    assert (prompts_cut, answers_cut) == (2, 3)  # the rows above do what they say
    counts = json.loads((cut / "meta.json").read_text())["splits"]["train"]
    assert (counts["prompts_truncated"], counts["answers_truncated"], counts["dropped"]) == (
        2,
        3,
        {},
    )
    assert _run([path], tmp_path / "drop", "--seq_len", "64", "--truncate", "drop") == 0
    meta = json.loads((tmp_path / "drop" / "meta.json").read_text())
    dropped = {s: meta["splits"][s]["dropped"].get("too_long", 0) for s in ("train", "val")}
    assert sum(dropped.values()) == 3
    # A prompt that fills seq_len leaves no answer: the pair is dropped, by that reason.
    assert _run([path], tmp_path / "full_prompt", "--seq_len", "64", "--max_prompt", "64") == 0
    meta = json.loads((tmp_path / "full_prompt" / "meta.json").read_text())
    assert _dropped_by_reason(meta) == {"prompt_fills_seq_len": 2}


def _dropped_by_reason(meta: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for split in meta["splits"].values():
        for reason, n in split["dropped"].items():
            out[reason] = out.get(reason, 0) + n
    return out


# -- bad input --------------------------------------------------------------------------

GOOD = {"prompt": "p", "chosen": "c", "rejected": "r"}
TEMPLATE_MERGING = (  # no separator before the answer: ":" and "'" tokenize as one
    "{% for m in messages %}{{ m.role }}:{{ m.content }}"
    "{% if m.role == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
# (rows, options, the error, rows and options that fix it)
ERRORS = {
    "chosen equals rejected": (
        [GOOD, {"prompt": "p", "chosen": "same", "rejected": "same"}],
        [],
        "in.jsonl:2: chosen equals rejected ('same'), so the pair prefers nothing; drop the"
        " row or fix its rejected answer",
        ([GOOD], []),
    ),
    "missing field": (
        [{"prompt": "p", "chosen": "c"}],
        [],
        "in.jsonl:1: no preference pair (found ['chosen', 'prompt']); give rows with chosen and"
        " rejected (and a prompt), or name the layout with --format",
        ([GOOD], []),
    ),
    "empty field": (
        [{"prompt": "", "chosen": "c", "rejected": "r"}],
        [],
        "in.jsonl:1: an empty 'prompt' field (found ['chosen', 'prompt', 'rejected']), which"
        " a text pair needs; fill it or drop the row",
        ([GOOD], []),
    ),
    "empty answer": (
        [{"prompt": "p", "chosen": "c", "rejected": "  "}],
        [],
        "in.jsonl:1: field 'rejected' is empty; give the answer's text or drop the row",
        ([GOOD], []),
    ),
    "different prompts": (
        [
            {
                "chosen": [*Q, {"role": "assistant", "content": "Paris."}],
                "rejected": [
                    {"role": "user", "content": "Capital of Italy?"},
                    {"role": "assistant", "content": "Lyon."},
                ],
            }
        ],
        [],
        "in.jsonl:1: chosen and rejected have different prompts (their messages before the"
        " final answer differ); give both the same conversation before the answer",
        ([ROWS["ultrafeedback"]], []),
    ),
    "hh without a shared assistant turn": (
        [{"chosen": "\n\nHuman: Hi\n\nAssistant: Hello", "rejected": "\n\nHuman: Yo"}],
        [],
        "in.jsonl:1: chosen and rejected share no start ending in 'Assistant:', so they have"
        " different prompts; give both the same conversation before the answer",
        ([ROWS["hh"]], []),
    ),
    "hh differing before the last turn": (
        [
            {
                "chosen": "\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: 1?\n\nAssistant: 1",
                "rejected": "\n\nHuman: Hi\n\nAssistant: Hey\n\nHuman: 1?\n\nAssistant: 1",
            }
        ],
        [],
        "in.jsonl:1: chosen and rejected differ before their last assistant turn, so they"
        " have different prompts; give both the same conversation before the answer",
        ([ROWS["hh"]], []),
    ),
    "too long": (
        [GOOD, {"prompt": LONG_PROMPT, "chosen": "yes", "rejected": "no"}],
        ["--truncate", "error", "--seq_len", "64"],
        "in.jsonl:2: 97 tokens (prompt 94 + longer answer 3), over --seq_len 64; raise"
        " --seq_len, or pass --truncate right (cut the prompt's start, then the answers'"
        " ends) or --truncate drop",
        (None, ["--truncate", "right", "--seq_len", "64"]),
    ),
    "prompt rendered differently": (
        [{"prompt": "p", "chosen": "yes", "rejected": "'s fine"}],
        ["--template", "merging"],
        "in.jsonl:1: the chat template ({template}) renders the prompt differently before the"
        " chosen and the rejected answer, so they share no prompt tokens; pass another"
        " --template",
        (None, []),
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_is_one_line_leaves_nothing_and_the_fix_works(case, tmp_path, capsys):
    rows, options, message, (fixed_rows, fix) = ERRORS[case]
    path = _write(tmp_path / "in.jsonl", rows)
    template_file = tmp_path / "merging.jinja"
    template_file.write_text(TEMPLATE_MERGING)
    options = [str(template_file) if o == "merging" else o for o in options]
    template = None if "--template" in options else "plain"
    out = tmp_path / "out"
    assert _run([path], out, *options, template=template) == 2
    error = _last_error(capsys)
    expected = message.replace("in.jsonl", str(path)).format(template=template_file.resolve())
    assert error == f"plugintrain prepare preference: error: {expected}"
    assert not list(tmp_path.glob("out*"))
    if fixed_rows is not None:
        _write(path, fixed_rows)
    assert _run([path], out, *fix) == 0


def test_an_out_of_other_data_is_refused_both_ways(tmp_path, capsys):
    rows = _write(tmp_path / "in.jsonl", [GOOD])
    chat, pref = tmp_path / "chat", tmp_path / "pref"
    chat_rows = _write(tmp_path / "chat.jsonl", [{"prompt": "p", "response": "r"}])
    assert (
        prepare_main(
            [
                "chat",
                str(chat_rows),
                "--tokenizer",
                "gpt2",
                "--template",
                "plain",
                "--out",
                str(chat),
            ]
        )
        == 0
    )
    assert _run([rows], chat, "--overwrite") == 2
    assert "is not empty and holds no preference pairs" in _last_error(capsys)
    assert _run([rows], pref) == 0
    assert _run([rows], pref) == 2
    assert "holds preference pairs already; add --overwrite" in _last_error(capsys)
    assert _run([rows], pref, "--overwrite", "--seq_len", "100") == 0
    text = ["text", str(rows), "--tokenizer", "gpt2", "--quiet", "--num_proc", "1"]
    assert prepare_main([*text, "--out", str(pref), "--overwrite"]) == 2
    assert _last_error(capsys).endswith(
        f"--out {pref}: holds preference pairs prepared by `plugintrain prepare preference`;"
        " write text to a folder of its own"
    )
    assert json.loads((pref / "meta.json").read_text())["settings"]["seq_len"] == 100


def test_show_prints_both_sequences_with_the_answers_marked(tmp_path, capsys):
    path = _write(tmp_path / "in.jsonl", [{"prompt": "2 + 2?", "chosen": "4", "rejected": "5"}])
    assert _run([path], tmp_path / "out", "--show", "1") == 0
    shown = capsys.readouterr().out
    assert "chosen (" in shown and "<|user|>\n2 + 2?\n<|assistant|>\n⟦4<|endoftext|>⟧" in shown
    assert "<|assistant|>\n⟦5<|endoftext|>⟧" in shown


# -- reference log-probs ----------------------------------------------------------------


class _FakeScorer:
    """A stand-in for the model zoo's reference scorer: minus the sum of the masked ids /
    1000; counts the models it loaded (one a run, however many shards)."""

    loads = 0

    def __init__(self, weights, batch_size=8):
        assert weights == "fake-weights" and batch_size == 3
        self.loaded = False

    def __call__(self, sequences):
        if not self.loaded:
            self.loaded = True
            type(self).loads += 1
        return np.array([-(ids[mask].sum()) / 1000 for ids, mask in sequences])


@pytest.fixture
def fake_reference(monkeypatch):
    preference = pytest.importorskip("plugintrain.model_zoo.preference")
    monkeypatch.setattr(preference, "ReferenceScorer", _FakeScorer)
    monkeypatch.setattr(_FakeScorer, "loads", 0)
    from plugintrain.tools import prepare

    # "fake-weights" has no config to check against the tokenizer: the check is tested
    # on real weights (test_a_reference_that_cannot_score_the_pairs_is_refused_first).
    monkeypatch.setattr(prepare, "_reference_problem", lambda *args: None)


def test_reference_logps_are_stored_per_sequence_and_batched(fake_reference, tmp_path):
    from plugintrain.core.preference_batch import unpack_reference
    from plugintrain.data import PreferenceDataModule

    out = tmp_path / "out"
    path = _write(tmp_path / "in.jsonl", _pairs(8))
    reference = ["--reference", "fake-weights", "--reference_batch_size", "3"]
    assert _run([path], out, "--val_examples", "2", *reference) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["reference"] == {"weights": "fake-weights"}
    for split in ("train", "val"):
        stored = np.load(out / f"{split}.ref_logps.npy")
        expected = [-(ids[mask].sum()) / 1000 for ids, mask in _sequences(out, split)]
        assert stored.dtype == np.float64 and stored.tolist() == expected
    data = PreferenceDataModule(str(out), batch_size=2, shuffle=False)
    assert data.has_reference
    data.setup("fit")
    _, y = next(iter(data.val_dataloader()))
    assert unpack_reference(y)[1].tolist() == np.load(out / "val.ref_logps.npy").tolist()


# -- the data module --------------------------------------------------------------------


def _folder(
    root: Path, pairs: list, ref: list[float] | None = None, seq_len: int = 16, pad_id=50256
):
    """A folder as ``prepare preference`` writes it: pairs of ((ids, mask), (ids, mask))."""
    root.mkdir(parents=True, exist_ok=True)
    sequences = [s for pair in pairs for s in pair]
    for split in ("train", "val"):
        np.save(
            root / f"{split}.ids.npy", np.array([t for i, _ in sequences for t in i], np.uint32)
        )
        np.save(
            root / f"{split}.mask.npy", np.array([t for _, m in sequences for t in m], np.uint8)
        )
        offsets = np.cumsum([0, *(len(i) for i, _ in sequences)]).astype(np.int64)
        np.save(root / f"{split}.offsets.npy", offsets)
        if ref is not None:
            np.save(root / f"{split}.ref_logps.npy", np.array(ref, np.float64))
    meta = {
        "kind": "preference",
        "version": 1,
        "tokenizer": "gpt2",
        "vocab_size": 50257,
        "settings": {"seq_len": seq_len},
        "eos_id": pad_id,
        "pad_id": pad_id,
        "reference": None if ref is None else {"weights": "w"},
    }
    (root / "meta.json").write_text(json.dumps(meta))
    return root


def test_the_batch_contract(tmp_path):
    from plugintrain.data import PreferenceDataModule

    pairs = [
        (([1, 2, 3, 4], [0, 0, 1, 1]), ([1, 2, 5], [0, 0, 1])),
        (([6, 7, 8], [0, 1, 1]), ([6, 7, 9, 9, 9, 9], [0, 1, 1, 1, 1, 0])),
    ]
    ref = [-1.5, -2.25, -0.0, -1e-300]
    folder = _folder(tmp_path / "pref", pairs, ref)
    data = PreferenceDataModule(str(folder), batch_size=2, shuffle=False, pad_multiple=3)
    data.setup("fit")
    x, y = next(iter(data.val_dataloader()))
    P, I = 50256, -100  # noqa: E741
    assert x.dtype == y.dtype == torch.int64
    # The longest row holds 5 inputs: T = 6, the next multiple of 3.
    assert x.tolist() == [
        [1, 2, 3, P, P, P],
        [1, 2, P, P, P, P],
        [6, 7, P, P, P, P],
        [6, 7, 9, 9, 9, P],
    ]
    bits = np.array(ref, np.float64).view(np.int64).tolist()
    # Answer tokens' targets are their ids, prompt (and other unscored) tokens' -101 - id,
    # padding IGNORE_INDEX.
    # Then the batch's own totals (a validation batch is its own step): 2 pairs, their
    # chosen answers' 2 + 2 targets, their chosen rows' 3 + 2.
    step = [2, 4, 5]
    assert y.tolist() == [
        [-103, 3, 4, I, I, I, bits[0], *step],
        [-103, 5, I, I, I, I, bits[1], *step],
        [7, 8, I, I, I, I, bits[2], *step],
        [7, 9, 9, 9, -110, I, bits[3], *step],
    ]
    # T is the longest row rounded up to pad_multiple, but never over seq_len.
    capped = PreferenceDataModule(str(folder), batch_size=1, shuffle=False, seq_len=7)
    capped.setup("fit")
    shapes = [tuple(x.shape) for x, _ in capped.val_dataloader()]
    assert shapes == [(2, 7), (2, 7)]


def test_pack_and_unpack_reference_round_trip():
    from plugintrain.core.preference_batch import (
        pack_batch,
        step_totals,
        unpack_reference,
        with_reference,
    )

    targets = torch.tensor([[1, -100], [3, 4], [5, 6]])
    ref = np.array([-3.25, np.nan, -1e-12])
    packed = pack_batch(targets, ref, torch.tensor([6, 40, 70]))
    assert packed.shape == (3, 6) and packed.dtype == torch.int64
    assert packed[:, 2].tolist() == ref.view(np.int64).tolist()  # numpy's own bits
    back, got = unpack_reference(packed)
    assert torch.equal(back, targets) and got.dtype == torch.float64
    assert np.array_equal(got.numpy(), ref, equal_nan=True)
    assert np.isnan(unpack_reference(packed[1:2])[1].item())
    assert step_totals(packed[2:]).tolist() == [6, 40, 70]  # pairs, answer and row targets
    assert step_totals(pack_batch(targets, ref)).tolist() == [0, 0, 0]  # not known
    replaced = with_reference(packed, torch.tensor([-1.0, -2.0, -3.0]))
    assert unpack_reference(replaced)[1].tolist() == [-1.0, -2.0, -3.0]
    assert torch.equal(replaced[:, [0, 1, 3, 4, 5]], packed[:, [0, 1, 3, 4, 5]])


def test_a_folder_without_reference_batches_nan(tmp_path):
    from plugintrain.core.preference_batch import unpack_reference
    from plugintrain.data import PreferenceDataModule

    folder = _folder(tmp_path / "pref", [(([1, 2], [0, 1]), ([1, 3], [0, 1]))])
    data = PreferenceDataModule(str(folder), batch_size=1)
    assert not data.has_reference and data.preference and not data.loss_mask
    data.setup("fit")
    _, y = next(iter(data.train_dataloader()))
    assert torch.isnan(unpack_reference(y)[1]).all()


PAIRS = 24  # pair n: chosen [n, 1000 + n], rejected [n, 2000 + n] (its first id names it)


def _steps(folder: Path, batch: int, replicas: int, state=None, processed: int = 0):
    """The pairs of each step over a dp group of ``replicas``; each rank's rows checked to
    hold whole pairs, chosen then rejected."""
    from plugintrain.data import PreferenceDataModule

    per_rank = []
    for rank in range(replicas):
        data = PreferenceDataModule(str(folder), batch_size=batch, seed=5, pad_multiple=1)
        data.trainer = _fake_trainer(replicas, rank, processed)
        data.setup("fit")
        if state is not None:
            data.load_state_dict(state)
        batches = []
        for x, _ in data.train_dataloader():
            assert x.shape == (2 * batch, 2)
            assert torch.equal(x[::2, 0], x[1::2, 0]) and (x[::2, 1] < 2000).all()
            assert (x[1::2, 1] - x[::2, 1] == 1000).all()
            batches.append(set(x[::2, 0].tolist()))
        per_rank.append(batches)
    return [set().union(*b) for b in zip(*per_rank, strict=True)]


def test_pairs_stay_whole_on_every_rank_and_resume_under_another_layout(tmp_path):
    pairs = [(([n, 1000 + n, 7], [0, 1, 1]), ([n, 2000 + n, 7], [0, 1, 1])) for n in range(PAIRS)]
    folder = _folder(tmp_path / "pref", pairs)
    uninterrupted = _steps(folder, batch=4, replicas=1)
    assert sorted(set().union(*uninterrupted)) == list(range(PAIRS))
    assert _steps(folder, batch=2, replicas=2) == uninterrupted  # same pairs per step
    from plugintrain.data import PreferenceDataModule

    saving = PreferenceDataModule(str(folder), batch_size=2, seed=5)
    saving.trainer = _fake_trainer(2, 0, processed=3)
    state = saving.state_dict()
    assert state == {"epoch": 0, "position": 12}  # 3 steps x 2 ranks x 2 pairs
    continued = _steps(folder, batch=1, replicas=4, state=state, processed=3)
    assert continued == uninterrupted[3:]


def _varied_pair(n):
    """Pair n: a 1 + n % 3 token prompt starting with n, a 1 + n % 4 token chosen answer."""
    prompt = [n] + [5] * (n % 3)
    answer = [1000 + n] + [7] * (n % 4)
    mask = [0] * len(prompt) + [1] * len(answer)
    return (prompt + answer, mask), ([*prompt, 2000 + n], mask[: len(prompt) + 1])


def test_every_batch_carries_its_step_s_totals_on_every_rank(tmp_path):
    """A step is each rank's ``accumulate`` micro-batches: every batch of it carries the
    step's pairs and its chosen rows' answer and row targets, summed here from the pairs
    the ranks actually drew (pair n: a 1 + n % 3 token prompt, a 1 + n % 4 token chosen
    answer)."""
    from plugintrain.core.preference_batch import step_totals
    from plugintrain.data import PreferenceDataModule

    folder = _folder(tmp_path / "pref", [_varied_pair(n) for n in range(PAIRS + 3)], seq_len=16)
    for replicas, batch, accumulate, position in [(1, 4, 1, 0), (2, 2, 3, 0), (3, 1, 2, 6)]:
        drawn = {}  # (step, rank) -> the step's totals each batch carried, its pairs
        for rank in range(replicas):
            data = PreferenceDataModule(str(folder), batch_size=batch, seed=5, pad_multiple=1)
            data.trainer = _fake_trainer(replicas, rank)
            data.trainer.accumulate_grad_batches = accumulate
            data.setup("fit")
            data.load_state_dict({"epoch": 0, "position": position})
            for index, (x, y) in enumerate(data.train_dataloader()):
                totals, names = step_totals(y), x[::2, 0].tolist()
                seen = drawn.setdefault(index // accumulate, {}).setdefault(rank, [])
                seen.append((tuple(totals.tolist()), names))
        for step, ranks in drawn.items():
            assert len(ranks) == replicas
            carried = {t for batches in ranks.values() for t, _ in batches}
            names = [n for batches in ranks.values() for _, b in batches for n in b]
            answers = sum(1 + n % 4 for n in names)  # every answer token is a target
            rows = sum((1 + n % 3) + (1 + n % 4) - 1 for n in names)  # all tokens but one
            assert carried == {(len(names), answers, rows)}, (replicas, step)
        used = sum(len(b) for steps in drawn.values() for r in steps.values() for _, b in r)
        assert used == (PAIRS + 3 - position) // (replicas * batch) * replicas * batch


def test_step_totals_follow_lightning_s_steps_across_a_resume_with_another_accumulate(tmp_path):
    """Lightning steps after every ``accumulate`` micro-batches of the epoch, counting
    those before a checkpoint: resumed at 4 after one step of 2, its next step holds 2
    micro-batches, then 4. Every batch of each step Lightning takes (seen from inside a
    real fit) carries that step's totals."""
    import lightning.pytorch as pl

    from plugintrain.core.preference_batch import step_totals
    from plugintrain.data import PreferenceDataModule

    folder = _folder(tmp_path / "pref", [_varied_pair(n) for n in range(PAIRS)])

    class Steps(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))
            self.steps, self.batches = [[]], []

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.steps[-1].append((x[::2, 0].tolist(), step_totals(y).tolist()))
            return (self.w**2).sum()

        def on_before_optimizer_step(self, optimizer):
            self.steps.append([])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(accumulate, steps, ckpt_path=None):
        module = Steps()
        trainer = pl.Trainer(
            accelerator="cpu", max_steps=steps, accumulate_grad_batches=accumulate,
            logger=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=tmp_path / "run", limit_val_batches=0,
        )  # fmt: skip
        data = PreferenceDataModule(str(folder), batch_size=1, seed=3, pad_multiple=1)
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
        return [step for step in module.steps if step]

    first = fit(accumulate=2, steps=1)
    (checkpoint,) = (tmp_path / "run").rglob("*.ckpt")
    resumed = fit(accumulate=4, steps=3, ckpt_path=str(checkpoint))
    assert [len(step) for step in first + resumed] == [2, 2, 4]
    for step in first + resumed:
        names = [n for batch, _ in step for n in batch]
        answers = sum(1 + n % 4 for n in names)
        rows = sum((1 + n % 3) + (1 + n % 4) - 1 for n in names)
        assert {tuple(totals) for _, totals in step} == {(len(names), answers, rows)}


def test_datamodules_refuse_each_other_s_folders(tmp_path):
    from plugintrain.data import ChatDataModule, PreferenceDataModule, TokenDataModule

    pref = _folder(tmp_path / "pref", [(([1, 2], [0, 1]), ([1, 3], [0, 1]))])
    with pytest.raises(
        ValueError, match=r"holds preference pairs .*plugintrain.data.PreferenceDataModule"
    ):
        ChatDataModule(str(pref))
    with pytest.raises(
        ValueError,
        match=r"preference pairs \(plugintrain prepare preference\), not text tokens; .*Preference",
    ):
        TokenDataModule(str(pref), seq_len=4, batch_size=1)
    chat = tmp_path / "chat"
    rows = _write(tmp_path / "c.jsonl", [{"prompt": "p", "response": "r"}])
    assert (
        prepare_main(
            ["chat", str(rows), "--tokenizer", "gpt2", "--template", "plain", "--out", str(chat)]
        )
        == 0
    )
    with pytest.raises(ValueError, match=r"chat examples .*ChatDataModule`, or prepare pairs"):
        PreferenceDataModule(str(chat))
    text = tmp_path / "text"
    text.mkdir()
    write_token_bin(text / "train.bin", list(range(64)))
    write_token_bin(text / "val.bin", list(range(64)))
    with pytest.raises(ValueError, match=r"holds no meta.json, not preference pairs") as error:
        PreferenceDataModule(str(text))
    hint = re.search(r"--out (\S+)` and pass `--data.init_args.data_dir (\S+)`", str(error.value))
    assert hint and hint[1] == hint[2] == str(tmp_path / "text_preference")
    with pytest.raises(ValueError, match=r"holds gpt2 tokens .* `--tokenizer llama3`"):
        PreferenceDataModule(str(pref), tokenizer="llama3")
    with pytest.raises(ValueError, match=r"a sequence of 2 tokens, longer than seq_len=1"):
        PreferenceDataModule(str(pref), seq_len=1).setup("fit")


# -- the DPO demo's pairs ---------------------------------------------------------------


def _near_misses(date: datetime.date) -> set[str]:
    """Every rejected answer the demo may give for ``date``, spelled out here."""
    iso = date.isoformat()
    day = datetime.timedelta(days=1)
    misses = {s(date) for s in date_chat.STYLES} | {f"The date in ISO 8601 format is {iso}."}
    misses |= {(date - day).isoformat(), (date + day).isoformat()}
    if date.day <= 12 and date.day != date.month:
        misses.add(f"{date.year:04d}-{date.day:02d}-{date.month:02d}")
    return misses


def test_dates_preference_asks_the_chat_demo_s_questions(tmp_path, capsys):
    chat, pref = tmp_path / "dates.jsonl", tmp_path / "pairs.jsonl"
    assert prepare_main(["dates", "--count", "200", "--seed", "3", "--out", str(chat)]) == 0
    assert (
        prepare_main(["dates", "--preference", "--count", "200", "--seed", "3", "--out", str(pref)])
        == 0
    )
    conversations = [json.loads(line) for line in chat.read_text().splitlines()]
    pairs = [json.loads(line) for line in pref.read_text().splitlines()]
    kinds = set()
    for conversation, pair in zip(conversations, pairs, strict=True):
        question, answer = (m["content"] for m in conversation["messages"])
        assert pair["prompt"] == [{"role": "user", "content": question}]
        assert pair["chosen"] == [{"role": "assistant", "content": answer}]
        rejected = pair["rejected"][0]["content"]
        date = datetime.date.fromisoformat(answer)
        assert rejected != answer and rejected in _near_misses(date)
        kinds.add(
            "sentence"
            if rejected.startswith("The")
            else "iso"
            if re.fullmatch(r"\d{4}-\d\d-\d\d", rejected)
            else "style"
        )
    assert kinds == {"sentence", "iso", "style"}
    assert len({p["chosen"][0]["content"] for p in pairs}) == 200  # distinct dates


def test_a_prompts_pairs_are_held_out_together(tmp_path):
    """Pairs that share a prompt (UltraFeedback, HH: several answers a prompt) land in one
    split, so held-out prompts were never trained on."""
    import collections

    from plugintrain.data import PreferencePrepareOptions, prepare_preference

    rows = tmp_path / "pairs.jsonl"
    with rows.open("w") as out:
        for n in range(12):
            for answer in ("first", "second"):
                pair = {"prompt": f"Question {n}?", "chosen": f"A {answer}.", "rejected": "No."}
                out.write(json.dumps(pair) + "\n")
    options = PreferencePrepareOptions(tokenizer="smollm2-135m", seq_len=64, val_fraction=0.5)
    prepare_preference([str(rows)], tmp_path / "out", options)
    with (tmp_path / "out" / "val.pairs.jsonl").open() as lines:
        prompts = collections.Counter(json.loads(line)["prompt"][-1]["content"] for line in lines)
    assert prompts and set(prompts.values()) == {2}


def test_answers_the_cut_makes_equal_are_dropped(tmp_path):
    """Two answers that differ only past the cut would train nothing and count as a wrong
    preference: the pair is dropped, by that reason."""
    path = tmp_path / "pairs.jsonl"
    same = " the same words" * 30
    rows = [
        {"prompt": "Say it.", "chosen": same + " yes", "rejected": same + " no"},
        {"prompt": "Say it.", "chosen": "Short yes.", "rejected": "Short no."},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert _run([path], tmp_path / "out", "--seq_len", "64", "--val_fraction", "0") == 0
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert _dropped_by_reason(meta) == {"same_after_truncation": 1}
    assert meta["splits"]["train"]["pairs"] == 1


def test_a_reference_that_cannot_score_the_pairs_is_refused_first(tmp_path, capsys):
    """--reference whose vocabulary is smaller than the tokenizer's: one line, exit 2,
    before any row is encoded or anything written."""
    from _hf_models import random_hf_llama

    base = random_hf_llama(tmp_path / "base", 256, seed=0)
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "Hi.", "chosen": "Hello.", "rejected": "Go."}) + "\n")
    out = tmp_path / "out"
    assert _run([path], out, "--reference", str(base)) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"--reference {base}: its vocabulary of 256 is smaller than gpt2's" in line
    assert not out.exists() and not any(tmp_path.glob("out*partial"))
