"""The regexes that split text into words before byte-level BPE, per vocabulary.

A BPE vocabulary only reproduces its model's token ids with the split its merges were
learned on, so each is named after the tokenizer that uses it.
"""

# tiktoken's r50k/gpt2 split pattern (tiktoken_ext.openai_public.r50k_pat_str): the
# original GPT-2 regex with possessive quantifiers, which tokenizes identically but faster.
GPT2_PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)

# Meta's Llama 3 split pattern (llama_models/llama3/tokenizer.py).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2's (Qwen2Tokenizer's PRETOKENIZE_REGEX): Llama 3's with one digit per word.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# A GGUF file's `tokenizer.ggml.pre` -> the regexes llama.cpp splits byte-level text with,
# applied in turn (src/llama-vocab.cpp, `llm_tokenizer_bpe`). StarCoder-style vocabularies
# (SmolLM among them) cut out every digit first, as their Hugging Face tokenizers do with
# `Digits(individual_digits=True)`.
GGUF_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("gpt2", "gpt-2", "mpt", "olmo"), (GPT2_PATTERN,)),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"),
        (r"\p{N}", GPT2_PATTERN),
    ),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"), (LLAMA3_PATTERN,)
    ),
    **dict.fromkeys(("qwen2", "stablelm2", "deepseek-r1-qwen"), (QWEN2_PATTERN,)),
}
