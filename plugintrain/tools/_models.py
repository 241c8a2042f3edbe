"""What the tools that run a model share (``generate``, ``chat``, ``evaluate``): their
model options, loading weights with or without LoRA adapters, the device, and reading
conversations (with ``prepare chat``'s reader of chat rows).

Importing it is cheap: torch and the model zoo are imported by the functions that need
them, so a tool parses its arguments before either loads.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from plugintrain.data.assets import PRETRAINED_MODELS

if TYPE_CHECKING:
    import torch

    from plugintrain.model_zoo.generation import PretrainedLM

WEIGHTS_HELP = (
    "a .ckpt written by `plugintrain fit` (a file, or the DCP directory of the sharded"
    " strategies), or pretrained weights: a Hugging Face model directory, an llm.c .bin, a"
    f" .gguf file, or one of {', '.join(PRETRAINED_MODELS)}. A LoRA run's checkpoint alone"
    " means its base with the adapters merged"
)
ADAPTER_HELP = (
    "a LoRA run's checkpoint, or a PEFT adapter directory: its adapters on the --weights"
    " base (default: the base the adapters were trained on), kept apart from the base"
    " weights"
)
MERGED_ADAPTER_HELP = (
    "a LoRA run's checkpoint, or a PEFT adapter directory: its adapters on the --weights"
    " base (default: the base the adapters were trained on), merged into the base weights"
    " (one matmul a layer, as fast as the base)"
)
DEVICE_HELP = (
    "where the model runs: cpu, cuda, cuda:N, mps, ... (default: cuda when a GPU is"
    " available, else cpu)"
)
CONVERSATION_FILES = (".jsonl", ".json", ".parquet")
"""What a file of chat rows is named (also ``.gz`` or ``.zst`` compressed)."""


def missing_path(option: str, path: str | None) -> str | None:
    """Why ``path``, given for ``option``, names no weights; None if it may."""
    if path is None or Path(path).exists() or path in PRETRAINED_MODELS:
        return None
    return (
        f"{option} {path}: no such file or directory; pass the last.ckpt that"
        " `plugintrain fit` wrote, e.g. runs/<recipe>/checkpoints/last.ckpt"
    )


def pick_device(spec: str | None) -> torch.device:
    """The device ``--device`` names; by default CUDA when available, else the CPU.

    Raises:
        ValueError: Naming the value, when torch knows no such device or this machine has
            none (``--device cuda`` without a GPU).
    """
    import torch

    if spec is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ValueError(f"--device {spec}: not a device; pass cpu, cuda, cuda:N or mps") from None
    if device.type == "cpu":
        return device
    here = torch.accelerator.current_accelerator(check_available=True)  # None: CPU only
    if here is None or here.type != device.type:
        found = "no accelerator" if here is None else f"{here.type}, not {device.type}"
        raise ValueError(f"--device {spec}: this machine has {found}; pass --device cpu")
    count = torch.accelerator.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(f"--device {spec}: this machine has {count} {device.type} device(s)")
    return device


def newest_in(path: str | None) -> str | None:
    """A run's checkpoint directory (``runs/<recipe>/checkpoints``) means its newest
    complete checkpoint, as ``--ckpt_path last`` does for ``fit``; anything else itself."""
    from plugintrain.checkpoints.files import newest_complete
    from plugintrain.formats import detect_format

    if path is None or not Path(path).is_dir() or path in PRETRAINED_MODELS:
        return path
    try:
        detect_format(Path(path))
        return path  # a model directory or a sharded checkpoint
    except ValueError:
        newest = newest_complete(Path(path))
    if newest is None:
        raise ValueError(f"{path} holds no complete checkpoint; pass a .ckpt file or model")
    print(f"plugintrain: using {newest} (the newest complete checkpoint)", file=sys.stderr)
    return str(newest)


def load_causal_lm(path: str | Path) -> PretrainedLM:
    """A language model from anything plugintrain reads weights from: a checkpoint file or
    DCP directory written by ``plugintrain fit``, a Hugging Face model directory, an llm.c
    ``.bin``, a ``.gguf`` file, or a pretrained name such as ``smollm2-135m``.

    Built as :class:`~plugintrain.model_zoo.CausalLM` builds its transformer, without
    Lightning: the architecture the file holds (a checkpoint's saved hyperparameters, JSON
    beside a directory's shards), on meta, then loaded tensor by tensor. A DCP directory's
    weights are read into one model on the CPU, whatever the layout that wrote them.
    Nothing is unpickled beyond tensors and plain data.
    """
    from plugintrain.model_zoo.generation import PretrainedLM

    return PretrainedLM(weights=str(path))


def load_with_adapter(weights: str | None, adapter: str, merge: bool) -> PretrainedLM:
    """The base model ``weights`` (default: the one the adapters were trained on, checked
    by sha256) with the LoRA adapters of the checkpoint ``adapter`` in it, merged into its
    weights if ``merge``."""
    from plugintrain.formats import lora_checkpoints
    from plugintrain.formats.checkpoint import CheckpointReader
    from plugintrain.model_zoo import lora

    record = CheckpointReader(Path(adapter)).lora
    if record is None or record["base"] is None:
        raise ValueError(
            f"--adapter {adapter} holds a whole model (no LoRA run's adapters on a base"
            f" file); pass it as --weights {adapter}"
        )
    base = weights or record["base"]
    lora_checkpoints.check_named_base(record, base, "--weights")
    module = load_causal_lm(base)
    lora_checkpoints.load_adapter(module, adapter)
    if merge:
        lora.merge(module)
    return module


def load_with_peft_adapter(weights: str | None, adapter: str, merge: bool) -> PretrainedLM:
    """The base model ``weights`` (default: the adapter's ``base_model_name_or_path``,
    where that is a path or a pretrained name plugintrain knows) with the PEFT adapter
    directory ``adapter`` in it, merged into its weights if ``merge``; the base weights
    quantized and dequantized where the adapter's model card names the quantization it
    was trained on (a QLoRA adapter)."""
    import torch

    from plugintrain.data.assets import PRETRAINED_MODELS
    from plugintrain.formats import read_adapters
    from plugintrain.formats.checkpoint import PREFIX
    from plugintrain.formats.lora_checkpoints import inject_dequantized
    from plugintrain.formats.peft_adapters import read_peft_config
    from plugintrain.model_zoo import lora

    named = read_peft_config(adapter).get("base_model_name_or_path")
    known = named is not None and (named in PRETRAINED_MODELS or Path(named).exists())
    base = weights or (named if known else None)
    if base is None:
        raise ValueError(
            f"--adapter {adapter} is a PEFT adapter whose base {named!r} is not here; pass"
            " --weights BASE (the model it was trained on: a Hugging Face directory, GGUF,"
            " checkpoint or pretrained name)"
        )
    module = load_causal_lm(base)
    spec, tensors = read_adapters(adapter, module.config)
    inject_dequantized(module, spec)  # a QLoRA adapter's base as it trained (its model card)
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, tensor in tensors.items():
            param = params[f"{PREFIX}{name}"]
            if param.shape != tensor.shape:
                raise ValueError(
                    f"--adapter {adapter}: {name} is {tuple(tensor.shape)}, but {base}'s is"
                    f" {tuple(param.shape)}; pass the --weights the adapter was trained on"
                )
            param.copy_(tensor)
    if merge:
        lora.merge(module)
    return module


def load_model(weights: str | None, adapter: str | None, merge: bool = False) -> PretrainedLM:
    """The model of ``--weights`` and ``--adapter`` as ``plugintrain generate`` loads it
    (a run's checkpoint directory meaning its newest checkpoint), in eval mode.

    Raises:
        FileNotFoundError, ValueError: A one-line message naming the file and the fix.
    """
    from plugintrain.formats import detect_adapters

    if adapter is not None and detect_adapters(Path(adapter)) is not None:
        return load_with_peft_adapter(newest_in(weights), adapter, merge).eval()
    weights, adapter = newest_in(weights), newest_in(adapter)
    if adapter is None:
        return load_causal_lm(weights).eval()
    return load_with_adapter(weights, adapter, merge).eval()


def model_tokenizer(module: PretrainedLM) -> str:
    """The tokenizer spec the model reads: the one its weights came with, else its family's."""
    return module.config.tokenizer or module.config.family


def holds_conversations(path: Path) -> bool:
    """Whether ``path`` is a file that may hold chat rows (``.jsonl``, ``.json``,
    ``.parquet``, maybe compressed), as ``plugintrain prepare chat`` reads them."""
    name = path.name.removesuffix(".gz").removesuffix(".zst")
    return path.is_file() and name.endswith(CONVERSATION_FILES)


def read_conversations(path: Path) -> list[list[dict[str, str]]]:
    """The conversations of a file of chat rows, in any format ``plugintrain prepare
    chat`` reads (``{"messages": [...]}``, prompt/response, Alpaca, ShareGPT), each row's
    format told by its fields.

    Raises:
        ValueError: Naming the file and row, and what to write there.
    """
    from plugintrain.data.prepare.chat_formats import detect_format, read_chat_rows, to_messages

    if not holds_conversations(path):
        raise ValueError(
            f"{path}: conversations come in a {', '.join(CONVERSATION_FILES)} file of chat"
            ' rows, e.g. one {"messages": [...]} a line; convert it'
        )
    return [
        to_messages(row, detect_format(row, where), where)
        for where, row in read_chat_rows([str(path)])
    ]
