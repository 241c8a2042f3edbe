"""Data: tokenizers, llm.c token files, datamodules and offline asset preparation.

Names are imported from their modules on first use (PEP 562), so reading a token file or
building a tokenizer does not import Lightning (which only the datamodules need).
"""

from plugintrain.core.lazy import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "assets": ("ASSETS", "Asset", "AssetError", "cache_root", "fetch_asset"),
        "datamodules.chat_datamodule": ("ChatDataModule",),
        "datamodules.preference_datamodule": ("PreferenceDataModule",),
        "datamodules.prompt_datamodule": ("PromptDataModule",),
        "prepare.chat_formats": ("ChatDataError", "detect_format", "read_chat_rows", "to_messages"),
        "prepare.chat_prepare": ("ChatPrepareOptions", "prepare_chat"),
        "prepare.preference_prepare": ("PreferencePrepareOptions", "prepare_preference"),
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
    },
)
