"""Data: tokenizers, llm.c token files, datamodules and offline asset preparation.

Names are imported from their modules on first use (PEP 562), so reading a token file or
building a tokenizer does not import Lightning (which only the datamodules need).
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plugintrain.data.assets import ASSETS, Asset, AssetError, cache_root, fetch_asset
    from plugintrain.data.datamodules.chat_datamodule import ChatDataModule
    from plugintrain.data.prepare.chat_formats import (
        ChatDataError,
        detect_format,
        read_chat_rows,
        to_messages,
    )
    from plugintrain.data.prepare.chat_prepare import ChatPrepareOptions, prepare_chat
    from plugintrain.data.tokenizers.chat_templates import (
        PLAIN_TEMPLATE,
        ChatEncoder,
        ChatTemplate,
        ChatTemplateError,
        load_chat_template,
    )
    from plugintrain.data.tokenizers.hf_tokenizer import HFTokenizer
    from plugintrain.data.idx import read_idx, write_idx
    from plugintrain.data.datamodules.mnist import MNISTDataModule
    from plugintrain.data.prepare.offline import prepare_mnist, prepare_shakespeare
    from plugintrain.data.datamodules.resumable import ResumableBatches, ResumableSampler
    from plugintrain.data.token_bin import TokenFileError, read_token_bin, write_token_bin
    from plugintrain.data.tokenizers.token_bytes import read_token_bytes, write_token_bytes
    from plugintrain.data.datamodules.token_datamodule import TokenDataModule
    from plugintrain.data.datamodules.token_shards import TokenWindows
    from plugintrain.data.tokenizers.registry import (
        TOKENIZER_NAMES,
        Tokenizer,
        family_tokenizer,
        get_tokenizer,
        tokenizer_short_name,
        tokenizer_spec,
    )

_MODULES = {
    "assets": ("ASSETS", "Asset", "AssetError", "cache_root", "fetch_asset"),
    "datamodules.chat_datamodule": ("ChatDataModule",),
    "prepare.chat_formats": ("ChatDataError", "detect_format", "read_chat_rows", "to_messages"),
    "prepare.chat_prepare": ("ChatPrepareOptions", "prepare_chat"),
    "tokenizers.chat_templates": (
        "PLAIN_TEMPLATE",
        "ChatEncoder",
        "ChatTemplate",
        "ChatTemplateError",
        "load_chat_template",
    ),
    "tokenizers.hf_tokenizer": ("HFTokenizer",),
    "idx": ("read_idx", "write_idx"),
    "datamodules.mnist": ("MNISTDataModule",),
    "prepare.offline": ("prepare_mnist", "prepare_shakespeare"),
    "token_bin": ("TokenFileError", "read_token_bin", "write_token_bin"),
    "tokenizers.token_bytes": ("read_token_bytes", "write_token_bytes"),
    "datamodules.resumable": ("ResumableBatches", "ResumableSampler"),
    "datamodules.token_datamodule": ("TokenDataModule",),
    "datamodules.token_shards": ("TokenWindows",),
    "tokenizers.registry": (
        "TOKENIZER_NAMES",
        "Tokenizer",
        "family_tokenizer",
        "get_tokenizer",
        "tokenizer_short_name",
        "tokenizer_spec",
    ),
}
_HOME = {name: module for module, names in _MODULES.items() for name in names}

__all__ = [
    "ASSETS",
    "PLAIN_TEMPLATE",
    "TOKENIZER_NAMES",
    "Asset",
    "AssetError",
    "ChatDataError",
    "ChatDataModule",
    "ChatEncoder",
    "ChatPrepareOptions",
    "ChatTemplate",
    "ChatTemplateError",
    "HFTokenizer",
    "MNISTDataModule",
    "ResumableBatches",
    "ResumableSampler",
    "TokenDataModule",
    "TokenFileError",
    "TokenWindows",
    "Tokenizer",
    "cache_root",
    "detect_format",
    "family_tokenizer",
    "fetch_asset",
    "get_tokenizer",
    "load_chat_template",
    "prepare_chat",
    "prepare_mnist",
    "prepare_shakespeare",
    "read_chat_rows",
    "read_idx",
    "read_token_bin",
    "read_token_bytes",
    "to_messages",
    "tokenizer_short_name",
    "tokenizer_spec",
    "write_idx",
    "write_token_bin",
    "write_token_bytes",
]


def __getattr__(name: str) -> Any:
    """Each public name from its module, imported when first asked for."""
    if name in _HOME:
        return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
