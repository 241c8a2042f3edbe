"""Workers that torchrun restarted after a failure (``--max-restarts``): how to tell, and
their process group on fresh store keys."""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist


def elastic_restart() -> bool:
    """Whether torchrun restarted this worker after a failure (``--max-restarts``)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def launching_rank() -> bool:
    """The process that runs before any other rank exists, or global rank 0 under torchrun
    (``RANK``) or ``srun`` (``SLURM_PROCID``, when nothing else set a rank)."""
    for name in ("RANK", "LOCAL_RANK", "SLURM_PROCID"):
        if name in os.environ:
            return os.environ[name] == "0"
    return True


def init_restarted_process_group(backend: str, timeout: timedelta | None) -> None:
    """Initialize the default process group of a worker torchrun restarted, on a store
    prefix of its own attempt.

    torchrun keeps its store across restarts, and torch 2.13's ``env://`` initialization
    under it hands a restarted gloo group the dead attempt's peer addresses
    (``connectFullMesh ... Connection refused``; reproduced with a 10-line torch script).
    A per-attempt prefix gives the new group fresh keys. Lightning then finds the group
    initialized and keeps it. A no-op outside a restart.
    """
    if not elastic_restart() or dist.is_initialized():
        return
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    kwargs = {} if timeout is None else {"timeout": timeout}
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, False, **kwargs
    )
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    prefixed = dist.PrefixStore(f"plugintrain/attempt_{attempt}", store)
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world_size, **kwargs)
