"""Release plans: which samples of a snapshot its readers have read, for progressive release.

A lease protects its snapshot until the epoch is over. A lease with a *plan* protects less: a
sample its epoch has delivered to every reader that was to read it is released, and eviction
may take it while the epoch goes on (invariant 1, progressive release). The plan lives in
files beside the LMDB environment, in ``plans/``, named by the lease:

* ``<lease>.seqs.npy``: the snapshot's sequence numbers, sorted (written by the process that
  took the snapshot; a stream's workers and a resumed run rebuild the snapshot from it).
* ``<lease>.<part>.plan``: one per reader group (a DDP rank of the node): its *lanes*, each
  the sequence of samples one reader reads in order (the rank's loop, or one DataLoader worker
  of a stream), and one position per lane, the count of its samples released so far. Readers
  advance their position in place (an aligned 8-byte store into a shared mapping), so
  releasing costs the training loop no transaction and no system call.

A lease says how many parts its plan has (``Lease.plan_parts``); until every part exists it
protects its whole range, as a lease without a plan does. Files are written under a temporary
name and renamed into place, so a reader of the directory sees a whole file or none. They are
removed with their lease (released or reclaimed) and swept when no lease names them.

Part file layout (little-endian u64 words): ``magic, lanes, total``, then ``lanes + 1`` lane
offsets into the data, ``lanes`` positions, and ``total`` sequence numbers.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from collections.abc import Sequence

import numpy as np

from ..limits import AST_LOCK
from ..paths import atomic_write

log = logging.getLogger("epochcache.cache")

PLANS_DIR = "plans"
_MAGIC = int.from_bytes(b"ECPLAN01", "little")
_HEAD = 3  # words before the offsets


def plans_dir(cache_path: str) -> str:
    return os.path.join(cache_path, PLANS_DIR)


def seqs_path(cache_path: str, lease_id: str) -> str:
    return os.path.join(plans_dir(cache_path), f"{lease_id}.seqs.npy")


def part_path(cache_path: str, lease_id: str, part: int) -> str:
    return os.path.join(plans_dir(cache_path), f"{lease_id}.{part}.plan")


def write_seqs(cache_path: str, lease_id: str, seqs: np.ndarray) -> None:
    """Save a snapshot's sequence numbers (sorted) for its plan and its readers."""
    with atomic_write(seqs_path(cache_path, lease_id), suffix=".npy") as f:
        np.save(f, np.ascontiguousarray(seqs, dtype="<u8"))


def read_seqs(cache_path: str, lease_id: str) -> np.ndarray | None:
    """A snapshot's sorted sequence numbers (memory-mapped), or None without a plan."""
    try:
        with AST_LOCK:  # the header is parsed with ast.literal_eval (see limits.AST_LOCK)
            seqs: np.ndarray = np.load(seqs_path(cache_path, lease_id), mmap_mode="r")
    except (OSError, ValueError):
        return None
    return seqs


def write_part(cache_path: str, lease_id: str, part: int, lanes: Sequence[np.ndarray]) -> None:
    """Save one part of a plan: the lanes its readers read, all positions at 0. An existing
    part is kept as it is (its readers may have advanced; the lanes are the same)."""
    path = part_path(cache_path, lease_id, part)
    if os.path.exists(path):
        return
    sizes = [len(lane) for lane in lanes]
    offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype("<u8")
    head = np.array([_MAGIC, len(lanes), int(offsets[-1])], dtype="<u8")
    positions = np.zeros(len(lanes), dtype="<u8")
    data = [np.ascontiguousarray(lane, dtype="<u8") for lane in lanes]
    with atomic_write(path) as f:
        for chunk in (head, offsets, positions, *data):
            f.write(chunk.tobytes())


class Part:
    """One part file, mapped: its lanes (read-only views) and their positions (shared).

    Args:
        path: the part file.
        writable: map it for writing positions (a reader of the plan); else read-only.

    Raises:
        OSError: the file is missing or unreadable.
        ValueError: the file is not a plan part (damaged, or of another version).
    """

    def __init__(self, path: str, *, writable: bool = False) -> None:
        with open(path, "r+b" if writable else "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0,
                                  access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        words = np.frombuffer(self._map, dtype="<u8")
        if len(words) < _HEAD or int(words[0]) != _MAGIC:
            raise ValueError(f"{path}: not a plan part")
        lanes, total = int(words[1]), int(words[2])
        if len(words) != _HEAD + (lanes + 1) + lanes + total:
            raise ValueError(f"{path}: plan part of the wrong size")
        self.offsets = words[_HEAD : _HEAD + lanes + 1]
        self.positions = words[_HEAD + lanes + 1 : _HEAD + 2 * lanes + 1]
        self.data = words[_HEAD + 2 * lanes + 1 :]
        self.lanes = lanes

    def lane(self, index: int) -> np.ndarray:
        return self.data[int(self.offsets[index]) : int(self.offsets[index + 1])]


class Releaser:
    """What a reader of a plan holds: its part, mapped for writing, and its lane.

    Opening is lazy and failures are quiet (logged once): a plan that cannot be opened only
    means the samples stay protected until the lease ends.

    Args:
        cache_path: the cache directory.
        lease_id: the lease whose plan this is.
        part: the reader's part (its rank's slot on the node).
        lane: the reader's lane in the part.
    """

    def __init__(self, cache_path: str, lease_id: str, part: int, lane: int) -> None:
        self.path = part_path(cache_path, lease_id, part)
        self.lane = lane
        self._part: Part | None = None
        self._failed = False
        # This lane's position word (a view into the mapping) and length: a release, once per
        # batch on the training thread, is a comparison and an 8-byte store.
        self._word: memoryview | None = None
        self._length = 0
        self._released = 0

    def _open(self) -> bool:
        if self._failed:
            return False
        try:
            part = Part(self.path, writable=True)
        except (OSError, ValueError) as exc:
            self._failed = True
            log.warning("%s: cannot release samples progressively (%s); they stay protected "
                        "until the epoch ends", self.path, exc)
            return False
        self._part = part
        self._length = int(part.offsets[self.lane + 1] - part.offsets[self.lane])
        self._word = part.positions[self.lane : self.lane + 1].data.cast("B").cast("Q")
        self._released = int(self._word[0])
        return True

    def release(self, position: int) -> None:
        """The first ``position`` samples of this reader's lane are read: release them."""
        if self._word is None and not self._open():
            return
        if position > self._released:
            self._released = min(position, self._length)
            self._word[0] = self._released  # type: ignore[index]

    def __getstate__(self) -> dict[str, object]:
        return {"path": self.path, "lane": self.lane, "_part": None, "_failed": False,
                "_word": None, "_length": 0, "_released": 0}


def remove_plan(cache_path: str, lease_id: str) -> None:
    """Delete a lease's plan files (its lease is gone)."""
    directory = plans_dir(cache_path)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for name in names:
        if name.startswith(lease_id + "."):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))


def sweep_plans(cache_path: str, live: set[str]) -> list[str]:
    """Delete plan files of leases not in ``live``; return the lease ids swept."""
    directory = plans_dir(cache_path)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    swept: set[str] = set()
    for name in names:
        lease_id = name.split(".", 1)[0]
        if lease_id and lease_id not in live and not name.startswith(".tmp-"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
            swept.add(lease_id)
    return sorted(swept)
