"""Checkpoints of ``epochcache run``: at epoch ends and mid-epoch, agreed across ranks.

**Writing.** Only global rank 0 writes the run directory (`save_checkpoint`, atomically).
Between two batches, every ``train.checkpoint_every_s`` seconds and when the run is asked to
stop (SIGTERM from a scheduler, Ctrl-C), `MidEpoch` saves the model, the optimizer and each
rank's [`EpochLoader.state_dict`][epochcache.data.epoch_loader.EpochLoader.state_dict] (the
epoch's lease and the rank's position in its order). Then, and only then, the samples the
checkpoint covers are released for eviction (``release_as_consumed`` is off): everything after
the checkpoint is still cached when the job dies, and the epoch's lease outlives it for
``cache.resume_grace_s``. Under torch.distributed the ranks agree at every batch boundary (one
small all-reduce) whether a checkpoint is due or a rank is stopping, so all of them save at
the same batch, and stop together.

**Resuming.** With ``train.run_dir`` on a shared filesystem every rank reads the same file at
``--resume``; without one (each node on its own disk) a node's run directory may hold no
checkpoint, or an older one, and ranks that computed their own start epoch waited for each
other's epochs forever. So under torch.distributed rank 0 decides (`resume_checkpoint`): every
rank resumes from rank 0's checkpoint (or, when rank 0 has none, starts fresh). A rank whose
own file is byte-identical (same SHA-256) reads it; the others receive the bytes from rank 0.
Rank 0 logs which checkpoint each rank used. Loading is ``weights_only``, onto the CPU: a
checkpoint written on a GPU resumes on a CPU-only node (and on another GPU), and
``load_state_dict`` copies the tensors to wherever the model and optimizer live. Each rank gets
every rank's loader state back (`loader_states`, ``epochs(resume=...)``): the same snapshot,
the same order, from the next sample -- on another number of ranks or nodes too (the rest
dealt anew).

The collectives run in the run's bookkeeping group (gloo, also under NCCL: CPU objects).
"""

from __future__ import annotations

import hashlib
import io
import logging
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import CheckpointError
from ..paths import atomic_write

if TYPE_CHECKING:
    from .signals import StopSignals

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"
#: The checkpoint key of a mid-epoch checkpoint: ``{"epoch", "batches", "loaders": {rank:
#: state}}``; ``epoch`` of the checkpoint stays the last epoch completed.
RESUME_KEY = "resume"
#: The key of a mid-epoch checkpoint's staged coverage: every rank's token
#: (`epochcache.coverage.staged`), counted once the checkpoint is written, or at the resume.
COVERAGE_KEY = "coverage"


def save_checkpoint(run_dir: Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` to ``run_dir/checkpoint.pt`` atomically (a crash mid-save leaves the
    previous checkpoint whole)."""
    import torch

    path = run_dir / CHECKPOINT
    with atomic_write(path, prefix=".checkpoint-", durable=True) as f:
        torch.save(payload, f)
    return path


def _load(data: bytes, origin: str) -> dict[str, Any]:
    import torch

    try:
        checkpoint = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file: name it
        raise CheckpointError(f"{origin}: cannot load the checkpoint ({type(exc).__name__}: "
                              f"{exc}); delete it to start afresh, or restore a good copy") from exc
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("epoch"), int):
        raise CheckpointError(f"{origin}: not an epochcache checkpoint (no epoch number)")
    return dict(checkpoint)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the checkpoint: {exc}") from exc


def load_checkpoint(run_dir: Path) -> dict[str, Any] | None:
    """This process's ``run_dir/checkpoint.pt``, or None.

    Raises:
        CheckpointError: the file exists but cannot be read or loaded.
    """
    path = run_dir / CHECKPOINT
    data = _read(path)
    return None if data is None else _load(data, str(path))


def resume_checkpoint(run_dir: Path, node_rank: int = 0) -> dict[str, Any] | None:
    """The checkpoint to resume from: this process's, or under torch.distributed rank 0's.

    Every rank must call it (collectives on the default group). A failure to read rank 0's
    checkpoint is raised on every rank alike, so no rank is left waiting.

    Raises:
        CheckpointError: rank 0's checkpoint cannot be read or loaded.
    """
    from ..placement import dist_initialized

    if not dist_initialized():
        return load_checkpoint(run_dir)
    import torch.distributed as dist

    from .process_group import bookkeeping_group

    if dist.get_world_size() == 1:
        return load_checkpoint(run_dir)
    rank, path = dist.get_rank(), run_dir / CHECKPOINT
    try:
        data = _read(path)
        error = None
    except CheckpointError as exc:
        data, error = None, str(exc)
    own = None if data is None else hashlib.sha256(data).hexdigest()
    decision: list[Any] = [None]
    loaded = None
    if rank == 0:
        digest = epoch = None
        if error is None and data is not None:
            try:
                loaded = _load(data, str(path))
                epoch, digest = loaded["epoch"], own
            except CheckpointError as exc:
                error = str(exc)
        decision[0] = {"error": error, "path": str(path), "digest": digest, "epoch": epoch}
    group = bookkeeping_group()
    dist.broadcast_object_list(decision, src=0, group=group)
    chosen = decision[0]
    if chosen["error"] is not None:
        raise CheckpointError(f"--resume: rank 0's checkpoint: {chosen['error']}")
    mine = own is not None and own == chosen["digest"]
    if mine:
        state = "read it"
    elif chosen["digest"] is None:
        state = "ignored its own" if data is not None else "has none"
    else:
        state = ("received it from rank 0 "
                 f"({'another checkpoint' if data is not None else 'none'} in {path})")
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, (node_rank, state), group=group)
    if chosen["digest"] is None:
        if rank == 0 and any(s == "ignored its own" for _n, s in states):
            log.warning("--resume: rank 0 has no checkpoint in %s, so every rank starts at epoch "
                        "0; ranks %s have one in their own run directory, which is ignored (rank "
                        "0 writes checkpoints: put train.run_dir on a shared filesystem, or keep "
                        "rank 0's)", run_dir,
                        [r for r, (_n, s) in enumerate(states) if s == "ignored its own"])
        return None
    if any(s != "read it" for _n, s in states):
        payload: list[Any] = [data if rank == 0 else None]
        dist.broadcast_object_list(payload, src=0, group=group)
        if not mine:
            data = payload[0]
    if rank == 0:
        log.info("--resume: epoch %d from rank 0's checkpoint %s (sha256 %s): %s",
                 chosen["epoch"] + 1, chosen["path"], chosen["digest"][:12],
                 "; ".join(f"rank {r} (node {n}) {s}" for r, (n, s) in enumerate(states)))
    if loaded is not None:
        return loaded
    if data is None:  # neither read nor received: cannot happen, but never load nothing
        raise CheckpointError(f"--resume: rank {rank} got no copy of {chosen['path']}")
    return _load(data, f"rank 0's checkpoint {chosen['path']}")


class Checkpoints(Protocol):
    """What saves a checkpoint: the run's `RunContext` (typed here by what is called, so that
    context, which holds a `MidEpoch`, and this module import each other in one direction)."""

    def save_checkpoint(self, epoch: int, metrics: Mapping[str, Any],
                        resume: Mapping[str, Any] | None = None) -> Path: ...


class MidEpoch:
    """Saves mid-epoch checkpoints of one epoch (see the module docstring).

    Args:
        context: the trainer's context (what it registered for checkpoints).
        loader: the epoch's [`EpochLoader`][epochcache.data.epoch_loader.EpochLoader].
        epoch: the epoch.
        every_s: seconds between checkpoints.
        grace_s: how long the epoch's lease outlives a dead run (``cache.resume_grace_s``).
        stop: the run's stop request (a stop is checkpointed before the run stops).
        rank: this process's global rank; ``is_main`` writes the file.
    """

    def __init__(self, context: Checkpoints, loader: Any, epoch: int, *, every_s: float,
                 grace_s: float, stop: StopSignals, rank: int, is_main: bool) -> None:
        self.context, self.loader, self.epoch = context, loader, epoch
        self.every_s, self.grace_s, self.stop = every_s, grace_s, stop
        self.rank, self.is_main = rank, is_main
        self.last = time.monotonic()
        self.saved_batches = 0
        self._kept = False
        #: Called with the batches a checkpoint is about to cover, before it is saved (the
        #: run records what the epoch trained on: its manifest, its coverage staged; see
        #: coverage/manifests.py); returns the staged coverage's token, which the checkpoint names.
        self.on_save: Callable[[int], str | None] | None = None
        #: Called once the checkpoint is written, on every rank (the staged coverage counted).
        self.on_saved: Callable[[], None] | None = None
        loader.release_as_consumed = False  # released as checkpoints cover them

    def at_boundary(self, batches: int) -> None:
        """Between two batches, ``batches`` done: save if a checkpoint is due (or the run
        stops); under DDP every rank decides the same, and a stop on one rank stops all."""
        due = time.monotonic() - self.last >= self.every_s
        stopping = self.stop.requested
        from ..placement import dist_initialized

        if dist_initialized():
            due, stopping = _agree(due, stopping)
            if stopping and not self.stop.requested:
                self.stop.request(signal.SIGTERM)  # a peer was told to stop: stop together
        if (due or stopping) and batches > self.saved_batches:
            self.save(batches)

    def save(self, batches: int) -> None:
        # Written whole whatever signal follows: a stop's checkpoint is the resume's only
        # exact point (the last periodic one is older).
        with self.stop.writing(f"the checkpoint of epoch {self.epoch} after {batches} batches"):
            self._save(batches)
        log.debug("epoch %d: checkpoint after %d batches", self.epoch, batches)

    def _save(self, batches: int) -> None:
        token = self.on_save(batches) if self.on_save is not None else None
        state = self.loader.state_dict()
        everyone = _gather({str(self.rank): (state, token)})
        if not self._kept:
            self.loader.keep_for_resume(self.grace_s)  # the node's leader holds the lease
            self._kept = True
        if self.is_main:
            self.context.save_checkpoint(self.epoch - 1, {}, resume={
                "epoch": self.epoch, "batches": batches,
                "loaders": {rank: pair[0] for rank, pair in everyone.items()},
                COVERAGE_KEY: sorted(pair[1] for pair in everyone.values() if pair[1])})
        from .process_group import barrier

        barrier()  # the file is written before any rank lets the samples go
        self.loader.release(batches)
        if self.on_saved is not None:
            self.on_saved()
        self.saved_batches, self.last = batches, time.monotonic()


def _agree(due: bool, stopping: bool) -> tuple[bool, bool]:
    import torch
    import torch.distributed as dist

    from .process_group import bookkeeping_group

    flags = torch.tensor([int(due), int(stopping)], dtype=torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=bookkeeping_group())
    return bool(flags[0]), bool(flags[1])


def _gather(mine: dict[str, Any]) -> dict[str, Any]:
    from ..placement import dist_initialized

    if not dist_initialized():
        return mine
    import torch.distributed as dist

    from .process_group import bookkeeping_group

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine, group=bookkeeping_group())
    return {rank: state for part in everyone for rank, state in part.items()}


def checkpointed_coverage(checkpoint: dict[str, Any] | None) -> tuple[int, set[str]]:
    """What a checkpoint covers of the coverage staged before it: every epoch before the
    first one it resumes, and the staged updates its mid-epoch part names."""
    if checkpoint is None:
        return 0, set()
    mid = checkpoint.get(RESUME_KEY) or {}
    if mid.get("loaders"):
        return int(mid["epoch"]), {str(token) for token in mid.get(COVERAGE_KEY) or ()}
    return int(checkpoint["epoch"]) + 1, set()


def loader_states(checkpoint: dict[str, Any] | None) -> dict[str, Any] | None:
    """Every rank's loader state in a mid-epoch checkpoint, by global rank (None: none). Every
    rank resumes from all of them (``epochs(resume=...)``): on the layout that checkpointed,
    each continues its own lane; on another number of ranks per node or of nodes, each node's
    rest is dealt anew to its ranks and what stayed on nodes that did not come back is
    counted (see `epochcache.data.resume`)."""
    mid = (checkpoint or {}).get(RESUME_KEY)
    if not mid or not mid.get("loaders"):
        return None
    return {str(rank): dict(state) for rank, state in mid["loaders"].items()}
