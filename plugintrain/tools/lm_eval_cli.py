"""``plugintrain lm-eval``: lm-evaluation-harness's own command line, passed through.

Its words go to lm-eval's parser as they are (its options are lm-eval's, documented by
``plugintrain lm-eval --help``), with plugintrain's model type registered first. lm_eval is
an optional dependency, imported only when the command runs.
"""

from __future__ import annotations

import sys


def lm_eval(argv: list[str]) -> int:
    """lm-evaluation-harness's command line, with --model plugintrain.

    Args:
        argv: lm-eval's arguments, passed through as they are.
    """
    try:
        from plugintrain.tools.lm_eval_model import lm_eval_main
    except ImportError as error:
        print(f"plugintrain lm-eval: error: {error}; pip install lm_eval==0.4.13", file=sys.stderr)
        return 2
    return lm_eval_main(argv)
