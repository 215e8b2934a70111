"""Checkpoints of ``epochcache run``: writing one, and agreeing on one across ranks at --resume.

Only global rank 0 writes the run directory. With ``train.run_dir`` on a shared filesystem every
rank reads the same file at ``--resume``; without one (each node on its own disk) a node's run
directory may hold no checkpoint, or an older one, and ranks that computed their own start
epoch waited for each other's epochs forever. So under torch.distributed rank 0 decides: every
rank resumes from rank 0's checkpoint (or, when rank 0 has none, starts fresh). A rank whose
own file is byte-identical (same SHA-256) reads it; the others receive the bytes from rank 0.
Rank 0 logs which checkpoint each rank used. Loading is ``weights_only`` either way, onto the
CPU: a checkpoint written on a GPU resumes on a CPU-only node (and on another GPU), and
``load_state_dict`` copies the tensors to wherever the model and optimizer live. The agreement
runs in the run's bookkeeping group (gloo, also under NCCL: these are CPU objects).
"""

from __future__ import annotations

import hashlib
import io
import logging
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..paths import atomic_write

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"


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
