"""Reading a local source (``file://`` or a plain path): whole files straight from the OS.

fsspec's local ``cat_file`` from a pool of ``concurrency`` threads is the right way to wait on
many remote objects at once and the wrong way to read files that are in the page cache: such a
read takes microseconds, and 16 threads taking turns at the GIL for each one cost far more than
the reads (measured on 2 cores, 64 KiB files: 250 us per file that way, 19 us with ``os.read``
one after the other in one thread; docs/benchmarks.md). A slow filesystem (NFS, Lustre, a cold
disk) is the opposite case, where reads in parallel hide the latency. So `LocalFiles`
reads a batch in one thread while its files come back quickly, and spreads the next batches
over ``concurrency`` threads once a file waits `SLOW_READ_S` or more on average (back to
one thread as soon as one read of a batch is quick again). A read's wait is its time less what
its size explains (`COPY_BYTES_PER_S`): a large file in the page cache is not slow.

Every read stays bounded in time as a remote call is (invariant 6): the reads run in threads the
caller waits on, and a thread that makes no progress for ``timeout_s`` (a hung NFS mount, a FIFO
without a writer) has its unread files reported as timed out;
the caller goes on without it (the errors are the OS's; the caller translates them).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

#: Mean seconds a file waited, read one after the other, from which the next batches are read
#: in parallel...
SLOW_READ_S = 0.001
#: ... until one file of a batch waits less than this.
QUICK_READ_S = 0.00025
#: The slowest a file's bytes are copied out of the page cache (2 contended cores): a read's
#: time less its size at this rate is what it waited. Without it a 1 MiB file took ~1 ms when
#: samplers were busy and switched reads to many threads for good, which cost the daemon ~20%
#: more CPU per byte (docs/benchmarks.md).
COPY_BYTES_PER_S = 1e9
#: A file's final component is opened without following a link: a link fails the read with
#: ELOOP, and the caller resolves it and checks its target against the root (Source._read_local).
OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)

Result = bytes | BaseException


def read_wait(seconds: float, nbytes: int) -> float:
    """How long a read of ``nbytes`` waited: its time less what copying its bytes takes, so a
    large file in the page cache does not look like a slow filesystem."""
    return seconds - nbytes / COPY_BYTES_PER_S


def judge_reads(slow: bool, lanes: int, waits: Sequence[float]) -> bool:
    """Whether the next batch should read in many threads, after a batch read in ``lanes``
    threads whose reads waited ``waits`` seconds each (see `read_wait`)."""
    if waits and lanes == 1:
        return sum(waits) / len(waits) >= SLOW_READ_S
    if waits and min(waits) < QUICK_READ_S:
        # Threads reading at once wait for each other's turns at the GIL, so their mean
        # says little; one quick read does: try one thread again (its mean decides).
        return False
    return slow


def read_file(path: str, end: int | None = None, start: int = 0) -> bytes:
    """The bytes of a local file from ``start`` up to ``end`` (None: its end), as
    ``cat_file`` would return them (fewer when the file ends first).

    Raises:
        OSError: as the OS reports it (``FileNotFoundError``, ``PermissionError``, ``ELOOP``
            for a final component that became a link).
    """
    fd = os.open(path, OPEN_FLAGS)
    try:
        size = os.fstat(fd).st_size
        want = (size if end is None else min(size, end)) - start
        parts = []
        while want > 0:  # one read, unless it comes back short (network filesystems)
            # pread only from an offset: a FIFO or character device cannot seek
            chunk = os.pread(fd, want, start) if start else os.read(fd, want)
            if not chunk:  # the file shrank
                break
            parts.append(chunk)
            want -= len(chunk)
            start += len(chunk) if start else 0
        return parts[0] if len(parts) == 1 else b"".join(parts)
    finally:
        os.close(fd)


class LocalFiles:
    """Reads batches of local files; remembers whether this filesystem reads quickly.

    Args:
        concurrency: threads a batch may use once reads are slow.
    """

    def __init__(self, concurrency: int = 16) -> None:
        self.concurrency = max(1, concurrency)
        #: reads are slow (network filesystem, cold disk): spread batches over threads
        self.slow = False
        # Kept between batches (a thread started per batch cost ~4% of a sampler at 64 KiB);
        # replaced once a read in it hangs, so that later batches never queue behind one.
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def _threads(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                # A sampler reads FETCH_DEPTH (2) batches of a source at once: room for both.
                self._pool = ThreadPoolExecutor(max_workers=2 * self.concurrency,
                                                thread_name_prefix="epochcache-read")
            return self._pool

    def _abandon(self, pool: ThreadPoolExecutor) -> None:
        with self._pool_lock:
            if self._pool is pool:
                self._pool = None
        # Never wait for a hung read; lanes of other batches queued on it still run.
        pool.shutdown(wait=False)

    def read_many(self, paths: Sequence[str], ends: Sequence[int | None],
                  timeout_s: float, starts: Sequence[int] | None = None) -> list[Result]:
        """Each file's bytes (from ``starts``, default 0, up to ``ends``; see `read_file`) or
        the exception its read raised, in order (never raised).

        A file not read within ``timeout_s`` of the last read that completed in its thread is a
        ``TimeoutError``; that thread is left behind.
        """
        if not paths:
            return []
        lanes = min(len(paths), self.concurrency if self.slow else 1)
        results: list[Result | None] = [None] * len(paths)
        progress = [time.monotonic()] * lanes
        lock = threading.Lock()  # a lane abandoned by the caller must not write results late
        abandoned = [False] * lanes
        waited = [0.0] * len(paths)  # seconds each read took beyond copying its bytes

        def lane(index: int) -> None:
            for i in range(index, len(paths), lanes):
                started = time.monotonic()
                try:
                    value: Result = read_file(paths[i], ends[i], starts[i] if starts else 0)
                except Exception as exc:  # noqa: BLE001 - returned per file, translated by caller
                    value = exc
                now = time.monotonic()
                with lock:
                    if abandoned[index]:
                        return
                    results[i] = value
                    progress[index] = now
                    waited[i] = read_wait(now - started,
                                          len(value) if isinstance(value, bytes) else 0)

        pool = self._threads()
        running: dict[Future[None], int] = {pool.submit(lane, i): i for i in range(lanes)}
        while running:
            done, _ = wait(running, timeout=timeout_s, return_when=FIRST_COMPLETED)
            for future in done:
                del running[future]
            now = time.monotonic()
            with lock:
                for future, index in list(running.items()):
                    if now - progress[index] >= timeout_s:
                        abandoned[index] = True
                        del running[future]
                        self._abandon(pool)
        self.slow = judge_reads(self.slow, lanes,
                                [t for t, value in zip(waited, results) if value is not None])
        return [TimeoutError(f"no answer from the filesystem within {timeout_s:g}s (a hung "
                             "network mount?)") if value is None else value for value in results]
