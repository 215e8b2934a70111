"""The collectives that keep the ranks of a distributed job in step (where a process sits in
the job is `epochcache.placement`, which needs no torch).

Invariant 8 (DDP never deadlocks on unequal data): ranks sharing a node's cache train on one
snapshot per epoch, taken by local rank 0 (which holds its lease) and broadcast to the node's
other ranks, each taking a disjoint slice; the number of batches is the MIN over all ranks, so a
node with a smaller cache never leaves the others waiting in a collective.

`NodeSync` uses its own gloo groups: its collectives run on epochs()' background thread
while the training loop runs DDP's on the default group, and collectives on one group must be
issued in the same order by every rank. One group serves the background thread, another the
epoch-end barrier on the training thread.

No collective may wait for a rank that will never come (a rank that failed in its training loop
while another waits in a gradient all_reduce would otherwise hold both until the collective
timeout, 30 minutes by default). So the background collectives start only once every rank's
scheduler has arrived, which `NodeSync.rendezvous` finds out through the job's store (a
non-blocking check, polled, that gives up as soon as its caller is closing), and epochs() issues
no collective at all on its error path.

Joining the launcher's job (the process group) is `epochcache run`'s: `epochcache.run.process_group`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import NodeLayoutError
from ..placement import Placement

log = logging.getLogger(__name__)

_LEASE_ID_BYTES = 32  # a lease id is 32 hex digits


class NodeSync:
    """Collectives for epochs() under torch.distributed; every rank must create it together.

    Args:
        place: this process's place (from `detect_placement`).
        cache_id: which cache this rank reads (`cache_identity`).
        cache_path: its directory, for messages.

    Raises:
        NodeLayoutError: ranks of one node read different caches, or a node has no single
            local rank 0 (raised on every rank alike: nobody is left waiting).
    """

    def __init__(self, place: Placement, cache_id: str = "", cache_path: str = "") -> None:
        dist = torch.distributed
        self.place = place
        self.prep_group = dist.new_group(backend="gloo")
        self.main_group = dist.new_group(backend="gloo")
        places: list[Any] = [None] * place.world_size
        dist.all_gather_object(places, (place.node_rank, place.local_rank, uuid.uuid4().hex,
                                        cache_id, cache_path), group=self.prep_group)
        self.node_group: Any = None
        try:
            check_layout(places)
        except NodeLayoutError:
            self.close()
            raise
        # Keys of this NodeSync in the job's store, named by rank 0's token (every rank sees it).
        self.store: Any = dist.distributed_c10d.PrefixStore(
            f"epochcache/{places[0][2]}/", dist.distributed_c10d._get_default_store())
        self.leader = place.rank
        # new_group is itself collective: every rank creates every node's group, in one order.
        for node in sorted({p[0] for p in places}):
            ranks = [r for r, p in enumerate(places) if p[0] == node]
            group = dist.new_group(ranks=ranks, backend="gloo")
            if node == place.node_rank:
                self.node_group = group
                self.leader = next(r for r in ranks if places[r][1] == 0)
        log.debug("NodeSync: rank %d on node %d, leader %d", place.rank, place.node_rank,
                  self.leader)

    def rendezvous(self, epoch: int, cancelled: Callable[[], bool],
                   poll_s: tuple[float, float] = (0.001, 0.05)) -> bool:
        """Wait until every rank's scheduler of ``epoch`` is here; False if ``cancelled()`` first.

        The collectives that follow then complete: every rank is about to issue them. A
        rank that fails is not waited for: its peers' training loops see the failure (their
        gradient collectives break when its process ends) and close, which cancels this wait.
        """
        store, key, done = self.store, f"{epoch}/arrived", f"{epoch}/all"
        if int(store.add(key, 1)) == self.place.world_size:
            store.set(done, b"1")
            for old in (f"{epoch - 1}/arrived", f"{epoch - 1}/all"):
                try:  # every rank is past epoch - 1's rendezvous
                    store.delete_key(old)
                except (RuntimeError, NotImplementedError):
                    pass
            return True
        delay = poll_s[0]
        while not store.check([done]):
            if cancelled():
                return False
            time.sleep(delay)
            delay = min(poll_s[1], delay * 2)
        return True

    def share_seqs(self, take: Callable[[], tuple[np.ndarray, str]] | None
                   ) -> tuple[np.ndarray, str]:
        """Local rank 0 calls ``take()`` (a snapshot: its seqs and lease id); every rank of the
        node gets both (the lease id names the lease in the others' read errors)."""
        dist = torch.distributed
        is_leader = self.place.rank == self.leader
        head = torch.zeros(1 + _LEASE_ID_BYTES, dtype=torch.int64)  # count, then the lease id
        if is_leader:
            if take is None:
                raise ValueError("share_seqs: the node leader must pass take")
            taken, lease_id = take()
            seqs = np.ascontiguousarray(taken, dtype=np.uint64)
            head[0] = seqs.shape[0]
            raw = lease_id.encode("ascii")[:_LEASE_ID_BYTES]
            head[1 : 1 + len(raw)] = torch.tensor(list(raw), dtype=torch.int64)
        dist.broadcast(head, src=self.leader, group=self.node_group)
        if not is_leader:
            seqs = np.empty(int(head[0].item()), dtype=np.uint64)
            lease_id = bytes(int(b) for b in head[1:].tolist() if b).decode("ascii")
        if seqs.shape[0]:
            # gloo has no uint64: the same bytes travel as int64.
            dist.broadcast(torch.from_numpy(seqs.view(np.int64)), src=self.leader,
                           group=self.node_group)
        return seqs, lease_id

    def agree_batches(self, n_batches: int) -> int:
        """The MIN of ``n_batches`` over all ranks (on the background thread's group)."""
        value = torch.tensor([n_batches], dtype=torch.int64)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN,
                                     group=self.prep_group)
        return int(value.item())

    def gather_counts(self, row: list[int]) -> np.ndarray:
        """Every rank's ``row`` of integers (the same length on all), in rank order (on the
        background thread's group)."""
        mine = torch.tensor(row, dtype=torch.int64)
        rows = [torch.zeros_like(mine) for _ in range(self.place.world_size)]
        torch.distributed.all_gather(rows, mine, group=self.prep_group)
        return torch.stack(rows).numpy()

    def epoch_end(self) -> None:
        """Barrier on the training thread: nobody still reads when the leader releases.

        Only at an epoch's normal end: never while epochs() is being closed by an error.
        """
        torch.distributed.barrier(group=self.main_group)

    def close(self) -> None:
        """Destroy the groups and drop them, here on the calling (training) thread.

        A ProcessGroup's last reference must not go away on a background thread at
        interpreter exit: its destructor releases and retakes the GIL, and a daemon thread that
        retakes the GIL during finalization is ended mid-destructor (std::terminate: "terminate
        called without an active exception", a rank aborted).
        """
        groups = {id(g): g for g in (self.prep_group, self.main_group, self.node_group)
                  if g is not None}
        self.prep_group = self.main_group = self.node_group = None
        for group in groups.values():
            try:
                torch.distributed.destroy_process_group(group)
            except (RuntimeError, ValueError):
                log.debug("could not destroy a NodeSync group", exc_info=True)
        groups.clear()


def check_layout(places: list[Any]) -> None:
    """Every node has one local rank 0, and all its ranks read one cache.

    ``places[rank]`` is ``(node, local rank, token, cache id, cache path)``; every rank checks
    the same gathered list, so every rank raises alike.

    Raises:
        NodeLayoutError: the launcher's layout contradicts itself or the caches.
    """
    for node in sorted({p[0] for p in places}):
        ranks = [r for r, p in enumerate(places) if p[0] == node]
        leaders = [r for r in ranks if places[r][1] == 0]
        if len(leaders) != 1:
            raise NodeLayoutError(
                f"node {node} has {len(leaders)} ranks with local rank 0 (global ranks {ranks}); "
                "check GROUP_RANK/LOCAL_RANK (or SLURM_NODEID/SLURM_LOCALID)")
        caches = {places[r][3] for r in ranks}
        if len(caches) > 1:
            seen = "; ".join(f"rank {r}: {places[r][4]} ({places[r][3]})" for r in ranks)
            raise NodeLayoutError(
                f"the ranks of node {node} do not share one cache ({seen}): the node's snapshot "
                "would be read from other caches. Ranks of one node must run on one machine and "
                "open the same cache.dir; check GROUP_RANK and LOCAL_WORLD_SIZE (or the Slurm "
                "variables) and the cache directory of every rank")
