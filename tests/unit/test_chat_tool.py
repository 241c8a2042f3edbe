"""`plugintrain chat`: the prompts the model sees are the conversation in its chat template,
replies stream as they are generated, the context keeps the system prompt when the oldest
turns go, and the REPL ends cleanly.

The model is a tiny random Llama reading the SmolLM2 tokenizer (whose GGUF carries a
ChatML template), so its prompts are real rendered conversations.
"""

from __future__ import annotations

import io
import sys

import pytest
import torch

from plugintrain.model_zoo import TransformerConfig
from plugintrain.model_zoo.generation import PretrainedLM

TOKENIZER = "smollm2-135m"
SYSTEM = "Answer in one word."


def _model(block_size: int = 256) -> PretrainedLM:
    torch.manual_seed(0)
    config = TransformerConfig.from_name(
        "llama3-debug",
        vocab_size=49152,
        block_size=block_size,
        n_layer=1,
        tokenizer=TOKENIZER,
        init_std=0.2,  # spread logits: greedy replies of varied tokens, not one repeated
    )
    return PretrainedLM(config).eval()


def _encoder():
    from plugintrain.data import get_tokenizer
    from plugintrain.data.tokenizers.chat_templates import ChatEncoder, load_chat_template

    return ChatEncoder(get_tokenizer(TOKENIZER), load_chat_template(TOKENIZER))


class _Prompts:
    """The prompts the model is asked to continue: the tokens of each prefill (the forward
    that starts at position 0), and the order of prefills and stdout writes."""

    def __init__(self, lm: PretrainedLM) -> None:
        self.seen: list[list[int]] = []
        self.events: list[str] = []
        lm.model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        tokens, input_pos = args[0], args[1] if len(args) > 1 else None
        if input_pos is not None and int(input_pos[0]) == 0:
            self.seen.append(tokens[0].tolist())
        self.events.append("forward")


def _chat(monkeypatch, tmp_path, lm, lines: str, *options: str) -> tuple[int, list[str]]:
    """Run `plugintrain chat` on ``lm`` with ``lines`` as its input; its exit status and the
    replies the conversation recorded."""
    from plugintrain.cli import main
    from plugintrain.tools import _models, chat

    replies: list[str] = []
    answer = chat.Conversation.answer
    monkeypatch.setattr(_models, "load_causal_lm", lambda path: lm)
    monkeypatch.setattr(
        chat.Conversation, "answer", lambda self, text: replies.append(text) or answer(self, text)
    )
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    (tmp_path / "last.ckpt").write_bytes(b"stands for the model above")
    args = ["--temperature=0", f"--weights={tmp_path / 'last.ckpt'}", "--device=cpu", *options]
    return main(["chat", *args]), replies


@torch.no_grad()
def _greedy_reply(lm: PretrainedLM, prompt: list[int], steps: int, stop_ids) -> list[int]:
    """A reference decoder: the whole sequence through the model each step, argmax."""
    idx, new = torch.tensor([prompt]), []
    for _ in range(steps):
        token = int(lm.model(idx)[0, -1].argmax())
        if token in stop_ids:
            break
        new.append(token)
        idx = torch.cat((idx, torch.tensor([[token]])), dim=1)
    return new


def test_each_turn_prompts_the_whole_conversation_in_the_template(monkeypatch, tmp_path, capsys):
    lm = _model()
    prompts = _Prompts(lm)
    turns = ["What is the capital of France?", "And of Italy?", "Thanks!"]
    code, replies = _chat(
        monkeypatch, tmp_path, lm, "\n".join(turns) + "\n", f"--system={SYSTEM}",
        "--max_new_tokens=6",
    )  # fmt: skip
    assert code == 0 and len(replies) == 3 and all(reply.strip() for reply in replies)
    encoder = _encoder()
    messages = [{"role": "system", "content": SYSTEM}]
    for turn, seen, reply in zip(turns, prompts.seen, replies, strict=True):
        messages.append({"role": "user", "content": turn})
        assert seen == encoder.encode_prompt(messages)
        messages.append({"role": "assistant", "content": reply})
    # Each reply is the model's greedy continuation, cut at the end of turn, as text.
    from plugintrain.data import get_tokenizer

    expected = _greedy_reply(lm, prompts.seen[0], 6, set(encoder.stop_ids))
    assert replies[0] == get_tokenizer(TOKENIZER).decode(expected)
    assert capsys.readouterr().out == "".join(f"{reply}\n" for reply in replies)


def test_the_reply_is_printed_while_it_is_generated(monkeypatch, tmp_path):
    lm = _model()
    prompts = _Prompts(lm)
    written = []

    class Stdout(io.StringIO):
        def write(self, text: str) -> int:
            if text:
                written.append(text)
                prompts.events.append("write")
            return super().write(text)

    monkeypatch.setattr(sys, "stdout", Stdout())
    code, replies = _chat(monkeypatch, tmp_path, lm, "Tell me a story.\n", "--max_new_tokens=8")
    assert code == 0 and replies[0]
    # Text reaches stdout between the model's steps, not all at the end.
    first_write = prompts.events.index("write")
    assert "forward" in prompts.events[first_write:]
    assert "".join(written) == replies[0] + "\n"


def test_pieces_of_a_stream_never_split_a_character():
    from plugintrain.data import get_tokenizer
    from plugintrain.tools.chat import TextStream

    tokenizer = get_tokenizer(TOKENIZER)
    text = "Grüße aus Köln 🎉 — 東京タワー"
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([token]) for token in ids)  # split characters
    stream = TextStream(tokenizer)
    pieces = [stream.push(token) for token in ids]
    pieces.append(stream.finish())
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_a_long_conversation_drops_its_oldest_turns_and_keeps_the_system_prompt(
    monkeypatch, tmp_path, capsys
):
    block_size, new = 96, 8
    lm = _model(block_size)
    prompts = _Prompts(lm)
    turns = [f"Tell me something about the number {n}, please." for n in range(8)]
    code, _ = _chat(
        monkeypatch, tmp_path, lm, "\n".join(turns) + "\n", f"--system={SYSTEM}",
        f"--max_new_tokens={new}",
    )  # fmt: skip
    assert code == 0 and len(prompts.seen) == len(turns)
    from plugintrain.data import get_tokenizer

    texts = [get_tokenizer(TOKENIZER).decode(prompt) for prompt in prompts.seen]
    assert all(len(prompt) + new <= block_size for prompt in prompts.seen)
    assert all(text.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>") for text in texts)
    assert "number 0," in texts[1]  # kept while it fits
    assert "number 0," not in texts[-1] and "number 7," in texts[-1]
    assert capsys.readouterr().err.count("dropping its oldest turns") == 1  # said once


def test_reset_starts_the_conversation_over(monkeypatch, tmp_path, capsys):
    lm = _model()
    prompts = _Prompts(lm)
    lines = "Hello there.\n/reset\nWho are you?\n"
    code, _ = _chat(monkeypatch, tmp_path, lm, lines, f"--system={SYSTEM}", "--max_new_tokens=3")
    assert code == 0
    fresh = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who are you?"}]
    assert prompts.seen[1] == _encoder().encode_prompt(fresh)
    assert "(conversation cleared)" in capsys.readouterr().err


@pytest.mark.parametrize("lines", ["", "Hi.\n/exit\nnot read\n"], ids=["eof", "exit"])
def test_end_of_input_and_exit_end_with_status_0(monkeypatch, tmp_path, lines):
    lm = _model()
    prompts = _Prompts(lm)
    code, _ = _chat(monkeypatch, tmp_path, lm, lines, "--max_new_tokens=2")
    assert code == 0
    assert len(prompts.seen) == lines.count("Hi.")


def test_ctrl_c_ends_with_status_0_and_no_traceback(monkeypatch, tmp_path, capsys):
    import builtins

    def interrupted(prompt: str = "") -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr(builtins, "input", interrupted)
    code, _ = _chat(monkeypatch, tmp_path, _model(), "")
    assert code == 0
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--max_new_tokens=0"], "--max_new_tokens must be >= 1, got 0"),
        (["--top_k=0"], "--top_k must be >= 1 (1 is greedy), got 0"),
        (["--system="], "--system is empty; give the instructions, or drop --system"),
        (["--template=missing.jinja"],
         "--template missing.jinja: no such file; pass a .jinja file, or plain"),
        (["--max_new_tokens=300"],
         "--max_new_tokens 300 leaves no room for the conversation in the model's"
         " block_size=256; pass --max_new_tokens 64"),
    ],
    ids=["max_new_tokens", "top_k", "system", "template", "no-room"],
)  # fmt: skip
def test_bad_option_is_one_line(monkeypatch, tmp_path, capsys, options, message):
    assert _chat(monkeypatch, tmp_path, _model(), "", *options)[0] == 2
    assert capsys.readouterr().err == (f"plugintrain chat: error: {message}\n")
