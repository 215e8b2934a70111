"""The rank's device and the process group of ``epochcache run``.

**The device** is a pure function of what the launcher and the machine say (`choose_device`,
tested on CPU-only machines):

* no CUDA device visible: the CPU and gloo, as on every CPU-only node;
* CUDA: ``cuda:LOCAL_RANK`` (each rank of a node its own GPU, as torchrun's examples do) and NCCL
  (gloo where torch was built without NCCL: it also reduces CUDA tensors, slower). A process that
  sees a single GPU uses it whatever its local rank: a launcher that gives each rank its own GPU
  (Slurm's ``--gpus-per-task=1``, ``CUDA_VISIBLE_DEVICES`` set per rank) shows each rank one
  device, index 0. A local rank with no GPU of its own is an error naming the fix, never a
  second rank on a GPU already taken (NCCL refuses two ranks on one GPU).

``CUDA_VISIBLE_DEVICES=""`` keeps a run on the CPU on a GPU node.

**The process group.** A job is joined (`init_run_distributed`) when the launcher says there is
one (`joins_job`): more than one rank, or torchrun's complete ``env://`` variables
(``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``) even for a single rank, so that
``torchrun --nproc-per-node 1`` runs the same code path (DDP, NCCL) as a larger job. On CUDA the
rank's GPU is its current device before the default group exists, and the group is NCCL, bound
to that device. NCCL reduces CUDA tensors only, so the run's own collectives of CPU tensors and
Python objects (metrics, the start-up barrier, the checkpoint agreed at ``--resume``) go through
`bookkeeping_group`, a gloo group of all ranks made once, right after joining. (The loaders'
collectives are the data layer's: `epochcache.data.distributed`.)

torch is imported by the functions that use it: ``epochcache run`` imports this module before
torch, so that a bad config or source fails before the seconds that import takes.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import NodeLayoutError
from ..placement import Placement, dist_initialized

log = logging.getLogger(__name__)

#: The variables of torch.distributed's ``env://`` rendezvous (torchrun sets all four).
ENV_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


@dataclass(frozen=True)
class RunDevice:
    """Where this rank computes, and the backend of its process group.

    Attributes:
        type: ``"cpu"`` or ``"cuda"``.
        index: the CUDA device index; None on the CPU.
        backend: ``"gloo"`` or ``"nccl"``.
    """

    type: str = "cpu"
    index: int | None = None
    backend: str = "gloo"

    @property
    def name(self) -> str:
        """``"cpu"`` or ``"cuda:N"`` (what ``torch.device`` takes)."""
        return self.type if self.index is None else f"{self.type}:{self.index}"

    @property
    def is_cuda(self) -> bool:
        return self.type == "cuda"


CPU = RunDevice()


def choose_device(place: Placement, *, cuda_devices: int, nccl_available: bool,
                  visible: str | None = None) -> RunDevice:
    """This rank's device and backend (see the module docstring for the rules).

    Args:
        place: this process's place (its local rank picks the GPU).
        cuda_devices: ``torch.cuda.device_count()`` when CUDA is available, else 0.
        nccl_available: ``torch.distributed.is_nccl_available()``.
        visible: ``CUDA_VISIBLE_DEVICES``, only for the error message.

    Raises:
        NodeLayoutError: CUDA is there but this local rank has no GPU of its own.
    """
    if cuda_devices <= 0:
        return CPU
    if place.local_rank < cuda_devices:
        index = place.local_rank
    elif cuda_devices == 1:
        index = 0  # one GPU per process: the launcher bound each rank to its own
    else:
        shown = "unset" if visible is None else repr(visible)
        raise NodeLayoutError(
            f"local rank {place.local_rank} of {place.local_world_size} on node {place.node_rank} "
            f"has no GPU of its own: this process sees {cuda_devices} CUDA devices "
            f"(CUDA_VISIBLE_DEVICES {shown}); start at most {cuda_devices} ranks per node "
            f"(torchrun --nproc-per-node {cuda_devices}), give each rank its own GPU, or set "
            "CUDA_VISIBLE_DEVICES=\"\" to train on the CPU")
    return RunDevice("cuda", index, "nccl" if nccl_available else "gloo")


def joins_job(place: Placement, environ: Mapping[str, str]) -> bool:
    """Whether ``epochcache run`` joins a torch.distributed job: more than one rank, or a
    launcher's complete ``env://`` rendezvous for one (``torchrun --nproc-per-node 1``)."""
    return place.distributed or all(environ.get(name, "").strip() for name in ENV_RENDEZVOUS)


#: The gloo group of `bookkeeping_group` when the default group is not gloo (NCCL).
_BOOKKEEPING: Any = None


def select_device(place: Placement) -> RunDevice:
    """This rank's device and backend on this machine (`choose_device`).

    Raises:
        NodeLayoutError: CUDA is there but this local rank has no GPU of its own.
    """
    import torch

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
    import torch

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
    import torch

    global _BOOKKEEPING
    if _BOOKKEEPING is None and not _default_is_gloo():
        _BOOKKEEPING = torch.distributed.new_group(backend="gloo")


def _default_is_gloo() -> bool:
    import torch

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
    import torch

    if _BOOKKEEPING is not None or _default_is_gloo():
        return _BOOKKEEPING
    raise RuntimeError(f"the default process group ({torch.distributed.get_backend()}) cannot "
                       "reduce CPU tensors: join with init_run_distributed(), which makes a gloo "
                       "group for them")


def close_run_distributed(created: bool) -> None:
    """Destroy the bookkeeping group, and the default group when ``created`` (on the training
    thread: see `NodeSync.close`)."""
    import torch

    global _BOOKKEEPING
    group, _BOOKKEEPING = _BOOKKEEPING, None
    if not dist_initialized():
        return
    if created:
        torch.distributed.destroy_process_group()  # every group, the bookkeeping one too
    elif group is not None:
        torch.distributed.destroy_process_group(group)


def barrier() -> None:
    import torch

    if dist_initialized():
        torch.distributed.barrier(group=bookkeeping_group())


def mean_across_ranks(metrics: dict[str, Any]) -> dict[str, Any]:
    """Average numeric metrics over all ranks (every rank calls this with the same keys).

    Plain Python numbers in, plain numbers out: the sum runs on the CPU, in the bookkeeping
    group (see `bookkeeping_group`), whatever the training backend.
    """
    import torch

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
