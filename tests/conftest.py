"""Shared by every test folder: pytest puts this folder on ``sys.path`` for it, so test
modules import the helpers beside it (``from _hf_models import random_hf_llama``)."""
