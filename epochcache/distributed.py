"""Where this process sits in a torchrun job, and the collectives that keep ranks in step.

A node is identified the way torchrun does it -- ``GROUP_RANK``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``RANK``, ``WORLD_SIZE`` -- never by hostname, so two simulated nodes on
one machine behave like two real ones. The variables are read when :func:`detect_world` is
called, never at import.

Invariant 8 (DDP never deadlocks on unequal data): ranks sharing a node's cache train on one
snapshot per epoch, taken by local rank 0 (which holds its lease) and broadcast to the node's
other ranks, each taking a disjoint slice; the number of batches is the MIN over all ranks, so a
node with a smaller cache never leaves the others waiting in a collective.

:class:`NodeSync` uses its own gloo groups: its collectives run on epochs()' background thread
while the training loop runs DDP's on the default group, and collectives on one group must be
issued in the same order by every rank. One group serves the background thread, another the
epoch-end barrier on the training thread.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)


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
    return bool(torch.distributed.is_available() and torch.distributed.is_initialized())


def detect_world() -> World:
    """Read the torchrun variables now; with torch.distributed initialised its rank wins.

    Raises:
        ValueError: a variable is not an integer, or they contradict each other.
    """
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    if dist_initialized():
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


def split_for_rank(order: np.ndarray, world: World) -> np.ndarray:
    """This rank's disjoint share of the node's epoch order (a strided slice, no copy)."""
    if world.local_world_size <= 1:
        return order
    return order[world.local_rank :: world.local_world_size]


class NodeSync:
    """Collectives for epochs() under torch.distributed; every rank must create it together.

    Args:
        world: this process's place (from :func:`detect_world`).
    """

    def __init__(self, world: World) -> None:
        dist = torch.distributed
        self.world = world
        self.prep_group = dist.new_group(backend="gloo")
        self.main_group = dist.new_group(backend="gloo")
        places: list[Any] = [None] * world.world_size
        dist.all_gather_object(places, (world.node_rank, world.local_rank), group=self.prep_group)
        self.node_group: Any = None
        self.leader = world.rank
        # new_group is itself collective: every rank creates every node's group, in one order.
        for node in sorted({p[0] for p in places}):
            ranks = [r for r, p in enumerate(places) if p[0] == node]
            group = dist.new_group(ranks=ranks, backend="gloo")
            if node == world.node_rank:
                self.node_group = group
                leaders = [r for r in ranks if places[r][1] == 0]
                if len(leaders) != 1:
                    raise ValueError(f"node {node} has {len(leaders)} ranks with LOCAL_RANK=0 "
                                     f"(global ranks {ranks}); check GROUP_RANK/LOCAL_RANK")
                self.leader = leaders[0]
        log.debug("NodeSync: rank %d on node %d, leader %d", world.rank, world.node_rank,
                  self.leader)

    def share_seqs(self, take: Callable[[], np.ndarray] | None) -> np.ndarray:
        """Local rank 0 calls ``take()`` (a snapshot); every rank of the node gets its seqs."""
        dist = torch.distributed
        is_leader = self.world.rank == self.leader
        if is_leader:
            if take is None:
                raise ValueError("share_seqs: the node leader must pass take")
            seqs = np.ascontiguousarray(take(), dtype=np.uint64)
            size = torch.tensor([seqs.shape[0]], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=self.leader, group=self.node_group)
        if not is_leader:
            seqs = np.empty(int(size.item()), dtype=np.uint64)
        if seqs.shape[0]:
            # gloo has no uint64: the same bytes travel as int64.
            dist.broadcast(torch.from_numpy(seqs.view(np.int64)), src=self.leader,
                           group=self.node_group)
        return seqs

    def agree_batches(self, n_batches: int) -> int:
        """The MIN of ``n_batches`` over all ranks (on the background thread's group)."""
        value = torch.tensor([n_batches], dtype=torch.int64)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN,
                                     group=self.prep_group)
        return int(value.item())

    def epoch_end(self) -> None:
        """Barrier on the training thread: nobody still reads when the leader releases."""
        torch.distributed.barrier(group=self.main_group)

    def close(self) -> None:
        for group in {id(g): g for g in (self.prep_group, self.main_group, self.node_group)
                      if g is not None}.values():
            try:
                torch.distributed.destroy_process_group(group)
            except (RuntimeError, ValueError):
                log.debug("could not destroy a NodeSync group", exc_info=True)


def init_run_distributed(world: World) -> bool:
    """Join the torchrun job of ``epochcache run`` (gloo on CPU, nccl with CUDA).

    Returns whether this call created the process group (and so should destroy it).
    """
    if not world.distributed or dist_initialized():
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    torch.distributed.init_process_group(backend=backend)
    log.info("joined the torchrun job: rank %d of %d (node %d, local rank %d), backend %s",
             world.rank, world.world_size, world.node_rank, world.local_rank, backend)
    return True


def barrier() -> None:
    if dist_initialized():
        torch.distributed.barrier()


def mean_across_ranks(metrics: dict[str, Any]) -> dict[str, Any]:
    """Average numeric metrics over all ranks (every rank calls this with the same keys)."""
    if not dist_initialized():
        return metrics
    names = sorted(k for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
    if not names:
        return metrics
    values = torch.tensor([float(metrics[k]) for k in names], dtype=torch.float64)
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.SUM)
    values /= torch.distributed.get_world_size()
    return {**metrics, **{k: float(v) for k, v in zip(names, values.tolist())}}
