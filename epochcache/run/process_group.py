"""The process group of ``epochcache run``: joining the launcher's job, and the run's own
collectives.

``epochcache run`` joins the launcher's job with `init_run_distributed`: on CUDA the rank's
GPU is its current device before the default group exists, and the group is NCCL, bound to that
device. NCCL reduces CUDA tensors only, so the run's own collectives of CPU tensors and Python
objects (metrics, the start-up barrier, the checkpoint agreed at ``--resume``) go through
`bookkeeping_group`, a gloo group of all ranks made once, right after joining. (The loaders'
collectives are the data layer's: `epochcache.data.distributed`.)
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any

import torch

from ..errors import NodeLayoutError
from ..placement import Placement, dist_initialized
from .devices import CPU, RunDevice, choose_device

log = logging.getLogger(__name__)

#: The gloo group of `bookkeeping_group` when the default group is not gloo (NCCL).
_BOOKKEEPING: Any = None


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
        if place.launcher == "slurm":  # srun's tasks: no RANK or WORLD_SIZE for env://
            kwargs.update(rank=place.rank, world_size=place.world_size)
            _require_rendezvous(place)
        torch.distributed.init_process_group(backend=device.backend, **kwargs)
        created = True
        log.info("joined the %s job: rank %d of %d (node %d, local rank %d), backend %s, "
                 "device %s", place.launcher, torch.distributed.get_rank(),
                 torch.distributed.get_world_size(),
                 place.node_rank, place.local_rank, device.backend, device.name)
    _make_bookkeeping_group()
    return created


def _require_rendezvous(place: Placement) -> None:
    """Under srun (no torchrun) the batch script says where rank 0 listens.

    Raises:
        NodeLayoutError: ``MASTER_ADDR`` or ``MASTER_PORT`` is not set.
    """
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise NodeLayoutError(
            f"srun: rank {place.rank} of {place.world_size}: {' and '.join(missing)} not set: "
            "export them in the batch script, before srun (e.g. export MASTER_ADDR=$(scontrol "
            "show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1) MASTER_PORT=29500; see "
            "docs/howto/multi-node.md)")


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
