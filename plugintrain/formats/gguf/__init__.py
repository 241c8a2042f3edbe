"""GGUF files (llama.cpp), read and written with the ``gguf`` package: what a family's
:class:`~plugintrain.model_zoo.family_spec.GGUFLayout` says lies where (:mod:`.links`), the
reader (:mod:`.reader`: dequantized, one tensor at a time), the writer (:mod:`.writer`)
and the tokenizer's ``tokenizer.*`` keys it writes (:mod:`.tokenizer_keys`).

The file's header (metadata and tensor table, read with Python's ``struct``) is
:mod:`plugintrain.core.gguf_header`: the data layer reads a GGUF model's tokenizer from it
too, and may import only the floor.
"""

from plugintrain.formats.gguf.reader import READ_TYPES, GGUFFileReader, llama3_rope_divisors
from plugintrain.formats.gguf.writer import WRITE_TYPES, write_gguf

__all__ = ["READ_TYPES", "WRITE_TYPES", "GGUFFileReader", "llama3_rope_divisors", "write_gguf"]
