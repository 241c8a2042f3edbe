"""Every weight format plugintrain reads or writes, declared once: name -> :class:`FormatSpec`.

A format is told from a path by its detector, read by a :class:`~plugintrain.formats.base.
TensorReader` factory and written by a writer, each named here as ``"module:attribute"``
and imported on first use: this module imports nothing heavy, so ``plugintrain convert
--help`` lists the formats and the dtypes each writes without loading torch. Everything
that switches on a format (``open_weights``, ``convert``, ``export``, ``generate
--weights`` and ``--adapter``, the LoRA callback's ``adapter``, the model card ``export``
writes) reads it from here.

A new format is one :func:`register_format` call::

    register_format(FormatSpec(
        name="toy", what="a .toy file", detect="my_pkg.toy:is_toy",
        read="my_pkg.toy:ToyReader", write="my_pkg.toy:write_toy", dtypes=("float32",),
    ))
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_FORMATS = "plugintrain.formats"


@dataclass(frozen=True)
class CardSpec:
    """How the Hugging Face Hub lists a format: what the model card ``export`` writes beside
    it says (:mod:`plugintrain.formats.model_card`)."""

    what: str
    """The export in words, for the card's reader (``a GGUF file for llama.cpp``)."""
    usage: tuple[str, str]
    """How to load it: a code block's language and its code, ``{where}`` standing for the
    export's name and ``{base}`` for the base model's Hub id (quoted) or a placeholder."""
    library: str | None = None
    """The Hub's ``library_name`` (``transformers``); None for a file format (GGUF), which
    the Hub lists by its files, not as a library."""
    tags: tuple[str, ...] = ()
    """Tags beside ``plugintrain`` and ``text-generation`` (``gguf``)."""


@dataclass(frozen=True)
class FormatSpec:
    """A weight format's surface, the same for every format."""

    name: str
    """What ``--format`` and :func:`~plugintrain.formats.detect_format` call it (``gguf``)."""
    what: str
    """The thing on disk, for help texts and errors (``a .gguf file``)."""
    detect: str
    """``"module:function"``: whether a path holds this format (``Path -> bool``); tried in
    registration order, the first that answers yes names the format."""
    read: str | None = None
    """``"module:factory"``: a :class:`~plugintrain.formats.base.TensorReader` of a path
    (``Path -> TensorReader``); None for a format plugintrain only writes."""
    write: str | None = None
    """``"module:function"``: write weights as this format (``(Weights, out: Path, dtype:
    str) -> None``, ``out`` not existing yet); None for a format plugintrain only reads."""
    read_adapters: str | None = None
    """``"module:function"``: a LoRA adapter's spec and tensors under our names for a model
    of a config (``(Path, TransformerConfig) -> (LoRASpec, dict[str, Tensor])``), for a
    format holding adapters alone (:attr:`adapters`)."""
    dtypes: tuple[str, ...] = ()
    """The weight types :attr:`write` takes (names as ``--dtype`` spells them)."""
    directory: bool = False
    """Written as a directory (else one file)."""
    own_names: bool = False
    """Its tensors carry plugintrain's own names (a checkpoint of ``plugintrain fit``), not
    a Hugging Face model's: no import plan, and a LoRA run's adapters merged into its base."""
    adapters: bool = False
    """It holds a LoRA run's adapters alone, not a whole model: written from a LoRA run's
    checkpoint (never merged), read by the LoRA callback and ``generate --adapter``."""
    card: CardSpec | None = None
    """``export`` writes a model card (``README.md``) with it, saying this; None: no card
    (a format the Hub does not host)."""

    def detector(self) -> Any:
        """The function telling this format from a path."""
        return load(self.detect)

    def reader(self) -> Any:
        """The reader factory (:class:`~plugintrain.formats.base.TensorReader` of a path)."""
        if self.read is None:
            raise ValueError(f"plugintrain writes {self.what} but does not read it")
        return load(self.read)

    def adapter_reader(self) -> Any:
        """The reader of a LoRA adapter in this format."""
        if self.read_adapters is None:
            raise ValueError(f"plugintrain does not read LoRA adapters from {self.what}")
        return load(self.read_adapters)

    def writer(self) -> Any:
        """The writer of weights in this format."""
        if self.write is None:
            raise ValueError(f"plugintrain reads {self.what} but does not write it")
        return load(self.write)


def load(reference: str) -> Any:
    """The object a ``"module:attribute"`` reference names, imported now."""
    module, _, attribute = reference.partition(":")
    return getattr(importlib.import_module(module), attribute)


_FLOATS = ("float32", "bfloat16", "float16")

FORMATS: dict[str, FormatSpec] = {}
"""Every format by name, in the order a path is tested against them."""


def register_format(spec: FormatSpec) -> FormatSpec:
    """Add ``spec`` to :data:`FORMATS` (tested last when a path's format is detected).

    Raises:
        ValueError: If a format of that name is registered already.
    """
    if spec.name in FORMATS:
        raise ValueError(f"a weight format named {spec.name!r} is registered already")
    FORMATS[spec.name] = spec
    return spec


for _spec in (
    FormatSpec(
        name="hf",
        what="a Hugging Face model directory (config.json + safetensors)",
        detect=f"{_FORMATS}.hf:is_hf_dir",
        read=f"{_FORMATS}.hf:HFReader",
        write=f"{_FORMATS}.hf:write_hf",
        dtypes=_FLOATS,
        directory=True,
        card=CardSpec(
            what="a Hugging Face `transformers` model directory",
            usage=(
                "python",
                "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
                'tokenizer = AutoTokenizer.from_pretrained("{where}")\n'
                'model = AutoModelForCausalLM.from_pretrained("{where}")',
            ),
            library="transformers",
        ),
    ),
    FormatSpec(
        name="checkpoint",
        what="a .ckpt file or checkpoint directory written by `plugintrain fit`",
        detect=f"{_FORMATS}.checkpoint:is_checkpoint",
        read=f"{_FORMATS}.checkpoint:CheckpointReader",
        own_names=True,
    ),
    FormatSpec(
        name="gguf",
        what="a .gguf file (llama.cpp)",
        detect="plugintrain.core.gguf_header:is_gguf",
        read=f"{_FORMATS}.gguf:GGUFFileReader",
        write=f"{_FORMATS}.gguf:write_gguf",
        dtypes=(*_FLOATS, "q8_0"),
        card=CardSpec(
            what="a GGUF file for llama.cpp",
            usage=(
                "bash",
                'llama-cli -m {where} -p "Hello"\n'
                'plugintrain generate --weights {where} --prompt "Hello"',
            ),
            tags=("gguf",),
        ),
    ),
    FormatSpec(
        name="llmc",
        what="an llm.c model .bin",
        detect=f"{_FORMATS}.llmc:is_llmc_file",
        read=f"{_FORMATS}.llmc:LlmcReader",
        write=f"{_FORMATS}.llmc:write_llmc",
        dtypes=("float32", "bfloat16"),
    ),
    FormatSpec(
        name="peft",
        what="a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)",
        detect=f"{_FORMATS}.peft_adapters:is_peft_dir",
        write=f"{_FORMATS}.peft_adapters:export_peft",
        read_adapters=f"{_FORMATS}.peft_adapters:read_peft",
        dtypes=("float32",),
        directory=True,
        adapters=True,
        card=CardSpec(
            what="a PEFT LoRA adapter",
            usage=(
                "python",
                "from peft import PeftModel\nfrom transformers import AutoModelForCausalLM\n\n"
                "base = AutoModelForCausalLM.from_pretrained({base}\n"
                'model = PeftModel.from_pretrained(base, "{where}")',
            ),
            library="peft",
            tags=("peft",),
        ),
    ),
):
    register_format(_spec)


def weight_formats() -> list[str]:
    """The formats a whole model is read from (what ``--weights`` takes)."""
    return [s.name for s in FORMATS.values() if s.read is not None and not s.adapters]


def convert_formats() -> list[str]:
    """The formats ``plugintrain convert`` writes a whole model in."""
    return [s.name for s in FORMATS.values() if s.write is not None and not s.adapters]


def export_formats() -> list[str]:
    """The formats ``plugintrain export`` writes a run's checkpoint in: the whole model's,
    and a LoRA run's adapters alone."""
    return [s.name for s in FORMATS.values() if s.write is not None]


def dtypes() -> list[str]:
    """Every weight type some format writes (``--dtype``'s choices), in first-seen order."""
    return list(dict.fromkeys(d for s in FORMATS.values() for d in s.dtypes))


def format_spec(name: str) -> FormatSpec:
    """The spec of format ``name``.

    Raises:
        ValueError: One line naming the formats there are, for an unknown ``name``.
    """
    if name not in FORMATS:
        raise ValueError(f"unknown weight format {name!r}; choose one of {list(FORMATS)}")
    return FORMATS[name]


def dtype_problem(name: str, dtype: str) -> str | None:
    """Why format ``name`` cannot hold weights of ``dtype``; None when it can."""
    held = format_spec(name).dtypes
    if dtype in held:
        return None
    return f"--dtype {dtype} cannot be written as --format {name}; choose one of {', '.join(held)}"


def detect(path: Path, adapters: bool = False) -> str | None:
    """The first registered format whose detector says ``path`` holds it, among whole-model
    formats (or, with ``adapters``, formats holding a LoRA run's adapters); None if none."""
    for spec in FORMATS.values():
        if spec.adapters == adapters and spec.detector()(path):
            return spec.name
    return None
