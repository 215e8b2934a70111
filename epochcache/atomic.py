"""Atomic file writes: a temporary file in the target's directory, renamed into place, so a
reader (or a crash) sees the old file or the new one, never half of one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import BinaryIO


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], *, prefix: str = ".tmp-", suffix: str = "",
                 durable: bool = False) -> Iterator[BinaryIO]:
    """Write ``path`` through the yielded file; it replaces ``path`` only if the block ends
    without an exception (the temporary file is removed otherwise). The directory is created
    private to the user when missing. ``durable`` flushes the data to disk before the rename,
    so a power loss cannot leave the new name on an empty file."""
    directory = os.path.dirname(os.fspath(path)) or "."
    os.makedirs(directory, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
