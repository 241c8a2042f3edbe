"""Tokenizers and chat templates: GPT-2 and Llama 3 built offline with tiktoken, the
tokenizers that come with pretrained weights (``tokenizer.json``, GGUF), the pre-BPE split
patterns, the model's own chat template, and how many bytes each token stands for.

Imports nothing of the other two rooms of :mod:`plugintrain.data`.
"""
