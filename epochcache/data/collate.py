"""Collate decoded samples into one batch, writing arrays into a single preallocated tensor.

``default_collate`` turns each numpy sample into its own tensor and then stacks them; here
fixed-shape arrays and tensors are copied once into a batch tensor that, inside a DataLoader
worker, already lives in shared memory (so sending it to the trainer copies nothing more: a
buffer of the worker's batch ring, `epochcache.data.ring`, for the loaders of ``epochs()``).
Everything else (dicts of fields, tuples, numbers, strings) is collated field by field, ending
in ``default_collate`` for types this module has no faster path for.

Copies of large samples into a batch, shared between the calling thread and a helper thread.

One thread copying 1 MiB samples out of the LMDB map into a batch of 64 MiB gets 5-6 GB/s here:
the batch buffers (the loop still holds the previous batch while the next one is read) and the
map do not fit in the caches, and a copy waits on memory. Two threads copying two samples at
once get more of the memory's bandwidth, and numpy releases the GIL while it copies. So a batch
of raw samples of `SPLIT_BYTES` or more, read in the training process, is copied by the
calling thread and one helper thread, each taking the next sample from one shared iterator: a
helper the machine does not get to run costs no more than the sample it holds, since the
calling thread copies the rest, and a task it has not started when the calling thread is done
is withdrawn. Measured against one thread (scripts/bench_loader.py, in process, the same
batches): 1.5-1.8x at 1 MiB, 1.1-1.3x at 256 KiB; at 64 KiB the threads' turns at the GIL cost
more than they save, so smaller samples are copied by the calling thread as it reads them.

DataLoader workers copy alone: the other workers have the other cores.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate, get_worker_info

from . import ring

#: Batch buffers of the training process, reused once nothing refers to them any more. A fresh
#: multi-MiB tensor per batch comes from mmap and page-faults on every write (measured: 3x the
#: cost of the copy itself at 64 KiB x 64 samples).
_POOL_SIZE = 4
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


class _Buffer:
    """A batch buffer of the pool: the tensor, its bytes as one writable memoryview, and its
    storage. Made once per buffer, not per batch: with the caches cold from copying the last
    batch, the views and storage object cost 10-20 us a batch (scripts/bench_loader.py, 64 KiB)."""

    __slots__ = ("key", "tensor", "rows", "storage")

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.key = (shape, dtype)
        self.tensor = torch.empty(shape, dtype=dtype)
        self.rows = self.tensor.numpy().data.cast("B")
        self.storage = self.tensor.untyped_storage()

    def refs(self) -> tuple[int, int]:
        if _storage_use_count is None:
            return 1 << 30, 1 << 30
        return sys.getrefcount(self.tensor), int(_storage_use_count(self.storage._cdata))


_pool: list[_Buffer] = []
_pool_lock = threading.Lock()


def _after_fork_in_child() -> None:
    # A fork from a background thread (epochs() builds loaders there) may catch another thread
    # holding the lock; the parent's buffers are of no use to the child either.
    global _pool_lock
    _pool_lock = threading.Lock()
    _pool.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# Measured, not hard-coded: how many references the interpreter reports for a buffer's tensor
# and storage that only the pool holds differs between Python and torch versions.
_UNREFERENCED = _Buffer((1,), torch.float32).refs()


def _from_pool(shape: tuple[int, ...], dtype: torch.dtype) -> _Buffer:
    key = (shape, dtype)
    with _pool_lock:
        for buffer in _pool:
            if buffer.key != key:
                continue
            # Reuse only a tensor nothing else refers to: no Python name, view or numpy array.
            refs, storage_refs = buffer.refs()
            if refs <= _UNREFERENCED[0] and storage_refs <= _UNREFERENCED[1]:
                return buffer
        buffer = _Buffer(shape, dtype)
        if len(_pool) >= _POOL_SIZE:
            _pool.pop(0)
        _pool.append(buffer)
        return buffer


_torch_dtypes: dict[Any, torch.dtype] = {}


def _torch_dtype(dtype: np.dtype[Any] | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    found = _torch_dtypes.get(dtype)
    if found is None:
        found = _torch_dtypes[dtype] = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    return found


def alloc_rows(shape: tuple[int, ...], dtype: np.dtype[Any] | torch.dtype,
               ) -> tuple[torch.Tensor, memoryview]:
    """`alloc_batch`, with the batch's bytes as one writable memoryview (the raw read path
    copies samples into it)."""
    if get_worker_info() is None and not _scope[1]:
        buffer = _from_pool(tuple(shape), _torch_dtype(dtype))
        return buffer.tensor, buffer.rows
    batch = alloc_batch(shape, dtype)
    return batch, batch.numpy().data.cast("B")


class batch_buffers:
    """Within it, `alloc_batch` gives buffers for batches that leave through
    `epochcache.data.ring.hand_off`: in a DataLoader worker a slot of its batch ring, and in the
    training process, with ``pinned``, page-locked memory (the DataLoader's ``pin_memory`` then
    has nothing left to copy).

    Args:
        pinned: batches read in the training process go to a GPU (``pin_memory=True`` where
            CUDA is available).
    """

    __slots__ = ("pinned", "previous")

    def __init__(self, pinned: bool = False) -> None:
        self.pinned = pinned

    def __enter__(self) -> None:
        global _scope
        self.previous, _scope = _scope, (True, self.pinned)

    def __exit__(self, *exc: object) -> None:
        global _scope
        _scope = self.previous


_scope = (False, False)  # (inside batch_buffers, pinned)


def alloc_batch(shape: tuple[int, ...], dtype: np.dtype[Any] | torch.dtype) -> torch.Tensor:
    """An uninitialised tensor for a batch; in shared memory inside a DataLoader worker.

    In the training process the tensor may be one handed out before and since dropped by
    every user (checked through reference counts), so its pages are already mapped; or,
    in a pinned `batch_buffers`, page-locked memory. In a worker, inside `batch_buffers`,
    it is a slot of the worker's batch ring (`epochcache.data.ring`), else a new shared
    segment.
    """
    tdtype = _torch_dtype(dtype)
    handed_off, pinned = _scope
    if get_worker_info() is None:
        if pinned:
            # From torch's caching host allocator, never from the pool: the loop may copy a
            # batch to the GPU with non_blocking=True and drop it before the copy is done;
            # torch reuses a block only once the copies recorded on it have finished.
            return torch.empty(shape, dtype=tdtype, pin_memory=True)
        return _from_pool(tuple(shape), tdtype).tensor
    if handed_off:
        tensor = ring.take_slot(tuple(shape), tdtype)
        if tensor is not None:
            return tensor
    numel = int(np.prod(shape, dtype=np.int64))
    # As default_collate does: allocate the shared storage directly instead of moving a
    # finished tensor into shared memory (which would copy the batch once more).
    # (torch's private storage API is unannotated)
    typed = torch.empty(0, dtype=tdtype)._typed_storage()  # type: ignore[no-untyped-call]
    storage = typed._new_shared(numel)
    return torch.empty(0, dtype=tdtype).new(storage).view(shape)


def _stack_arrays(samples: Sequence[Any]) -> torch.Tensor | None:
    first = samples[0]
    shape, dtype = tuple(first.shape), first.dtype
    for sample in samples:
        if type(sample) is not type(first) or tuple(sample.shape) != shape or sample.dtype != dtype:
            return None
    if isinstance(first, np.ndarray):
        if first.dtype.hasobject or first.dtype.kind in "USV":
            return None
        batch = alloc_batch((len(samples), *shape), dtype)
        rows = batch.numpy()
        for i, sample in enumerate(samples):
            rows[i] = sample
        return batch
    batch = alloc_batch((len(samples), *shape), dtype)
    torch.stack(list(samples), 0, out=batch)
    return batch


def collate_samples(samples: Sequence[Any]) -> Any:
    """Collate a list of decoded samples; an empty list collates to an empty tensor.

    ``None`` entries (samples skipped by a map-style dataset) are dropped first.
    """
    samples = [s for s in samples if s is not None]
    if not samples:
        return torch.empty(0)
    first = samples[0]
    if isinstance(first, (np.ndarray, torch.Tensor)):
        stacked = _stack_arrays(samples)
        if stacked is not None:
            return stacked
    elif isinstance(first, Mapping) and all(isinstance(s, Mapping) for s in samples):
        names = list(first.keys())
        if all(list(s.keys()) == names for s in samples):
            return {name: collate_samples([s[name] for s in samples]) for name in names}
    elif isinstance(first, tuple) and all(
        isinstance(s, tuple) and len(s) == len(first) for s in samples
    ):
        columns = [collate_samples(list(column)) for column in zip(*samples)]
        return type(first)(*columns) if hasattr(first, "_fields") else tuple(columns)
    elif isinstance(first, bytes):
        return list(samples)  # default_collate would fail on bytes
    return default_collate(list(samples))


#: Samples of at least this many bytes are copied by two threads (in the training process).
SPLIT_BYTES = 1 << 20

_QUEUED, _RUNNING, _WITHDRAWN = 0, 1, 2


class _Task:
    """One batch's copies, offered to the helper."""

    __slots__ = ("todo", "rows", "sources", "state", "done", "error")

    def __init__(self, todo: Iterator[int], rows: np.ndarray, sources: Sequence[memoryview]
                 ) -> None:
        self.todo, self.rows, self.sources = todo, rows, sources
        self.state = _QUEUED
        self.done = threading.Event()
        self.error: BaseException | None = None


def _copy(todo: Iterator[int], rows: np.ndarray, sources: Sequence[memoryview]) -> None:
    for i in todo:  # the shared iterator: each index is taken by one thread
        np.copyto(rows[i], np.frombuffer(sources[i], np.uint8))


class _Helper:
    def __init__(self) -> None:
        self.tasks: queue.SimpleQueue[_Task] = queue.SimpleQueue()
        self.lock = threading.Lock()
        threading.Thread(target=self._run, name="epochcache-copier", daemon=True).start()

    def _run(self) -> None:
        while True:
            task = self.tasks.get()
            with self.lock:
                if task.state == _WITHDRAWN:
                    continue
                task.state = _RUNNING
            try:
                _copy(task.todo, task.rows, task.sources)
            except BaseException as exc:  # noqa: BLE001 - re-raised by the calling thread
                task.error = exc
            finally:
                task.done.set()
            del task  # hold no batch while idle


_helper: _Helper | None = None


def copy_rows(rows: np.ndarray, sources: Sequence[memoryview]) -> None:
    """``rows[i] = sources[i]`` for every ``i`` (``rows``: one row of bytes per source), by this
    thread and the helper; returns once neither touches them any more."""
    global _helper
    if _helper is None:
        _helper = _Helper()
    helper = _helper
    task = _Task(iter(range(len(sources))), rows, sources)
    helper.tasks.put(task)
    try:
        _copy(task.todo, rows, sources)
    finally:
        with helper.lock:
            started = task.state == _RUNNING
            task.state = _WITHDRAWN
        if started:  # it may be copying one: the sources must stay valid until it is done
            task.done.wait()
    if task.error is not None:
        raise task.error


def _forget_helper_after_fork() -> None:
    global _helper
    _helper = None  # its thread did not survive the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_helper_after_fork)
