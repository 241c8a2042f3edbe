"""The weight format registry: every format declared once, told from a path by its own
detector, and a new format one ``register_format`` call that ``convert`` and
``open_weights`` then read and write like the built-in ones."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers

from plugintrain.formats import convert, open_weights
from plugintrain.formats.registry import (
    FORMATS,
    FormatSpec,
    convert_formats,
    detect,
    dtype_problem,
    dtypes,
    export_formats,
    register_format,
    weight_formats,
)

TOY_FORMAT = '''
"""A toy weight format: one safetensors file holding a Hugging Face model's tensors, its
config.json in the file's metadata, named ``*.toy``."""

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from plugintrain.formats import TORCH_DTYPES
from plugintrain.model_zoo.families import by_hf_model_type, family_of


def is_toy(path: Path) -> bool:
    return path.is_file() and path.suffix == ".toy"


class ToyReader:
    def __init__(self, path: Path) -> None:
        self.path, self.tokenizer = path, None
        self._file = safe_open(str(path), framework="pt")
        hf = json.loads(self._file.metadata()["config"])
        self.config = by_hf_model_type(hf["model_type"]).from_hf_config(hf, path.stem)

    def names(self) -> list[str]:
        return list(self._file.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file.get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return self.read(name).dtype

    def read(self, name: str) -> torch.Tensor:
        return self._file.get_tensor(name)


def write_toy(weights, out: Path, dtype: str) -> None:
    family = family_of(weights.config)
    plan = family.hf_export_plan(weights.config)
    tensors = {
        name: rule.build(*(weights.read(s) for s in rule.sources)).to(TORCH_DTYPES[dtype])
        for name, rule in plan.items()
    }
    config = json.dumps(family.to_hf_config(weights.config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out), {"config": config})
'''


def _gpt2(path: Path) -> Path:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=0
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return path


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FormatSpec]:
    """The toy format, registered with one call (and taken out again afterwards)."""
    (tmp_path / "toy_format.py").write_text(TOY_FORMAT)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = register_format(
        FormatSpec(
            name="toy",
            what="a .toy file",
            detect="toy_format:is_toy",
            read="toy_format:ToyReader",
            write="toy_format:write_toy",
            dtypes=("float32", "bfloat16"),
        )
    )
    yield spec
    del FORMATS["toy"]


def test_the_registry_lists_names_and_dtypes_without_torch() -> None:
    code = (
        "import sys; from plugintrain.formats.registry import convert_formats, dtypes;"
        " print(convert_formats(), dtypes(), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("] ")[-1].strip() == "False"
    assert convert_formats() == ["hf", "gguf", "llmc"]
    assert export_formats() == ["hf", "gguf", "llmc", "peft"]
    assert weight_formats() == ["hf", "checkpoint", "gguf", "llmc"]
    assert dtypes() == ["float32", "bfloat16", "float16", "q8_0"]
    assert dtype_problem("gguf", "q8_0") is None
    assert dtype_problem("llmc", "float16") == (
        "--dtype float16 cannot be written as --format llmc; choose one of float32, bfloat16"
    )


def test_each_format_is_detected_from_its_path(tmp_path: Path) -> None:
    source = _gpt2(tmp_path / "hf")
    convert(source, tmp_path / "m.gguf", "gguf")
    convert(source, tmp_path / "m.bin", "llmc")
    (tmp_path / "run.ckpt").touch()
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({"r": 8}))
    found = {
        name: detect(tmp_path / name) for name in ("hf", "m.gguf", "m.bin", "run.ckpt", "adapter")
    }
    assert found == {
        "hf": "hf",
        "m.gguf": "gguf",
        "m.bin": "llmc",
        "run.ckpt": "checkpoint",
        "adapter": None,  # adapters alone are not a whole model
    }
    assert detect(tmp_path / "adapter", adapters=True) == "peft"
    assert detect(tmp_path / "hf", adapters=True) is None
    assert detect(tmp_path / "m.gguf" / "nothing") is None


def test_a_registered_toy_format_round_trips_through_convert(
    toy: FormatSpec, tmp_path: Path
) -> None:
    source = _gpt2(tmp_path / "hf")
    assert "toy" in convert_formats() and "toy" in weight_formats()
    with pytest.raises(ValueError, match="already"):
        register_format(toy)
    convert(source, tmp_path / "m.toy", "toy")
    assert detect(tmp_path / "m.toy") == "toy"
    convert(tmp_path / "m.toy", tmp_path / "back", "hf")
    before, after = open_weights(source), open_weights(tmp_path / "back")
    after.check_architecture(before.config)  # raises naming any field that differs
    for name in before.names():
        assert torch.equal(before.read(name), after.read(name)), name
    with pytest.raises(ValueError, match="--dtype float16 cannot be written as --format toy"):
        convert(source, tmp_path / "half.toy", "toy", "float16")
