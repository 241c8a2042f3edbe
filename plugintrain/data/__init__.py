"""Data: tokenizers, llm.c token files, datamodules and offline asset preparation."""

from plugintrain.data.assets import ASSETS, Asset, AssetError, cache_root, fetch_asset
from plugintrain.data.hf_tokenizer import HFTokenizer
from plugintrain.data.mnist import MNISTDataModule, read_idx, write_idx
from plugintrain.data.prepare import prepare_mnist, prepare_shakespeare
from plugintrain.data.token_bin import TokenFileError, read_token_bin, write_token_bin
from plugintrain.data.token_bytes import read_token_bytes, write_token_bytes
from plugintrain.data.token_datamodule import ResumableSampler, TokenDataModule, TokenWindows
from plugintrain.data.tokenizers import (
    TOKENIZER_NAMES,
    Tokenizer,
    family_tokenizer,
    get_tokenizer,
    tokenizer_short_name,
    tokenizer_spec,
)

__all__ = [
    "ASSETS",
    "TOKENIZER_NAMES",
    "Asset",
    "AssetError",
    "HFTokenizer",
    "MNISTDataModule",
    "ResumableSampler",
    "TokenDataModule",
    "TokenFileError",
    "TokenWindows",
    "Tokenizer",
    "cache_root",
    "family_tokenizer",
    "fetch_asset",
    "get_tokenizer",
    "prepare_mnist",
    "prepare_shakespeare",
    "read_idx",
    "read_token_bin",
    "read_token_bytes",
    "tokenizer_short_name",
    "tokenizer_spec",
    "write_idx",
    "write_token_bin",
    "write_token_bytes",
]
