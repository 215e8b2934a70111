"""Sample factories and a writer subprocess that keeps inserting into a cache."""

from __future__ import annotations

import io
import multiprocessing as mp
import sys
import time
from typing import Any

import numpy as np


def npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def sample_array(index: int, floats: int = 64) -> np.ndarray:
    """A deterministic, incompressible float32 array whose first element encodes ``index``."""
    rng = np.random.default_rng(index)
    array = rng.integers(0, 2**32, floats, dtype=np.uint32).view(np.float32).copy()
    array[0] = float(index)
    return array


def fill(path: str, start: int, count: int, capacity: str = "64MiB", floats: int = 64,
         headroom: float | str = 0.1) -> list[int]:
    """Insert ``count`` numbered .npy samples; returns their sequence numbers."""
    from epochcache import Cache

    cache = Cache(path, capacity, sync=False, headroom=headroom)
    items = [(f"s/{i:07d}.npy", npy_bytes(sample_array(i, floats))) for i in range(start, start + count)]
    return cache.put_many(items).seqs


def _writer_main(path: str, start: int, per_batch: int, pause_s: float, stop: Any,
                 started: Any) -> None:
    from epochcache import Cache

    cache = Cache(path, sync=False)
    i = start
    while not stop.is_set():
        items = [(f"s/{j:07d}.npy", npy_bytes(sample_array(j))) for j in range(i, i + per_batch)]
        cache.put_many(items, timeout_s=30)
        started.set()
        i += per_batch
        time.sleep(pause_s)
    sys.exit(0)


class Writer:
    """A spawned process inserting ``per_batch`` samples every ``pause_s`` until stopped.

    Entering waits until its first batch is committed: a spawned process takes seconds to
    start on a busy machine, and a test's first epoch could end before it wrote anything.
    """

    def __init__(self, path: str, start: int, per_batch: int = 20, pause_s: float = 0.02) -> None:
        ctx = mp.get_context("spawn")
        self.stop_event = ctx.Event()
        self.started = ctx.Event()
        self.process = ctx.Process(target=_writer_main,
                                   args=(path, start, per_batch, pause_s, self.stop_event,
                                         self.started),
                                   daemon=True)

    def __enter__(self) -> Writer:
        self.process.start()
        deadline = time.monotonic() + 120
        while not self.started.wait(0.5):
            if not self.process.is_alive() or time.monotonic() > deadline:
                self.__exit__()
                raise AssertionError("the writer process did not commit its first batch "
                                     f"(exit code {self.process.exitcode})")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
