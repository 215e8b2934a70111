"""Where this process sits in a torchrun job: global rank, node, and rank within the node.

A node is identified the way torchrun does it -- ``GROUP_RANK``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``RANK``, ``WORLD_SIZE`` -- never by hostname, so two simulated nodes on
one machine behave like two real ones. The variables are read when :func:`detect_world` is
called, never at import. This module does not import torch.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass


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


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer "
                         "(set by torchrun; unset it or fix it)") from None


def dist_initialized() -> bool:
    # Not imported: nothing can have initialised it. `epochcache run` checks its config and
    # lists the source before paying ~1.5 s for importing torch.
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.distributed.is_available()
                and torch.distributed.is_initialized())


def detect_world() -> World:
    """Read the torchrun variables now; with torch.distributed initialised its rank wins.

    Raises:
        ValueError: a variable is not an integer, or they contradict each other.
    """
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    if dist_initialized():
        import torch.distributed

        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    local_rank = _env_int("LOCAL_RANK", rank % max(local_world_size, 1))
    node_rank = _env_int("GROUP_RANK", rank // max(local_world_size, 1))
    if not 0 <= local_rank < local_world_size or not 0 <= rank < world_size:
        raise ValueError(
            f"inconsistent torchrun environment: RANK={rank} WORLD_SIZE={world_size} "
            f"LOCAL_RANK={local_rank} LOCAL_WORLD_SIZE={local_world_size}"
        )
    return World(rank, world_size, local_rank, local_world_size, node_rank)
