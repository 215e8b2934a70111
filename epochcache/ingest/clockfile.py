"""A few ``time.monotonic()`` instants shared by the samplers of a daemon through a small file.

The request budget (`requests.RequestBudget`) and each source's pace (`concurrency.Pace`) are
kept in files in the cache directory that every sampler process maps and changes under ``flock``
(the kernel releases it when the process holding it dies: a sampler killed with ``kill -9`` in
the middle cannot wedge the others). Their cells are instants of the monotonic clock, which every process of one boot
reads alike, and which means nothing on another boot or host: after a reboot the clock starts
again from zero, so an instant the last boot wrote lies far ahead and every request would wait
for it (seen: up to an hour, nothing cached meanwhile).

So the file names its clock: it starts with a magic word and the `clock_id` its cells were
read from. A process that finds another clock's stamp (the node rebooted; the cache was copied
or moved to another host; a file an older version wrote, without a stamp) starts the cells
afresh under its own and says so in the log, once per file and process.

Layout: ``b"ECCLOCK1"``, the 16-byte clock id, then the cells as little-endian doubles.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import struct
from collections.abc import Iterator, Sequence

from ..boot import clock_id

log = logging.getLogger(__name__)

MAGIC = b"ECCLOCK1"
_STAMP = struct.Struct("<8s16s")


class ClockFile:
    """``len(initial)`` cells of a file every sampler of a daemon maps (see the module docstring).

    Args:
        path: the file (created if missing).
        initial: the cells of a new file, or of one stamped by another clock.
    """

    def __init__(self, path: str | os.PathLike[str], initial: Sequence[float]) -> None:
        self.path = os.fspath(path)
        self._initial = [float(value) for value in initial]
        self._cells = struct.Struct(f"<{len(self._initial)}d")
        self._stamp = _STAMP.pack(MAGIC, clock_id())
        size = _STAMP.size + self._cells.size
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if os.fstat(fd).st_size < size:  # new, or an older version's (no stamp): grown
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    @contextlib.contextmanager
    def locked(self) -> Iterator[list[float]]:
        """The cells, to read and change (written back when the block ends without an error),
        with the file locked against the other processes."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            if self._map[: _STAMP.size] != self._stamp:
                self._restamp()
            cells = list(self._cells.unpack_from(self._map, _STAMP.size))
            yield cells
            self._cells.pack_into(self._map, _STAMP.size, *cells)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _restamp(self) -> None:
        if any(self._map[:]):  # a new file is all zeros: nothing to say
            log.info("%s: written under another boot or host%s; its clock instants mean "
                     "nothing here: starting it afresh", self.path,
                     "" if self._map[: len(MAGIC)] == MAGIC else
                     " (by an older version, which did not say which)")
        self._cells.pack_into(self._map, _STAMP.size, *self._initial)
        self._map[: _STAMP.size] = self._stamp

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)
