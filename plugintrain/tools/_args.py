"""The argument parser of plugintrain's tools: whole option names, one-line errors."""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from typing_extensions import override


class ToolParser(argparse.ArgumentParser):
    """``argparse`` as plugintrain's tools use it.

    Options are never abbreviated (``--max_new 5`` is an error, not ``--max_new_tokens``),
    and an error is one line, the last one printed, naming the value and the fix and
    pointing at ``--help`` instead of printing the usage first. Exit status 2, as argparse.
    """

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(**kwargs)

    @override
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")
