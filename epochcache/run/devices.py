"""Which device a rank of ``epochcache run`` computes on, and which backend joins its job.

The decision is a pure function of what the launcher and the machine say (`choose_device`),
so that it is tested on CPU-only machines; `epochcache.run.process_group.init_run_distributed`
applies it with torch. The rules:

* no CUDA device visible: the CPU and gloo, as on every CPU-only node;
* CUDA: ``cuda:LOCAL_RANK`` (each rank of a node its own GPU, as torchrun's examples do) and NCCL
  (gloo where torch was built without NCCL: it also reduces CUDA tensors, slower). A process that
  sees a single GPU uses it whatever its local rank: a launcher that gives each rank its own GPU
  (Slurm's ``--gpus-per-task=1``, ``CUDA_VISIBLE_DEVICES`` set per rank) shows each rank one
  device, index 0. A local rank with no GPU of its own is an error naming the fix, never a
  second rank on a GPU already taken (NCCL refuses two ranks on one GPU).

``CUDA_VISIBLE_DEVICES=""`` keeps a run on the CPU on a GPU node. A job is joined when the launcher
says there is one: more than one rank, or torchrun's complete ``env://`` variables (``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``) even for a single rank, so that ``torchrun
--nproc-per-node 1`` runs the same code path (DDP, NCCL) as a larger job. No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import NodeLayoutError
from ..placement import Placement

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
