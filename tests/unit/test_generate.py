"""CausalLM.generate: the KV-cache path reproduces the uncached one."""

import pytest
import torch

from plugintrain.model_zoo import CausalLM, TransformerConfig

from _hf_models import ours_from_hf


def _lm(preset: str) -> CausalLM:
    torch.manual_seed(0)
    config = TransformerConfig.from_name(preset, vocab_size=64, block_size=32, n_layer=2)
    lm = CausalLM(config)
    lm.configure_model()
    return lm.eval()


def _prompt() -> torch.Tensor:
    return torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("preset", ["gpt2-debug", "llama3-debug"])
def test_cached_greedy_equals_uncached(preset):
    lm = _lm(preset)
    cached = lm.generate(_prompt(), max_new_tokens=12, temperature=0.0)
    uncached = lm.generate(_prompt(), max_new_tokens=12, temperature=0.0, use_cache=False)
    assert cached.shape == (2, 17)
    torch.testing.assert_close(cached, uncached, rtol=0, atol=0)


@pytest.mark.parametrize("preset", ["gpt2-debug", "llama3-debug"])
def test_cached_top_k_sampling_equals_uncached(preset):
    lm = _lm(preset)
    torch.manual_seed(2)
    cached = lm.generate(_prompt(), max_new_tokens=12, temperature=0.8, top_k=10)
    torch.manual_seed(2)
    uncached = lm.generate(_prompt(), max_new_tokens=12, temperature=0.8, top_k=10, use_cache=False)
    torch.testing.assert_close(cached, uncached, rtol=0, atol=0)


def test_prefill_logits_match_full_forward():
    lm = _lm("llama3-debug")
    tokens = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        expected = lm(tokens)
        lm.model.setup_kv_cache(2, 16)
        prefill = lm(tokens[:, :6], torch.arange(6))
        decoded = [lm(tokens[:, t : t + 1], torch.tensor([t])) for t in range(6, 9)]
    lm.model.clear_kv_cache()
    torch.testing.assert_close(torch.cat([prefill, *decoded], dim=1), expected)


def test_top_k_restricts_samples():
    lm = _lm("gpt2-debug")
    prompt = _prompt()[:1]
    with torch.no_grad():
        allowed = lm(prompt)[0, -1].topk(3).indices
    torch.manual_seed(0)
    samples = [lm.generate(prompt, 1, temperature=5.0, top_k=3)[0, -1] for _ in range(20)]
    assert all(s in allowed for s in samples)


def test_eos_stops_and_pads():
    lm = _lm("gpt2-debug")
    prompt = _prompt()
    first = lm.generate(prompt, 1, temperature=0.0)[:, -1]
    out = lm.generate(prompt, 10, temperature=0.0, eos_id=int(first[0]))
    assert out[0, 5:].eq(first[0]).all()  # row 0 finished at once and is padded
    assert out.size(1) <= 15


def test_prompt_too_long_for_cache_raises():
    lm = _lm("gpt2-debug")
    with pytest.raises(ValueError, match="block_size=32"):
        lm.generate(torch.zeros(1, 30, dtype=torch.long), max_new_tokens=3)
    assert all(layer.attention.kv_cache is None for layer in lm.model.layers.values())


def test_uncached_generation_crops_to_block_size():
    lm = _lm("gpt2-debug")
    out = lm.generate(torch.zeros(1, 30, dtype=torch.long), 5, use_cache=False)
    assert out.shape == (1, 35)


# `plugintrain generate` checks its options before it loads anything: the checkpoint path
# below does not exist, and each error is about the option, not the file.
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt="], "--prompt is empty; give the text to continue, e.g. --prompt 'ROMEO:'"),
        (["--top_k=0"], "--top_k must be >= 1 (1 is greedy), got 0"),
        (["--max_new_tokens=-3"], "--max_new_tokens must be >= 1, got -3"),
        (["--max_new_tokens=0"], "--max_new_tokens must be >= 1, got 0"),
        (["--temperature=-0.5"], "--temperature must be >= 0 (0 is greedy), got -0.5"),
        (["--temperature=nan"], "--temperature nan: expected a float"),
        (["--num_samples=0"], "--num_samples must be >= 1, got 0"),
        (
            ["--max_new=5"],  # never abbreviated
            "unknown option --max_new; did you mean --max_new_tokens? (options are never"
            " abbreviated; --help lists them)",
        ),
        (
            [],
            "--weights missing.ckpt: no such file or directory; pass the last.ckpt that"
            " `plugintrain fit` wrote, e.g. runs/<recipe>/checkpoints/last.ckpt",
        ),
    ],
    ids=["empty-prompt", "top_k", "negative-tokens", "zero-tokens", "temperature", "nan",
         "samples", "abbreviation", "no-checkpoint"],
)  # fmt: skip
def test_bad_option_is_one_line_before_loading(capsys, argv, message):
    from plugintrain.cli import main

    assert main(["generate", "--ckpt_path=missing.ckpt", *argv]) == 2
    err = capsys.readouterr().err
    assert err == (f"plugintrain generate: error: {message}\n")


# ---- generated tokens against reference decoders --------------------------------------------
# The tests above compare generate's two paths with each other; these check what both
# produce against decoders written without generate's code: a plain loop over the model's
# full forward, a sampler of its own drawing from the same seeded generator, and Hugging
# Face's generate on the same GPT-2 weights.


def _spread_lm(preset: str) -> CausalLM:
    # init_std 0.2 instead of 0.02: near-uniform logits make every decoder repeat one token.
    torch.manual_seed(0)
    config = TransformerConfig.from_name(
        preset, vocab_size=64, block_size=32, n_layer=2, init_std=0.2
    )
    lm = CausalLM(config)
    lm.configure_model()
    return lm.eval()


@torch.no_grad()
def _plain_decode(lm: CausalLM, prompt: torch.Tensor, steps: int, pick) -> torch.Tensor:
    """Each step runs the model over the whole sequence (no cache) and appends ``pick``'s
    token for the last position."""
    idx = prompt
    for _ in range(steps):
        logits = lm.model(idx)[:, -1]  # (B, V)
        idx = torch.cat((idx, pick(logits)), dim=1)
    return idx


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1, keepdim=True)  # (B, 1)


def _reference_sampler(temperature: float, top_k: int):
    """Temperature, then keep the top_k logits (found by sorting), then one multinomial draw
    per row from the global generator, as ``generate`` promises."""

    def pick(logits: torch.Tensor) -> torch.Tensor:
        scaled = logits / temperature
        kth = scaled.sort(dim=-1, descending=True).values[:, top_k - 1 : top_k]  # (B, 1)
        scaled = torch.where(scaled < kth, float("-inf"), scaled)
        return torch.multinomial(scaled.float().softmax(dim=-1), num_samples=1)

    return pick


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("preset", ["gpt2-debug", "llama3-debug"])
def test_greedy_equals_plain_decoding(preset, use_cache):
    lm = _spread_lm(preset)
    got = lm.generate(_prompt(), max_new_tokens=12, temperature=0.0, use_cache=use_cache)
    expected = _plain_decode(lm, _prompt(), 12, _greedy)
    assert len(set(expected[:, 5:].flatten().tolist())) > 4  # not one repeated token
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("preset", ["gpt2-debug", "llama3-debug"])
def test_top_k_sampling_equals_a_reference_sampler(preset, use_cache):
    lm = _spread_lm(preset)
    for seed in range(3):
        torch.manual_seed(seed)
        got = lm.generate(_prompt(), 12, temperature=0.8, top_k=5, use_cache=use_cache)
        torch.manual_seed(seed)
        expected = _plain_decode(lm, _prompt(), 12, _reference_sampler(0.8, top_k=5))
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=f"seed {seed}")


def test_generate_equals_hugging_face_on_the_same_gpt2():
    import transformers  # test dependency (pyproject [test]), as in test_hf_parity.py

    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, initializer_range=0.2,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    config = TransformerConfig.from_name(
        "gpt2-debug", vocab_size=64, block_size=32, n_embd=32, n_layer=2, n_head=4
    )
    lm = CausalLM(config)
    lm.configure_model()
    lm.model.load_state_dict(ours_from_hf(hf.state_dict(), config))
    lm.eval()
    prompt = _prompt()
    hf_args = {"attention_mask": torch.ones_like(prompt), "max_new_tokens": 12, "pad_token_id": 0}
    greedy = hf.generate(prompt, do_sample=False, **hf_args)
    torch.testing.assert_close(lm.generate(prompt, 12, temperature=0.0), greedy, rtol=0, atol=0)
    for seed in range(3):  # HF draws one multinomial per step from the global generator too
        torch.manual_seed(seed)
        sampled = hf.generate(prompt, do_sample=True, temperature=0.8, top_k=5, **hf_args)
        torch.manual_seed(seed)
        ours = lm.generate(prompt, 12, temperature=0.8, top_k=5)
        torch.testing.assert_close(ours, sampled, rtol=0, atol=0, msg=f"seed {seed}")


# ---- which tokenizer `plugintrain generate` reads the prompt with ----------------------


def test_bad_tokenizer_is_one_line_before_the_checkpoint_is_read(capsys, tmp_path, monkeypatch):
    from plugintrain.cli import main
    from plugintrain.tools import generate

    (tmp_path / "last.ckpt").write_bytes(b"not read")
    monkeypatch.setattr(generate, "load_model", lambda *a, **k: pytest.fail("checkpoint read"))
    assert main(["generate", f"--ckpt_path={tmp_path / 'last.ckpt'}", "--tokenizer=gtp2"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(
        "plugintrain generate: error: unknown tokenizer 'gtp2': not one of ['gpt2', 'llama3',"
    )


def _bpe_lm(tmp_path):
    """A tiny GPT-2 whose config names a BPE tokenizer trained here (in ``tmp_path``)."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    verse = "Now is the winter of our discontent made glorious summer by this sun of York"
    bpe.train_from_iterator(
        [verse] * 4, vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False
    )
    bpe.save(str(tmp_path / "tokenizer.json"))
    torch.manual_seed(0)
    config = TransformerConfig.from_name(
        "gpt2-debug", vocab_size=320, block_size=32, n_layer=1, tokenizer=str(tmp_path)
    )
    lm = CausalLM(config)
    lm.configure_model()
    (tmp_path / "last.ckpt").write_bytes(b"stands for the model above")
    return lm


def test_the_tokenizer_that_came_with_the_weights_reads_the_prompt(capsys, tmp_path, monkeypatch):
    import json

    from plugintrain.cli import main
    from plugintrain.data import get_tokenizer
    from plugintrain.tools import generate

    lm = _bpe_lm(tmp_path)
    monkeypatch.setattr(generate, "load_model", lambda *args, **kwargs: lm)
    args = ["--prompt=the winter of", "--max_new_tokens=4", "--temperature=0", "--json"]
    assert main(["generate", f"--ckpt_path={tmp_path / 'last.ckpt'}", *args]) == 0
    sample = json.loads(capsys.readouterr().out)
    tok = get_tokenizer(str(tmp_path))
    prompt = tok.encode("the winter of")
    assert len(prompt) < len("the winter of")  # the merges at work, not bytes
    assert sample["tokens"][: len(prompt)] == prompt and len(sample["tokens"]) == len(prompt) + 4
    assert sample["text"] == tok.decode(sample["tokens"])


# ---- where `plugintrain generate` runs ---------------------------------------------------


def test_device_cpu_runs_the_model_there(capsys, tmp_path, monkeypatch):
    import json

    from plugintrain.cli import main
    from plugintrain.tools import generate

    lm = _bpe_lm(tmp_path)
    moved = []
    monkeypatch.setattr(generate, "load_model", lambda *args, **kwargs: lm)
    monkeypatch.setattr(lm, "to", lambda device: moved.append(device) or lm)
    args = ["--prompt=the winter of", "--max_new_tokens=3", "--temperature=0", "--json"]
    assert main(["generate", f"--ckpt_path={tmp_path / 'last.ckpt'}", *args, "--device=cpu"]) == 0
    assert moved == [torch.device("cpu")]
    assert len(json.loads(capsys.readouterr().out)["tokens"]) > 3


def _cpu_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available: None)


def _one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu = torch.device("cuda")
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available: gpu)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)


@pytest.mark.parametrize(
    ("machine", "device", "message"),
    [
        (_cpu_only, "cuda", "--device cuda: this machine has no accelerator; pass --device cpu"),
        (_cpu_only, "gpu", "--device gpu: not a device; pass cpu, cuda, cuda:N or mps"),
        (_one_gpu, "mps", "--device mps: this machine has cuda, not mps; pass --device cpu"),
        (_one_gpu, "cuda:3", "--device cuda:3: this machine has 1 cuda device(s)"),
    ],
    ids=["no-gpu", "unknown", "other-accelerator", "index"],
)  # fmt: skip
def test_unavailable_device_is_one_line_before_loading(
    capsys, tmp_path, monkeypatch, machine, device, message
):
    from plugintrain.cli import main
    from plugintrain.tools import generate

    machine(monkeypatch)
    (tmp_path / "last.ckpt").write_bytes(b"not read")
    monkeypatch.setattr(generate, "load_model", lambda *a, **k: pytest.fail("checkpoint read"))
    assert main(["generate", f"--ckpt_path={tmp_path / 'last.ckpt'}", f"--device={device}"]) == 2
    assert capsys.readouterr().err == f"plugintrain generate: error: {message}\n"


def test_default_device_is_cuda_when_available(monkeypatch):
    from plugintrain.tools.generate import _device

    _cpu_only(monkeypatch)
    assert _device(None) == torch.device("cpu")
    _one_gpu(monkeypatch)
    assert _device(None) == torch.device("cuda")
    assert _device("cuda:0") == torch.device("cuda", 0)


# ---- tokens as they come, and answers to many prompts at once ------------------------------


def test_generate_tokens_yields_what_generate_appends_and_frees_the_cache_when_closed():
    from plugintrain.model_zoo.generation import generate_tokens

    lm = _spread_lm("llama3-debug")
    whole = lm.generate(_prompt(), 8, temperature=0.0)
    steps = list(generate_tokens(lm.model, _prompt(), 8, temperature=0.0))
    assert all(step.shape == (2, 1) for step in steps)
    torch.testing.assert_close(torch.cat([_prompt(), *steps], dim=1), whole, rtol=0, atol=0)
    stream = generate_tokens(lm.model, _prompt(), 8, temperature=0.0)
    next(stream)
    assert all(layer.attention.kv_cache is not None for layer in lm.model.layers.values())
    stream.close()  # what a `break` out of the loop does
    assert all(layer.attention.kv_cache is None for layer in lm.model.layers.values())


def test_generate_tokens_ends_once_every_row_met_a_stop_id():
    from plugintrain.model_zoo.generation import generate_tokens

    lm = _spread_lm("gpt2-debug")
    free = torch.cat(list(generate_tokens(lm.model, _prompt(), 10, temperature=0.0)), dim=1)
    stops = {int(free[0, 1]), int(free[1, 3])}  # row 0 stops by step 2, row 1 by step 4
    steps = torch.cat(
        list(generate_tokens(lm.model, _prompt(), 10, temperature=0.0, stop_ids=stops)), dim=1
    )
    first = [next(i for i, t in enumerate(row.tolist()) if t in stops) for row in free]
    assert steps.size(1) == max(first) + 1
    for row, end in enumerate(first):  # the stop id repeats once a row is done
        assert steps[row, : end + 1].tolist() == free[row, : end + 1].tolist()
        assert steps[row, end:].eq(steps[row, end]).all()


def _prompts(lengths: list[int]) -> list[list[int]]:
    rng = torch.Generator().manual_seed(3)
    return [torch.randint(0, 64, (n,), generator=rng).tolist() for n in lengths]


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
def test_batched_greedy_answers_equal_one_at_a_time(use_cache):
    from plugintrain.model_zoo.generation import complete

    lm = _spread_lm("llama3-debug")
    prompts = _prompts([5, 3, 5, 7, 5, 3, 5])  # four of length 5: a full and a partial batch
    options = {"temperature": 0.0, "use_cache": use_cache}
    alone = [complete(lm.model, [p], 6, **options)[0] for p in prompts]
    stops = {alone[0][2], alone[3][1]}  # some rows end early, mid-batch
    batched = complete(lm.model, prompts, 6, stop_ids=stops, batch_size=3, **options)
    expected = []
    for prompt in prompts:
        plain = _plain_decode(lm, torch.tensor([prompt]), 6, _greedy)[0, len(prompt) :].tolist()
        end = next((i for i, t in enumerate(plain) if t in stops), len(plain))
        expected.append(plain[:end])
    assert batched == expected
    assert [len(a) for a in batched[:4]] != [6] * 4  # the stops were met


def _chat_lm(tmp_path):
    """A tiny random Llama reading the SmolLM2 tokenizer (its GGUF has a chat template)."""
    torch.manual_seed(0)
    config = TransformerConfig.from_name(
        "llama3-debug", vocab_size=49152, block_size=128, n_layer=1,
        tokenizer="smollm2-135m", init_std=0.2,
    )  # fmt: skip
    lm = CausalLM(config)
    lm.configure_model()
    (tmp_path / "last.ckpt").write_bytes(b"stands for the model above")
    return lm.eval()


def _generate_chat(monkeypatch, capsys, tmp_path, lm, rows, *options) -> list[dict]:
    import json

    from plugintrain.cli import main
    from plugintrain.tools import generate

    monkeypatch.setattr(generate, "load_model", lambda *args, **kwargs: lm)
    conversations = tmp_path / "chats.jsonl"
    conversations.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    argv = [f"--weights={tmp_path / 'last.ckpt'}", f"--chat={conversations}", "--device=cpu"]
    assert main(["generate", *argv, "--temperature=0", "--max_new_tokens=5", *options]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_generate_chat_answers_each_conversation_in_batches_as_one_at_a_time(
    monkeypatch, capsys, tmp_path
):
    lm = _chat_lm(tmp_path)
    questions = ["Is it red?", "Is it big?", "Is it odd?", "Where is the nearest library?"]
    rows = [[{"role": "user", "content": q}] for q in questions]
    rows.append([*rows[0], {"role": "assistant", "content": "No."}, *rows[1]])
    batched = _generate_chat(monkeypatch, capsys, tmp_path, lm, rows, "--batch_size=3")
    alone = _generate_chat(monkeypatch, capsys, tmp_path, lm, rows, "--batch_size=1")
    assert batched == alone
    for out, messages in zip(batched, rows, strict=True):
        assert out["messages"][:-1] == messages
        assert out["messages"][-1]["role"] == "assistant" and out["messages"][-1]["content"]
    # The answer is the greedy continuation of the prompt rendered in the chat template.
    from plugintrain.data import get_tokenizer
    from plugintrain.data.tokenizers.chat_templates import ChatEncoder, load_chat_template

    tokenizer = get_tokenizer("smollm2-135m")
    encoder = ChatEncoder(tokenizer, load_chat_template("smollm2-135m"))
    prompt = torch.tensor([encoder.encode_prompt(rows[3])])
    plain = _plain_decode(lm, prompt, 5, _greedy)[0, prompt.size(1) :].tolist()
    plain = plain[: next((i for i, t in enumerate(plain) if t in encoder.stop_ids), len(plain))]
    assert batched[3]["messages"][-1]["content"] == tokenizer.decode(plain)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--chat=missing.jsonl"],
         '--chat missing.jsonl: no such file; pass a .jsonl file of {"messages": [...]}'),
        (["--batch_size=4"], "--batch_size goes with --chat FILE; drop it"),
        (["--template=plain"], "--template goes with --chat FILE; drop it"),
    ],
    ids=["no-file", "batch_size-alone", "template-alone"],
)  # fmt: skip
def test_bad_chat_option_is_one_line_before_loading(capsys, argv, message):
    from plugintrain.cli import main

    assert main(["generate", "--ckpt_path=missing.ckpt", *argv]) == 2
    assert capsys.readouterr().err == f"plugintrain generate: error: {message}\n"


def test_a_chat_file_of_no_conversations_is_one_line_before_loading(capsys, tmp_path):
    from plugintrain.cli import main

    (tmp_path / "last.ckpt").write_bytes(b"not read")
    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"messages": [{"role": "user", "content": "Hi"}]}\n{"question": "Hi"}\n')
    assert main(["generate", f"--ckpt_path={tmp_path / 'last.ckpt'}", f"--chat={chats}"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(
        f"plugintrain generate: error: {chats}:2: no conversation (found ['question']);"
    )
