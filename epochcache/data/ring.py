"""The batch ring: shared-memory batch buffers a DataLoader worker reuses from batch to batch.

DataLoader hands each batch a worker makes to the trainer as a new shared-memory segment: the
worker creates it and faults in every page while writing, torch passes its descriptor over a
socket, the trainer maps it and unmaps it again when the batch dies. For a batch of 64 samples
of 64 KiB that is 0.5-1 ms, more than reading the batch (``scripts/bench_loader.py --rows``).

Here each worker keeps a few *slots*: shared segments it writes batches into again and again.
The trainer receives a slot's segment the first time it is used, and after that only a message
naming the slot (`hand_off`). The trainer's batch is a tensor over the slot; once nothing in
the trainer refers to it any more (no tensor, view or numpy array over it: a weak reference to
the buffer the tensor was made from tells), the trainer writes "free" into the slot's first
byte, which the worker reads before writing the slot again. A batch the worker never hands off
(a read that fell back to another path) frees its slot in the worker the same way.

Only `epochcache.data.schedule.SeqBatches` (the loaders of ``epochs()``) takes slots, inside
`epochcache.data.collate.batch_buffers`: a batch that leaves a worker any other way than through `hand_off` (a user's
own DataLoader over ``cache.dataset()``) is allocated the usual way. A worker that finds no free
slot and has reached its bound (`MAX_SLOTS`, `MAX_BYTES`) allocates the usual way too, so a
training loop that keeps batches costs memory, never a wait.

The trainer's side keeps each worker's slots mapped until that worker has exited
(`forget_exited`, called by ``epochs()`` once its loaders are shut down).
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from typing import Any

import numpy as np
import torch

from ..paths import pid_alive

#: A slot's data starts here (cache-line aligned); its byte 0 is its state.
_DATA = 64
_FREE, _USED = 0, 1
#: Bounds of one worker's ring: slots (a few batches in flight, each tensor of a batch in a
#: slot of its own) and bytes of shared memory.
MAX_SLOTS = 16
MAX_BYTES = 256 << 20
_ROUND = 64 << 10  # slot sizes are rounded up to this, so that slightly larger batches fit


class _Slot:
    """One shared segment of a worker's ring."""

    __slots__ = ("index", "storage", "state", "view", "capacity", "known", "use", "sent",
                 "nbytes", "ref")

    def __init__(self, index: int, capacity: int) -> None:
        self.index = index
        # (torch's private storage API is unannotated)
        self.storage = torch.UntypedStorage._new_shared(_DATA + capacity)  # type: ignore[no-untyped-call]
        self.state, self.view = _arrays(self.storage)
        self.capacity = capacity
        self.known = False  # whether the trainer has received the segment
        self.use = 0  # batches written into it so far
        self.sent = 0  # the last use handed to the trainer (which frees it)
        self.nbytes = 0
        self.ref: weakref.ref[np.ndarray] | None = None  # the current use's buffer


def _arrays(storage: torch.UntypedStorage) -> tuple[np.ndarray, memoryview]:
    """A segment's state byte and a view of the whole segment."""
    whole = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
    return whole[:1], whole.data


def _unsent(slot: _Slot, use: int, _ref: object) -> None:
    # The worker dropped a batch: free its slot unless the trainer received it (then the
    # trainer frees it when it is done with it).
    if slot.sent < use:
        slot.state[0] = _FREE


class _Ring:
    """A worker's slots."""

    def __init__(self) -> None:
        self.token = os.urandom(8)
        self.pid = os.getpid()
        self.slots: list[_Slot] = []
        self.by_address: dict[int, _Slot] = {}

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor over a free slot, or None (none free, at the bound, or empty)."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes == 0:
            return None
        slot = self._slot(nbytes)
        if slot is None:
            return None
        slot.state[0] = _USED
        slot.use += 1
        slot.nbytes = nbytes
        buffer = np.frombuffer(slot.view, np.uint8, nbytes, _DATA)
        slot.ref = weakref.ref(buffer, functools.partial(_unsent, slot, slot.use))
        return torch.frombuffer(buffer, dtype=dtype).view(shape)

    def _slot(self, nbytes: int) -> _Slot | None:
        replace = None
        for slot in self.slots:
            if slot.state[0] != _FREE or (slot.ref is not None and slot.ref() is not None):
                continue
            if slot.capacity >= nbytes:
                return slot
            replace = slot
        capacity = -(-nbytes // _ROUND) * _ROUND
        used = sum(slot.capacity for slot in self.slots if slot is not replace)
        if used + capacity > MAX_BYTES:
            return None
        if replace is None:
            if len(self.slots) >= MAX_SLOTS:
                return None
            self.slots.append(_Slot(len(self.slots), capacity))
            slot = self.slots[-1]
        else:  # a free slot too small for this batch: a larger segment in its place
            del self.by_address[_address(replace)]
            slot = self.slots[replace.index] = _Slot(replace.index, capacity)
        self.by_address[_address(slot)] = slot
        return slot

    def wrap(self, tensor: torch.Tensor) -> _RingBatch | None:
        """``tensor`` as it leaves the worker, if it is the current batch of one of its slots."""
        slot = self.by_address.get(tensor.data_ptr())
        if (slot is None or slot.ref is None or slot.ref() is None or not tensor.is_contiguous()
                or tensor.untyped_storage().nbytes() != slot.nbytes):
            return None
        return _RingBatch(self, slot, tensor)


def _address(slot: _Slot) -> int:
    return int(slot.storage.data_ptr()) + _DATA


class _RingBatch:
    """A batch tensor over a slot on its way to the trainer: pickles as the slot's name (and
    its segment, the first time), and unpickles there as a tensor over the slot (`_unring`)."""

    __slots__ = ("ring", "slot", "tensor", "use")

    def __init__(self, ring: _Ring, slot: _Slot, tensor: torch.Tensor) -> None:
        self.ring, self.slot, self.tensor, self.use = ring, slot, tensor, slot.use

    def __reduce__(self) -> tuple[Any, ...]:
        # Runs in the queue's feeder thread, before the batch is dropped in the worker.
        slot = self.slot
        slot.sent = self.use
        storage = None
        if not slot.known:
            slot.known, storage = True, slot.storage
        tensor = self.tensor
        return _unring, (self.ring.token, self.ring.pid, slot.index, storage, slot.nbytes,
                         tensor.dtype, tuple(tensor.shape))


# -- the worker's side --------------------------------------------------------------------------

_ring: _Ring | None = None


def take_slot(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """A batch tensor over a slot of this worker's ring (it must leave the worker through
    `hand_off`), or None when the ring has none to give."""
    global _ring
    if _ring is None:
        _ring = _Ring()
    return _ring.take(shape, dtype)


def hand_off(batch: Any) -> Any:
    """``batch`` as a DataLoader worker returns it: its tensors over ring slots (alone, or in a
    tuple or dict) wrapped to travel as the slot's name; anything else as it is."""
    return batch if _ring is None else _wrap(_ring, batch, {})


def _wrap(ring: _Ring, value: Any, seen: dict[int, Any]) -> Any:
    if isinstance(value, torch.Tensor):
        # One wrapper per tensor: a batch that holds the same tensor twice (a selection
        # naming one field twice) arrives as one tensor twice.
        wrapped = seen.get(id(value))
        if wrapped is None:
            wrapped = seen[id(value)] = ring.wrap(value) or value
        return wrapped
    if type(value) is tuple:
        return tuple(_wrap(ring, item, seen) for item in value)
    if type(value) is dict:
        return {key: _wrap(ring, item, seen) for key, item in value.items()}
    return value


# -- the trainer's side -------------------------------------------------------------------------


class _Received:
    """The slots of one worker's ring, as the trainer maps them."""

    __slots__ = ("pid", "slots", "refs")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.slots: dict[int, tuple[np.ndarray, memoryview, torch.UntypedStorage]] = {}
        self.refs: dict[int, weakref.ref[np.ndarray]] = {}


_received: dict[bytes, _Received] = {}
_lock = threading.Lock()  # the loop's thread and a pin-memory thread both unpickle batches


def _release(state: np.ndarray, _ref: object) -> None:
    state[0] = _FREE  # nothing here refers to the batch any more: the worker may reuse it


def _unring(token: bytes, pid: int, index: int, storage: torch.UntypedStorage | None,
            nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    with _lock:
        ring = _received.get(token)
        if ring is None:
            _forget_exited()
            ring = _received[token] = _Received(pid)
        if storage is not None:
            ring.slots[index] = (*_arrays(storage), storage)
        try:
            state, view, _storage = ring.slots[index]
        except KeyError:
            raise RuntimeError(f"epochcache: a batch names slot {index} of worker {pid}'s ring, "
                               "which this process never received") from None
        buffer = np.frombuffer(view, np.uint8, nbytes, _DATA)
        ring.refs[index] = weakref.ref(buffer, functools.partial(_release, state))
    return torch.frombuffer(buffer, dtype=dtype).view(shape)


def _forget_exited() -> None:
    for token, ring in list(_received.items()):
        if not pid_alive(ring.pid):
            del _received[token]  # batches still held keep their own segment mapped


def forget_exited() -> None:
    """Unmap the rings of workers that have exited (their batches still held stay valid)."""
    with _lock:
        _forget_exited()


def _after_fork_in_child() -> None:
    # A forked child drops the weak references behind every slot, so that a batch it
    # inherited and drops never frees a slot: the batch is still its parent's.
    global _ring, _lock
    _ring, _lock = None, threading.Lock()
    _received.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
