"""Where this process sits in a distributed job: global rank, node, and rank within the node.

A node is identified the way the launcher says -- torchrun's ``GROUP_RANK``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, or Slurm's ``SLURM_NODEID``/``SLURM_LOCALID`` -- never by hostname, so two
simulated nodes on one machine behave like two real ones; with neither, a distributed job
raises :class:`~epochcache.errors.NodeLayoutError` (see :mod:`epochcache.launcher`). The
variables are read when :func:`detect_world` is called, never at import. This module does not
import torch.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from ..launcher import read_placement


@dataclass(frozen=True)
class World:
    """This process's place: global rank, node, and rank within the node."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def dist_initialized() -> bool:
    # Not imported: nothing can have initialised it. `epochcache run` checks its config and
    # lists the source before paying ~1.5 s for importing torch.
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.distributed.is_available()
                and torch.distributed.is_initialized())


def detect_world() -> World:
    """Read the launcher's variables now; with torch.distributed initialised its rank wins.

    Raises:
        NodeLayoutError: a distributed job whose node layout the environment does not give, or
            a variable that is not an integer or contradicts the others.
    """
    rank = world_size = None
    if dist_initialized():
        import torch.distributed

        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    place = read_placement(os.environ, rank, world_size)
    return World(place.rank, place.world_size, place.local_rank, place.local_world_size,
                 place.node_rank)
