"""plugintrain: Lightning plugins for training LLMs with hybrid parallelism."""

__version__ = "0.1.0"
