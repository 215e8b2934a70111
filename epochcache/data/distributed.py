"""The collectives that keep the ranks of a distributed job in step (where a process sits in
the job is `epochcache.data.placement`, which needs no torch).

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

``epochcache run`` joins the launcher's job with `init_run_distributed`: on CUDA the rank's
GPU is its current device before the default group exists, and the group is NCCL, bound to that
device. NCCL reduces CUDA tensors only, so the run's own collectives of CPU tensors and Python
objects (metrics, the start-up barrier, the checkpoint agreed at ``--resume``) go through
`bookkeeping_group`, a gloo group of all ranks made once, right after joining.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import NodeLayoutError
from .devices import CPU, RunDevice, choose_device
from .placement import Placement, detect_placement, dist_initialized

__all__ = ["NodeSync", "RunDevice", "Placement", "barrier", "bookkeeping_group", "check_layout",
           "close_run_distributed", "detect_placement", "dist_initialized", "init_run_distributed",
           "mean_across_ranks", "select_device", "split_for_rank"]

log = logging.getLogger(__name__)

_LEASE_ID_BYTES = 32  # a lease id is 32 hex digits

#: The gloo group of `bookkeeping_group` when the default group is not gloo (NCCL).
_BOOKKEEPING: Any = None


def split_for_rank(order: np.ndarray, place: Placement) -> np.ndarray:
    """This rank's disjoint share of the node's epoch order (a strided slice, no copy)."""
    if place.local_world_size <= 1:
        return order
    return order[place.local_rank :: place.local_world_size]


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


def select_device(place: Placement) -> RunDevice:
    """This rank's device and backend on this machine (`choose_device`).

    Raises:
        NodeLayoutError: CUDA is there but this local rank has no GPU of its own.
    """
    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl = torch.distributed.is_available() and torch.distributed.is_nccl_available()
    return choose_device(place, cuda_devices=cuda_devices, nccl_available=nccl,
                         visible=os.environ.get("CUDA_VISIBLE_DEVICES"))


def init_run_distributed(place: Placement, device: RunDevice = CPU, *, join: bool = True) -> bool:
    """Bind this process to ``device`` and join the launcher's job (``epochcache run``).

    On CUDA the rank's GPU becomes the current device before the process group exists (NCCL
    and the object collectives use the current device), and ``init_process_group`` is bound
    to it (``device_id``: the NCCL communicator is formed at once, so a bad GPU or network
    fails here rather than at the first collective). Then the bookkeeping group is made (see
    `bookkeeping_group`). Without a job (``join`` False) only the device is set.

    Returns whether this call created the default process group (and so should destroy it,
    with `close_run_distributed`).
    """
    if device.is_cuda:
        torch.cuda.set_device(device.index)
    if not join:
        return False
    created = False
    if not dist_initialized():
        kwargs: dict[str, Any] = {}
        if device.is_cuda and "device_id" in inspect.signature(
                torch.distributed.init_process_group).parameters:  # torch >= 2.3
            kwargs["device_id"] = torch.device(device.name)
        torch.distributed.init_process_group(backend=device.backend, **kwargs)
        created = True
        log.info("joined the torchrun job: rank %d of %d (node %d, local rank %d), backend %s, "
                 "device %s", torch.distributed.get_rank(), torch.distributed.get_world_size(),
                 place.node_rank, place.local_rank, device.backend, device.name)
    _make_bookkeeping_group()
    return created


def _make_bookkeeping_group() -> None:
    """A gloo group over all ranks for CPU tensors, unless the default group is gloo already.

    ``new_group`` is collective, and every rank must create groups in one order: this runs
    on the training thread right after joining, before epochs() makes its own groups.
    """
    global _BOOKKEEPING
    if _BOOKKEEPING is None and not _default_is_gloo():
        _BOOKKEEPING = torch.distributed.new_group(backend="gloo")


def _default_is_gloo() -> bool:
    # "gloo", or a multi-backend spec such as "cpu:gloo,cuda:nccl" (CPU tensors go to gloo).
    backend = str(torch.distributed.get_backend())
    return backend == "gloo" or "cpu:gloo" in backend


def bookkeeping_group() -> Any:
    """The group for the run's collectives of CPU tensors and Python objects: metrics, the
    checkpoint at ``--resume``, the start-up barrier (None: the default group, gloo).

    NCCL reduces CUDA tensors only ("No backend type associated with device type cpu"), so
    under NCCL these go through a gloo group of all ranks, made once by
    `init_run_distributed`.

    Raises:
        RuntimeError: the default group cannot reduce CPU tensors and no gloo group was made.
    """
    if _BOOKKEEPING is not None or _default_is_gloo():
        return _BOOKKEEPING
    raise RuntimeError(f"the default process group ({torch.distributed.get_backend()}) cannot "
                       "reduce CPU tensors: join with init_run_distributed(), which makes a gloo "
                       "group for them")


def close_run_distributed(created: bool) -> None:
    """Destroy the bookkeeping group, and the default group when ``created`` (on the training
    thread: see `NodeSync.close`)."""
    global _BOOKKEEPING
    group, _BOOKKEEPING = _BOOKKEEPING, None
    if not dist_initialized():
        return
    if created:
        torch.distributed.destroy_process_group()  # every group, the bookkeeping one too
    elif group is not None:
        torch.distributed.destroy_process_group(group)


def barrier() -> None:
    if dist_initialized():
        torch.distributed.barrier(group=bookkeeping_group())


def mean_across_ranks(metrics: dict[str, Any]) -> dict[str, Any]:
    """Average numeric metrics over all ranks (every rank calls this with the same keys).

    Plain Python numbers in, plain numbers out: the sum runs on the CPU, in the bookkeeping
    group (see `bookkeeping_group`), whatever the training backend.
    """
    if not dist_initialized():
        return metrics
    names = sorted(k for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
    if not names:
        return metrics
    values = torch.tensor([float(metrics[k]) for k in names], dtype=torch.float64)
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.SUM,
                                 group=bookkeeping_group())
    values /= torch.distributed.get_world_size()
    return {**metrics, **{k: float(v) for k, v in zip(names, values.tolist())}}
