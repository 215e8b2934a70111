"""Copies of large samples into a batch, shared between the calling thread and a helper thread.

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
import threading
from collections.abc import Iterator, Sequence

import numpy as np

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


def _after_fork_in_child() -> None:
    global _helper
    _helper = None  # its thread did not survive the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
