"""Weights in and out, checked against transformers, the gguf package and llm.c's layout.

Every reference is independent of plugintrain's converters: models are built and saved
by ``transformers`` from a config (random weights, nothing downloaded), GGUF files are
written here with the ``gguf`` writer (llama.cpp's Q/K permutation spelled out below, as
its ``convert_hf_to_gguf.py`` does it) and read back by transformers' own GGUF loader,
and llm.c files are written here in the order of llm.c's ``train_gpt2.py``.
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from plugintrain.cli import main
from plugintrain.core.memory import LiveTensorMemory
from plugintrain.formats import WeightFormatError, convert, load_into, open_weights
from plugintrain.model_zoo import Transformer

VOCAB = 96
TOKENS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))


def _gpt2(tie: bool = True, n_layer: int = 2) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=n_layer, n_head=4,
        bos_token_id=0, eos_token_id=0, tie_word_embeddings=tie,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).eval()


def _llama(tie: bool = True, original_context: int = 64, width: int = 64, ffn: int = 96):
    """GQA and Llama 3 RoPE scaling; a short original context makes the scaling matter."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=width, intermediate_size=ffn, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0, pad_token_id=None,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": original_context},
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


MODELS = {
    "gpt2": lambda: _gpt2(),
    "gpt2-untied": lambda: _gpt2(tie=False),
    "llama": lambda: _llama(),
    "llama-untied": lambda: _llama(tie=False),
}


def _saved(model: torch.nn.Module, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def _imported(source: Path | str) -> Transformer:
    weights = open_weights(source)
    model = Transformer(weights.config)
    load_into(model, weights)
    return model.eval()


@torch.no_grad()
def _logits(model: torch.nn.Module) -> torch.Tensor:
    out = model(TOKENS)
    return out.logits if hasattr(out, "logits") else out


def _assert_bit_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize("kind", MODELS)
def test_hugging_face_import_gives_transformers_logits(kind: str, tmp_path: Path) -> None:
    hf = MODELS[kind]()
    ours = _imported(_saved(hf, tmp_path / "hf"))
    torch.testing.assert_close(_logits(ours), _logits(hf), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", MODELS)
def test_hugging_face_export_loads_in_transformers(kind: str, tmp_path: Path) -> None:
    hf = MODELS[kind]()
    convert(_saved(hf, tmp_path / "hf"), tmp_path / "out", "hf")
    reloaded = type(hf).from_pretrained(tmp_path / "out").eval()
    torch.testing.assert_close(_logits(reloaded), _logits(hf), atol=1e-5, rtol=1e-5)
    assert reloaded.config.tie_word_embeddings == hf.config.tie_word_embeddings


ROUND_TRIPS = [
    ("gpt2", "hf", "out_hf"),
    ("gpt2", "llmc", "out.bin"),
    ("gpt2", "gguf", "out.gguf"),
    ("gpt2-untied", "gguf", "out.gguf"),
    ("llama", "hf", "out_hf"),
    ("llama", "gguf", "out.gguf"),
    ("llama-untied", "gguf", "out.gguf"),
]


@pytest.mark.parametrize(("kind", "fmt", "name"), ROUND_TRIPS)
def test_import_export_import_is_bit_exact(kind: str, fmt: str, name: str, tmp_path: Path) -> None:
    source = _saved(MODELS[kind](), tmp_path / "hf")
    first = _imported(source)
    convert(source, tmp_path / name, fmt)
    second = _imported(tmp_path / name)
    _assert_bit_equal(first, second)
    convert(tmp_path / name, tmp_path / "back", "hf")  # and out of that format again
    _assert_bit_equal(first, _imported(tmp_path / "back"))


def test_bf16_exports_hold_the_rounded_weights(tmp_path: Path) -> None:
    source = _saved(_gpt2(), tmp_path / "hf")
    rounded = {k: v.bfloat16().float() for k, v in _imported(source).state_dict().items()}
    for fmt, name in (("llmc", "bf16.bin"), ("hf", "bf16_hf"), ("gguf", "bf16.gguf")):
        convert(source, tmp_path / name, fmt, dtype="bfloat16")
        model = _imported(tmp_path / name)
        for key, value in model.state_dict().items():
            if fmt == "gguf" and value.dim() == 1:  # llama.cpp keeps norms and biases in F32
                continue
            assert torch.equal(value.float(), rounded[key]), (fmt, key)


# ---- GGUF against transformers' own GGUF loader ----------------------------------------


def _llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, as written there."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _k_quant_blocks(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K / Q6_K blocks with small, finite scales (gguf can dequantize these
    types but not quantize to them)."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // block_elems, block_bytes), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    if qtype == Q.Q4_K:  # d and dmin lead the block
        blocks[..., 0:2] = scale
        blocks[..., 2:4] = scale
    else:  # Q6_K: d ends the block
        blocks[..., -2:] = scale
    return blocks.reshape(rows, -1)


def _write_llama_gguf(hf: transformers.LlamaForCausalLM, path: Path, qtype: Q) -> None:
    """A llama-architecture GGUF of ``hf`` with every matrix in ``qtype``."""
    config = hf.config
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
             "lm_head": "output"}  # fmt: skip
    block = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}  # fmt: skip
    rng = np.random.default_rng(0)
    for name, tensor in hf.state_dict().items():
        module = name.removesuffix(".weight")
        if module.startswith("model.layers."):
            _, _, layer, rest = module.split(".", 3)
            target = f"blk.{layer}.{block[rest]}.weight"
        elif module == "lm_head" and config.tie_word_embeddings:
            continue
        else:
            target = f"{names[module]}.weight"
        array = tensor.numpy()
        if target.endswith("attn_q.weight"):
            array = _llama_cpp_permute(array, config.num_attention_heads)
        elif target.endswith("attn_k.weight"):
            array = _llama_cpp_permute(array, config.num_key_value_heads)
        if array.ndim == 1 or qtype == Q.F32:
            writer.add_tensor(target, np.ascontiguousarray(array, dtype=np.float32))
        elif qtype == Q.F16:
            writer.add_tensor(target, array.astype(np.float16))
        elif qtype in (Q.Q4_K, Q.Q6_K):
            writer.add_tensor(target, _k_quant_blocks(*array.shape, qtype, rng), raw_dtype=qtype)
        else:
            writer.add_tensor(target, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


GGUF_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K]


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda q: q.name)
def test_gguf_imports_the_tensors_transformers_loads(qtype: Q, tmp_path: Path) -> None:
    # K-quant rows are 256 values wide; no RoPE scaling (GGUF stores only its divisors).
    hf = _llama(tie=False, width=256, ffn=256)
    hf.config.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    _write_llama_gguf(hf, tmp_path / "m.gguf", qtype)
    reference = transformers.LlamaForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf").eval()
    ours = _imported(tmp_path / "m.gguf")
    theirs = reference.state_dict()
    from plugintrain.model_zoo import llama3

    for our_name, their_name in llama3.hf_names(ours.config).items():
        torch.testing.assert_close(ours.state_dict()[our_name], theirs[their_name], atol=0, rtol=0)
    torch.testing.assert_close(_logits(ours), _logits(reference), atol=1e-5, rtol=1e-5)


def _write_gpt2_gguf(hf: transformers.GPT2LMHeadModel, path: Path) -> None:
    """A gpt2-architecture GGUF as llama.cpp's converter names and lays it out: the fused
    ``attn_qkv`` and every Conv1D weight as ``(out, in)``."""
    config = hf.config
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_context_length(config.n_positions)
    writer.add_embedding_length(config.n_embd)
    writer.add_block_count(config.n_layer)
    writer.add_feed_forward_length(4 * config.n_embd)
    writer.add_head_count(config.n_head)
    writer.add_layer_norm_eps(config.layer_norm_epsilon)
    top = {"wte": "token_embd", "wpe": "position_embd", "ln_f": "output_norm"}
    block = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output",
             "ln_2": "ffn_norm", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}  # fmt: skip
    for name, tensor in hf.state_dict().items():
        module, _, kind = name.removeprefix("transformer.").rpartition(".")
        if module == "lm_head":
            continue  # tied
        if module.startswith("h."):
            _, layer, rest = module.split(".", 2)
            target = f"blk.{layer}.{block[rest]}.{kind}"
        else:
            target = f"{top[module]}.{kind}"
        array = tensor.numpy()
        if kind == "weight" and module.endswith(("c_attn", "c_proj", "c_fc")):
            array = array.T  # Conv1D's (in, out)
        writer.add_tensor(target, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gpt2_gguf_imports_as_transformers_loads_it(tmp_path: Path) -> None:
    hf = _gpt2()
    _write_gpt2_gguf(hf, tmp_path / "g.gguf")
    # The config is given: transformers' GGUF config mapping for gpt2 reads the vocabulary
    # size from a tokenizer; its tensor loading and processing are what this checks.
    reference = transformers.GPT2LMHeadModel.from_pretrained(
        tmp_path, gguf_file="g.gguf", config=hf.config
    ).eval()
    ours = _imported(tmp_path / "g.gguf")
    torch.testing.assert_close(_logits(ours), _logits(reference), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_logits(ours), _logits(hf), atol=1e-5, rtol=1e-5)


def test_rope_freqs_are_llama_cpps_llama3_factors() -> None:
    """The divisors llama.cpp's convert_hf_to_gguf.py (LlamaModel, rope_type llama3) writes."""
    from plugintrain.formats.gguf import llama3_rope_divisors
    from plugintrain.model_zoo import TransformerConfig

    config = TransformerConfig.from_name("llama3.2-1b")
    scaling, dim = config.rope_scaling, config.head_dim
    freqs = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(scaling.factor)
        else:
            smooth = (
                scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor
            ) / (scaling.high_freq_factor - scaling.low_freq_factor)
            factors.append(1 / ((1 - smooth) / scaling.factor + smooth))
    torch.testing.assert_close(
        llama3_rope_divisors(config).double(),
        torch.tensor(factors, dtype=torch.float64),
        rtol=1e-4,
        atol=0,
    )


def test_gguf_rope_scaling_round_trips(tmp_path: Path) -> None:
    hf = _llama(original_context=64)
    convert(_saved(hf, tmp_path / "hf"), tmp_path / "m.gguf", "gguf")
    weights = open_weights(tmp_path / "m.gguf")
    assert weights.config.rope_scaling == open_weights(tmp_path / "hf").config.rope_scaling
    torch.testing.assert_close(
        _logits(_imported(tmp_path / "m.gguf")), _logits(hf), atol=1e-5, rtol=1e-5
    )


# ---- llm.c ---------------------------------------------------------------------------


def _write_llmc(hf: transformers.GPT2LMHeadModel, path: Path, version: int = 3) -> None:
    """llm.c's train_gpt2.py write_model: header, then each kind stacked over layers, as
    (out, in) Linear weights (Hugging Face's Conv1D holds them transposed)."""
    c, n_layer = hf.config.n_embd, hf.config.n_layer
    sd = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items()}
    padded = math.ceil(hf.config.vocab_size / 128) * 128
    header = np.zeros(256, dtype=np.int32)
    header[:8] = [20240326, version, hf.config.n_positions, hf.config.vocab_size, n_layer,
                  hf.config.n_head, c, padded]  # fmt: skip
    wte = torch.cat([sd["wte.weight"], torch.zeros(padded - hf.config.vocab_size, c)])
    tensors = [wte, sd["wpe.weight"]]
    for name, transpose in (("ln_1.weight", 0), ("ln_1.bias", 0), ("attn.c_attn.weight", 1),
                            ("attn.c_attn.bias", 0), ("attn.c_proj.weight", 1),
                            ("attn.c_proj.bias", 0), ("ln_2.weight", 0), ("ln_2.bias", 0),
                            ("mlp.c_fc.weight", 1), ("mlp.c_fc.bias", 0),
                            ("mlp.c_proj.weight", 1), ("mlp.c_proj.bias", 0)):  # fmt: skip
        for i in range(n_layer):
            tensor = sd[f"h.{i}.{name}"]
            tensors.append(tensor.t() if transpose else tensor)
    tensors += [sd["ln_f.weight"], sd["ln_f.bias"]]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        for tensor in tensors:
            tensor = tensor.contiguous().float()
            if version == 5:
                tensor = tensor.bfloat16().view(torch.int16)
            f.write(tensor.numpy().tobytes())


def test_llmc_file_from_hugging_face_gpt2_gives_its_logits(tmp_path: Path) -> None:
    hf = _gpt2()
    _write_llmc(hf, tmp_path / "gpt2.bin")
    torch.testing.assert_close(
        _logits(_imported(tmp_path / "gpt2.bin")), _logits(hf), atol=1e-5, rtol=1e-5
    )
    _write_llmc(hf, tmp_path / "gpt2_bf16.bin", version=5)
    bf16 = _imported(tmp_path / "gpt2_bf16.bin")
    assert torch.equal(bf16.tok_embeddings.weight, hf.transformer.wte.weight.bfloat16().float())


# ---- memory: one tensor at a time ----------------------------------------------------


def _conversion_peak(n_layer: int, fmt: str, tmp_path: Path) -> tuple[int, int]:
    """Peak live tensor bytes of converting a Hugging Face GPT-2 of ``n_layer`` blocks to
    ``fmt``, and the bytes of all its weights."""
    hf = _gpt2(n_layer=n_layer)
    source = _saved(hf, tmp_path / f"hf{n_layer}")
    total = sum(t.numel() * t.element_size() for t in hf.state_dict().values())
    with LiveTensorMemory() as memory:
        convert(source, tmp_path / f"out{n_layer}.{fmt}", fmt)
    return memory.peak_bytes, total


@pytest.mark.parametrize("fmt", ["hf", "llmc", "gguf"])
def test_conversion_memory_does_not_grow_with_the_model(fmt: str, tmp_path: Path) -> None:
    # One output tensor (and the few it is built from) at a time: the peak is the same for
    # 2 and 12 blocks, where a converter holding the state dict would need 5x more.
    small, _ = _conversion_peak(2, fmt, tmp_path)
    large, total = _conversion_peak(12, fmt, tmp_path)
    assert 0 < large <= small * 1.05
    assert large < total / 3


# ---- bad input: one line naming the file and what is wrong; nothing overwritten ------------


def _rewrite_safetensors(path: Path, change) -> None:
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_wrong_shape_names_both_shapes(tmp_path: Path) -> None:
    source = _saved(_gpt2(), tmp_path / "hf")

    def shrink(t):
        t["transformer.wpe.weight"] = t["transformer.wpe.weight"][:63].clone()

    _rewrite_safetensors(source / "model.safetensors", shrink)
    with pytest.raises(ValueError, match=r"wpe\.weight.*\(63, 32\).*\(64, 32\)"):
        _imported(source)


def test_missing_and_unexpected_tensors_are_listed(tmp_path: Path) -> None:
    source = _saved(_gpt2(), tmp_path / "hf")

    def damage(t):
        del t["transformer.h.1.mlp.c_fc.bias"]
        t["transformer.h.9.extra"] = torch.zeros(1)

    _rewrite_safetensors(source / "model.safetensors", damage)
    with pytest.raises(
        WeightFormatError,
        match=r"missing 1 \(transformer\.h\.1\.mlp\.c_fc\.bias\),"
        r" unexpected 1 \(transformer\.h\.9\.extra\)",
    ):
        _imported(source)


@pytest.mark.parametrize("fmt", ["hf", "llmc", "gguf"])
def test_truncated_files_are_named(fmt: str, tmp_path: Path) -> None:
    source = _saved(_gpt2(), tmp_path / "hf")
    out = {"hf": tmp_path / "out", "llmc": tmp_path / "m.bin", "gguf": tmp_path / "m.gguf"}[fmt]
    convert(source, out, fmt)
    file = out / "model.safetensors" if fmt == "hf" else out
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(WeightFormatError, match=f"{file.name}.*(truncated|not a)"):
        _imported(out)


def _copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    """Every metadata field of ``reader`` but the ones the writer sets itself."""
    for key, field in reader.fields.items():
        if not key.startswith(("GGUF.", "general.architecture")):
            main_type = field.types[0]
            sub = field.types[-1] if main_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), main_type, sub_type=sub)


def test_unknown_gguf_architecture_and_type(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(tmp_path / "falcon.gguf", "falcon")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(WeightFormatError, match=r"falcon\.gguf.*architecture 'falcon'"):
        open_weights(tmp_path / "falcon.gguf")
    hf = _llama(width=256, ffn=256)
    hf.config.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    _write_llama_gguf(hf, tmp_path / "iq.gguf", Q.F32)
    reader = gguf.GGUFReader(tmp_path / "iq.gguf")
    writer = gguf.GGUFWriter(tmp_path / "iq4.gguf", "llama")
    _copy_metadata(reader, writer)
    for tensor in reader.tensors:
        data = np.array(tensor.data)
        if tensor.name == "blk.0.ffn_up.weight":
            block = gguf.GGML_QUANT_SIZES[Q.IQ4_NL]
            data = np.zeros((data.shape[0], data.shape[1] // block[0] * block[1]), np.uint8)
            writer.add_tensor(tensor.name, data, raw_dtype=Q.IQ4_NL)
        else:
            writer.add_tensor(tensor.name, data)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(WeightFormatError, match=r"iq4\.gguf.*blk\.0\.ffn_up\.weight is IQ4_NL"):
        open_weights(tmp_path / "iq4.gguf")


def test_llmc_wrong_magic_or_version(tmp_path: Path) -> None:
    _write_llmc(_gpt2(), tmp_path / "gpt2.bin")
    data = bytearray((tmp_path / "gpt2.bin").read_bytes())
    data[4:8] = (4).to_bytes(4, "little")
    (tmp_path / "v4.bin").write_bytes(data)
    with pytest.raises(WeightFormatError, match=r"v4\.bin: llm\.c model version 4"):
        open_weights(tmp_path / "v4.bin")
    data[0:8] = (20240520).to_bytes(4, "little") + (1).to_bytes(4, "little")  # a token file
    (tmp_path / "tokens.bin").write_bytes(data)
    with pytest.raises(WeightFormatError, match=r"tokens\.bin: not a weight file"):
        open_weights(tmp_path / "tokens.bin")


def test_export_never_overwrites_without_asking(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _saved(_gpt2(), tmp_path / "hf")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    capsys.readouterr()  # transformers' progress bars
    assert main(["convert", str(source), str(out), "--format", "hf"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and str(out) in error[0] and "--overwrite" in error[0]
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    # The hint works: the old output is replaced by a complete new one.
    assert main(["convert", str(source), str(out), "--format", "hf", "--overwrite"]) == 0
    assert not (out / "keep.txt").exists()
    assert (out / "model.safetensors").is_file() and not (tmp_path / "out.partial").exists()


def test_export_refuses_a_non_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _saved(_gpt2(), tmp_path / "hf")
    assert main(["export", str(source), str(tmp_path / "out"), "--format", "gguf"]) == 2
    assert "plugintrain convert" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ---- Hugging Face layouts: sharded safetensors, legacy torch files ------------------------


def test_sharded_and_legacy_hugging_face_directories(tmp_path: Path) -> None:
    hf = _gpt2()
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    torch.testing.assert_close(
        _logits(_imported(tmp_path / "sharded")), _logits(hf), atol=1e-5, rtol=1e-5
    )
    legacy = _saved(hf, tmp_path / "legacy")
    (legacy / "model.safetensors").unlink()
    torch.save(hf.state_dict(), legacy / "pytorch_model.bin")  # read with weights_only=True
    torch.testing.assert_close(_logits(_imported(legacy)), _logits(hf), atol=1e-5, rtol=1e-5)


def test_large_exports_are_sharded_with_an_index(tmp_path: Path) -> None:
    from plugintrain.formats import hf as hf_format

    hf = _llama()
    weights = open_weights(_saved(hf, tmp_path / "hf"))
    hf_format.write_hf(weights, tmp_path / "out", "float32", max_shard_bytes=30_000)
    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) > 2
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    torch.testing.assert_close(_logits(reloaded), _logits(hf), atol=1e-5, rtol=1e-5)


def test_gguf_export_keeps_the_embedded_tokenizer(tmp_path: Path) -> None:
    hf = _llama(tie=False, width=256, ffn=256)
    hf.config.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    _write_llama_gguf(hf, tmp_path / "plain.gguf", Q.F32)
    reader = gguf.GGUFReader(tmp_path / "plain.gguf")
    writer = gguf.GGUFWriter(tmp_path / "tok.gguf", "llama")
    _copy_metadata(reader, writer)
    tokens = [f"t{i}" for i in range(VOCAB)]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(["t 1", "t 2"])
    writer.add_bos_token_id(1)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    convert(tmp_path / "tok.gguf", tmp_path / "out.gguf", "gguf")
    fields = gguf.GGUFReader(tmp_path / "out.gguf").fields
    assert fields["tokenizer.ggml.tokens"].contents() == tokens
    assert fields["tokenizer.ggml.merges"].contents() == ["t 1", "t 2"]
    assert fields["tokenizer.ggml.bos_token_id"].contents() == 1


# ---- CausalLM(weights=...) -----------------------------------------------------------


def test_causal_lm_starts_from_weights_and_its_checkpoint_needs_no_file(tmp_path: Path) -> None:
    import shutil

    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from plugintrain.model_zoo import CausalLM
    from plugintrain.tools._models import load_causal_lm

    hf = _llama()
    source = _saved(hf, tmp_path / "hf")
    module = CausalLM(weights=str(source), warmup_steps=0)
    assert module.config.n_kv_head == 2 and module.config.tie_embeddings  # read from the file
    module.configure_model()
    torch.testing.assert_close(module(TOKENS), _logits(hf), atol=1e-5, rtol=1e-5)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    data = TensorDataset(TOKENS[:, :-1], TOKENS[:, 1:])
    trainer.fit(module, DataLoader(data, batch_size=2))
    trainer.save_checkpoint(tmp_path / "tuned.ckpt")
    shutil.rmtree(source)  # the checkpoint holds the architecture itself
    tuned = load_causal_lm(tmp_path / "tuned.ckpt")
    _assert_bit_equal(tuned.model, module.model)
    _assert_bit_equal(CausalLM.load_from_checkpoint(tmp_path / "tuned.ckpt").model, module.model)
    assert not torch.equal(tuned.model.norm.weight, hf.model.norm.weight)  # it trained


def test_generate_reads_every_format(tmp_path: Path) -> None:
    from plugintrain.tools._models import load_causal_lm

    hf = _gpt2()
    source = _saved(hf, tmp_path / "hf")
    convert(source, tmp_path / "m.gguf", "gguf")
    convert(source, tmp_path / "m.bin", "llmc")
    for path in (source, tmp_path / "m.gguf", tmp_path / "m.bin"):
        torch.testing.assert_close(
            load_causal_lm(path).eval()(TOKENS), _logits(hf), atol=1e-5, rtol=1e-5
        )


def test_a_config_that_is_not_the_files_is_refused(tmp_path: Path) -> None:
    from plugintrain.model_zoo import CausalLM, TransformerConfig

    source = _saved(_gpt2(), tmp_path / "hf")
    deeper = TransformerConfig.from_dict({**open_weights(source).config.__dict__, "n_layer": 4})
    with pytest.raises(WeightFormatError, match=r"hf: holds a model with n_layer=2 \(config: 4\)"):
        CausalLM(config=deeper, weights=str(source))
    with pytest.raises(
        WeightFormatError, match=r"holds no 32 \(layers\.2\..*leave the model's config"
    ):
        load_into(Transformer(deeper), open_weights(source), deeper)
    # A run may choose what the weights do not fix, such as a RoPE model's context length.
    hf = _llama()
    llama = _saved(hf, tmp_path / "llama")
    shorter = TransformerConfig.from_dict({**open_weights(llama).config.__dict__, "block_size": 32})
    module = CausalLM(config=shorter, weights=str(llama))
    module.configure_model()
    torch.testing.assert_close(module(TOKENS), _logits(hf), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "llama3"])
def test_gguf_export_spells_out_our_tokenizers(family: str, tmp_path: Path) -> None:
    """A model trained on GPT-2 or Llama 3 tokens exports with that vocabulary, so llama.cpp
    can run it: rebuilt from the GGUF alone, it tokenizes as tiktoken does."""
    from plugintrain.data import get_tokenizer

    torch.manual_seed(0)
    if family == "gpt2":
        hf = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=50257, n_positions=32, n_embd=16, n_layer=1, n_head=2
            )
        )
    else:
        hf = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(vocab_size=128256, hidden_size=16, intermediate_size=32,
                                     num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=1, max_position_embeddings=32,
                                     tie_word_embeddings=True)
        )  # fmt: skip
    convert(_saved(hf, tmp_path / "hf"), tmp_path / "m.gguf", "gguf")
    text = "ROMEO. But soft! What light through yonder window breaks? 1599, 'tis the east.\n\n"
    expected = get_tokenizer(family)
    rebuilt = get_tokenizer(str(tmp_path / "m.gguf"))
    assert rebuilt.encode(text) == expected.encode(text)
    assert (rebuilt.bos_id, rebuilt.eos_id) == (expected.bos_id, expected.eos_id)
