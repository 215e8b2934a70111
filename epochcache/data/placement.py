"""Where this process sits in a distributed job, now: the launcher's `Placement`, with
torch.distributed's rank when it is initialised.

A node is identified the way the launcher says -- torchrun's ``GROUP_RANK``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, or Slurm's ``SLURM_NODEID``/``SLURM_LOCALID`` -- never by hostname, so two
simulated nodes on one machine behave like two real ones; with neither, a distributed job
raises [`NodeLayoutError`][epochcache.NodeLayoutError] (see `epochcache.launcher`). The
variables are read when `detect_placement` is called, never at import. This module does not
import torch.
"""

from __future__ import annotations

import os
import sys

from ..launcher import Placement, read_placement

__all__ = ["Placement", "detect_placement", "dist_initialized"]


def dist_initialized() -> bool:
    # Not imported: nothing can have initialised it. `epochcache run` checks its config and
    # lists the source before paying ~1.5 s for importing torch.
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.distributed.is_available()
                and torch.distributed.is_initialized())


def detect_placement() -> Placement:
    """Read the launcher's variables now; with torch.distributed initialised its rank wins.

    Raises:
        NodeLayoutError: a distributed job whose node layout the environment does not give, or
            a variable that is not an integer or contradicts the others.
    """
    rank = world_size = None
    if dist_initialized():
        import torch.distributed

        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return read_placement(os.environ, rank, world_size)
