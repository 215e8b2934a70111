"""Where this process sits in a multi-process launch, read from the launcher's environment.

Which ranks share a node decides which ranks share a cache: one snapshot per node is split
across that node's ranks, so ranks wrongly taken for one node would read one node's snapshot
from another node's cache (``KeyError``, or silently other samples). The layout is therefore
read, never guessed, from one of two launchers:

* **torchrun** (and anything that sets its variables): ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and
  ``GROUP_RANK`` (the node), with ``GROUP_WORLD_SIZE`` the number of nodes;
* **Slurm's srun**, one task per rank: ``SLURM_NODEID``, ``SLURM_LOCALID`` and the tasks on this
  node (``SLURM_TASKS_PER_NODE``, e.g. ``4(x2),2``, or ``SLURM_NTASKS_PER_NODE``), with
  ``SLURM_NNODES`` nodes. They describe this launch only when ``SLURM_PROCID``/``SLURM_NTASKS``
  match the job's rank and size (under ``srun torchrun ...`` they describe the torchrun agents,
  and torchrun's own variables are used). Without ``RANK`` and ``WORLD_SIZE``, a task of an
  ``srun`` step of several tasks (``SLURM_STEP_ID`` set: not the batch script, whose
  ``SLURM_PROCID`` is 0 of the job's ``SLURM_NTASKS``) is rank ``SLURM_PROCID`` of
  ``SLURM_STEP_NUM_TASKS`` (`srun_rank`).

A distributed job (more than one rank) with neither raises [`NodeLayoutError`][epochcache.NodeLayoutError] naming the
variables to set. The variables are read when called, never at import; no torch here:
`detect_placement` asks torch.distributed for the rank only when it is already imported and
initialised.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import NodeLayoutError

TORCHRUN_VARS = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
SLURM_VARS = ("SLURM_NODEID", "SLURM_LOCALID", "SLURM_TASKS_PER_NODE")

_HOW_TO = (
    "launch with torchrun, or under Slurm with srun (one task per rank), or set LOCAL_RANK, "
    "LOCAL_WORLD_SIZE and GROUP_RANK (this node's index) for every rank"
)


@dataclass(frozen=True)
class Placement:
    """This process's place: global rank, its node, its rank within the node.

    ``num_nodes`` is None when the launcher does not say (torchrun on nodes of unequal size).
    ``launcher`` names where the layout came from: ``torchrun``, ``slurm`` or ``single``.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int | None = 1
    launcher: str = "single"

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def env_int(environ: Mapping[str, str], name: str) -> int | None:
    """The integer value of ``name``, None when unset or empty.

    Raises:
        NodeLayoutError: the value is not an integer.
    """
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise NodeLayoutError(f"environment variable {name}={raw!r} is not an integer (set by "
                              "the launcher: unset it or fix it)") from None


def tasks_on_node(spec: str, node: int) -> int | None:
    """Tasks on node ``node`` from Slurm's ``SLURM_TASKS_PER_NODE`` (``"4(x2),2"``)."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node] if 0 <= node < len(counts) else None


def _torchrun(environ: Mapping[str, str], rank: int, world_size: int) -> Placement | None:
    values = {name: env_int(environ, name) for name in TORCHRUN_VARS}
    missing = [name for name, value in values.items() if value is None]
    if len(missing) == len(TORCHRUN_VARS):
        return None
    if missing:
        raise NodeLayoutError(
            f"rank {rank} of {world_size}: {', '.join(missing)} not set while "
            f"{', '.join(n for n in TORCHRUN_VARS if n not in missing)} are: which ranks share "
            f"a node cannot be known; {_HOW_TO}")
    local_rank, local_size, node = (int(values[n] or 0) for n in TORCHRUN_VARS)  # all set
    nodes = env_int(environ, "GROUP_WORLD_SIZE")
    if nodes is None and world_size % max(local_size, 1) == 0:
        nodes = world_size // local_size
    return Placement(rank, world_size, local_rank, local_size, node, nodes, "torchrun")


def _slurm(environ: Mapping[str, str], rank: int, world_size: int) -> Placement | None:
    node, local_rank = env_int(environ, "SLURM_NODEID"), env_int(environ, "SLURM_LOCALID")
    if node is None or local_rank is None:
        return None
    procid, ntasks = env_int(environ, "SLURM_PROCID"), env_int(environ, "SLURM_NTASKS")
    if (procid is not None and procid != rank) or (ntasks is not None and ntasks != world_size):
        # Slurm's tasks are not this job's ranks (e.g. one srun task per node starting ranks
        # of its own): its variables say nothing about how the ranks are placed.
        return None
    spec = environ.get("SLURM_TASKS_PER_NODE", "")
    local_size = tasks_on_node(spec, node) if spec else env_int(environ, "SLURM_NTASKS_PER_NODE")
    if local_size is None:
        return None
    nodes = env_int(environ, "SLURM_STEP_NUM_NODES") or env_int(environ, "SLURM_NNODES")
    return Placement(rank, world_size, local_rank, local_size, node, nodes, "slurm")


def srun_rank(environ: Mapping[str, str]) -> tuple[int, int] | None:
    """``(rank, world size)`` of a task of an ``srun`` step of several tasks, None elsewhere
    (the batch script itself, a step of one task, no Slurm)."""
    if environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID", "")).strip() == "":
        return None
    procid = env_int(environ, "SLURM_PROCID")
    ntasks = env_int(environ, "SLURM_STEP_NUM_TASKS") or env_int(environ, "SLURM_NTASKS")
    if procid is None or ntasks is None or ntasks <= 1:
        return None
    return procid, ntasks


def read_placement(environ: Mapping[str, str], rank: int | None = None,
                   world_size: int | None = None) -> Placement:
    """This process's place from the launcher's environment (see the module docstring).

    Args:
        environ: the environment (``os.environ``).
        rank: the global rank when known otherwise (torch.distributed); else ``RANK`` (else an
            ``srun`` task's, `srun_rank`).
        world_size: the job's size when known otherwise; else ``WORLD_SIZE`` (or srun's).

    Raises:
        NodeLayoutError: a distributed job whose node layout is unknown or inconsistent.
    """
    if rank is None and world_size is None and "RANK" not in environ \
            and "WORLD_SIZE" not in environ:
        rank, world_size = srun_rank(environ) or (None, None)
    if rank is None:
        rank = env_int(environ, "RANK") or 0
    if world_size is None:
        world_size = env_int(environ, "WORLD_SIZE") or 1
    if world_size <= 1:
        return Placement()
    place = _torchrun(environ, rank, world_size) or _slurm(environ, rank, world_size)
    if place is None:
        raise NodeLayoutError(
            f"rank {rank} of {world_size}: which ranks share a node (and its cache) is unknown: "
            f"neither torchrun's {', '.join(TORCHRUN_VARS)} nor Slurm's "
            f"{', '.join(SLURM_VARS)} (for this job's SLURM_PROCID/SLURM_NTASKS) are set; "
            f"{_HOW_TO}")
    if not (0 <= place.local_rank < place.local_world_size and 0 <= rank < world_size
            and place.node_rank >= 0
            and (place.num_nodes is None or place.node_rank < place.num_nodes)):
        raise NodeLayoutError(
            f"inconsistent {place.launcher} environment: rank {rank} of {world_size}, local rank "
            f"{place.local_rank} of {place.local_world_size}, node {place.node_rank} of "
            f"{place.num_nodes}")
    return place


def read_node(environ: Mapping[str, str]) -> tuple[int, int]:
    """``(node, nodes)`` for a process outside the ranks (a node's daemon and samplers), from
    torchrun's ``GROUP_RANK`` and ``GROUP_WORLD_SIZE`` (or ``WORLD_SIZE // LOCAL_WORLD_SIZE``),
    else a distributed launch's `read_placement`; ``(0, 1)`` outside a distributed launch.

    Raises:
        NodeLayoutError: a launch that says the one and not the other, or no number of nodes.
    """
    node, nodes = env_int(environ, "GROUP_RANK"), env_int(environ, "GROUP_WORLD_SIZE")
    world, local = env_int(environ, "WORLD_SIZE") or 1, env_int(environ, "LOCAL_WORLD_SIZE")
    if nodes is None and local and world % local == 0:
        nodes = world // local  # torchrun: every node runs LOCAL_WORLD_SIZE ranks
    if node is not None or nodes is not None:
        if node is None or nodes is None:
            raise NodeLayoutError(
                f"{'GROUP_RANK' if node is None else 'the number of nodes'} is unknown: set "
                "GROUP_RANK and GROUP_WORLD_SIZE (or EPOCHCACHE_NODE_RANK and "
                "EPOCHCACHE_NUM_NODES)")
        return node, nodes
    if world <= 1:
        return 0, 1  # a daemon on its own: one node unless told otherwise
    place = read_placement(environ)  # a distributed launch says where it is, or raises
    if place.num_nodes is None:
        raise NodeLayoutError(
            f"the number of nodes is unknown ({place.launcher}: node {place.node_rank}, "
            f"{place.world_size} ranks); set GROUP_WORLD_SIZE or EPOCHCACHE_NUM_NODES")
    return place.node_rank, place.num_nodes


def dist_initialized() -> bool:
    # Not imported: nothing can have initialised it. `epochcache run` checks its config and
    # lists the source before paying ~1.5 s for importing torch.
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.distributed.is_available()
                and torch.distributed.is_initialized())


def detect_placement() -> Placement:
    """Read the launcher's variables now; with torch.distributed initialised its rank wins.

    Raises:
        NodeLayoutError: a distributed job whose node layout the environment does not give, or
            a variable that is not an integer or contradicts the others.
    """
    rank = world_size = None
    if dist_initialized():
        # Imported already (dist_initialized says so): looked up, not imported, so this base
        # module imports no torch.
        dist = sys.modules["torch"].distributed
        rank, world_size = dist.get_rank(), dist.get_world_size()
    return read_placement(os.environ, rank, world_size)
