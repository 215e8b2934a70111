"""Is this an LMDB data file LMDB can map? Checked before LMDB opens it.

LMDB maps ``data.mdb`` and follows page numbers into the map; a page past the end of the file
is not an error LMDB can return but a SIGBUS that ends the process with no message (seen: a
copy killed part-way, or one that met a full disk, then ``status``, ``verify``, ``Cache()`` and
the daemon all died on it). The file says how long it must be: its two meta pages (pages 0 and
1) each name a transaction and the last page it uses, and LMDB opens the newer one. So
`check_data_file` reads the meta pages and the file's size first, and turns each way a file
can be unusable into a `CacheUnusable` naming the path and what to do:

* missing (where nothing may be created), or empty: no cache here;
* no LMDB meta page (the magic number ``0xBEEFC0DE`` at offset 16): not an LMDB file;
* another LMDB data format version: made by another LMDB;
* shorter than the newer meta page's last page: cut short.

What the check cannot see (a page inside the file overwritten with garbage) is LMDB's to
report (``MDB_CORRUPTED``), and `verify`'s. The layout read here is LMDB's (``lmdb.h``,
``mdb.c``: ``MDB_page`` header, then ``MDB_meta``) on 64-bit little-endian machines; the test
suite checks it against files the bundled LMDB writes.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import struct
from collections.abc import Iterator

from ..errors import CacheUnusable

DATA_FILE = "data.mdb"
#: ``MDB_MAGIC`` and ``MDB_DATA_VERSION``.
LMDB_MAGIC, LMDB_DATA_VERSION = 0xBEEFC0DE, 1
#: In a meta page: after the 16-byte page header, ``mm_magic``, ``mm_version`` (u32 each);
#: the page size is kept in ``mm_dbs[FREE_DBI].md_pad`` (u32 at 40); then ``mm_last_pg`` and
#: ``mm_txnid`` (u64 each, at 136).
_HEAD = struct.Struct("<II")
_HEAD_AT, _PSIZE_AT, _TAIL_AT = 16, 40, 136
_PSIZE = struct.Struct("<I")
_TAIL = struct.Struct("<QQ")
_META_BYTES = _TAIL_AT + _TAIL.size


def _meta(raw: bytes) -> tuple[int, int, int, int, int] | None:
    """``(magic, version, page size, last page, txnid)`` of one meta page, None if short."""
    if len(raw) < _META_BYTES:
        return None
    magic, version = _HEAD.unpack_from(raw, _HEAD_AT)
    (psize,) = _PSIZE.unpack_from(raw, _PSIZE_AT)
    last, txnid = _TAIL.unpack_from(raw, _TAIL_AT)
    return magic, version, psize, last, txnid


def check_data_file(path: str, *, create: bool) -> None:
    """Raise `CacheUnusable` unless the cache directory ``path`` holds an LMDB data file whose
    newer meta page fits inside it, or (with ``create``) none yet.

    Raises:
        CacheUnusable: see the module docstring; the message names the file and what to do.
    """
    data = os.path.join(path, DATA_FILE)
    try:
        fd = os.open(data, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        if create:
            return
        raise CacheUnusable(no_cache_here(path)) from None
    except OSError as exc:
        raise CacheUnusable(f"{data}: cannot be read ({exc.strerror or exc}); check the path "
                            "and its permissions (a cache is private to the user who made it)"
                            ) from exc
    try:
        # The meta pages before the size: a writer commits its pages before the meta page that
        # names them, so a size read after the meta covers it. Read the other way round, a
        # commit in between named pages past the size read: a live cache looked cut short
        # (a stream's DataLoader worker opening it while the daemon ingests).
        first = os.pread(fd, _META_BYTES, 0)
        meta0 = _meta(first)
        psize_read = meta0[2] if meta0 is not None else 0
        second = os.pread(fd, _META_BYTES, psize_read) if 512 <= psize_read <= 65536 else b""
        size = os.fstat(fd).st_size
        if size == 0 or meta0 is None:
            raise CacheUnusable(
                f"{data}: " + ("empty" if size == 0 else f"only {size} bytes")
                + f": no cache here (a copy or a new cache killed before it wrote it?); delete "
                f"{path} and point cache.dir at it again (a daemon fills it anew), or copy it "
                "again from a good cache")
        magic, version, psize = meta0[:3]
        if magic != LMDB_MAGIC or not 512 <= psize <= 65536 or psize & (psize - 1):
            raise CacheUnusable(
                f"{data}: not an LMDB data file: {path} holds no epochcache cache; point "
                "cache.dir at another directory, or delete this one if it is yours to delete")
        if version != LMDB_DATA_VERSION:
            raise CacheUnusable(
                f"{data}: written by an LMDB of another data format ({version}, this one reads "
                f"{LMDB_DATA_VERSION}); open it with the epochcache that made it, or delete "
                f"{path} and let a daemon fill it anew")
        metas = [meta0, _meta(second)]
        valid = [m for m in metas if m is not None and m[0] == LMDB_MAGIC]
        newest = max(valid, key=lambda m: m[4])  # LMDB opens the meta of the newer transaction
        need = max(2, newest[3] + 1) * psize  # both meta pages, and every page in use
        if size < need:
            raise CacheUnusable(
                f"{data}: cut short: {size:,} bytes where its last transaction needs {need:,} "
                f"(a copy killed part-way, a full disk, a crash with cache.sync: false?); LMDB "
                f"would crash on it. It is a cache: delete {path} and let a daemon fill it "
                "anew, or copy it again from a good cache (`epochcache copy`)")
    finally:
        os.close(fd)


#: What a copy's temporary directory beside the destination is called (then a random id).
PARTIAL = ".{name}.partial-copy-"


def partial_prefix(dst: str) -> str:
    """The name a copy to ``dst`` gives its temporary directory beside it, less its id."""
    return os.path.join(os.path.dirname(dst), PARTIAL.format(name=os.path.basename(dst)))


def partial_copies(dst: str) -> list[str]:
    """The temporary directories that copies to ``dst`` left beside it (none when every copy
    ended), oldest first."""
    found = [path for path in glob.glob(glob.escape(partial_prefix(dst)) + "*")
             if os.path.isdir(path)]
    return sorted(found, key=lambda path: os.stat(path).st_mtime)


def leftover_hint(path: str) -> str:
    """For a message on a missing cache: the leftover of a copy to ``path`` killed part-way."""
    found = partial_copies(os.path.realpath(path))
    if not found:
        return ""
    return (f"; {found[-1]} is what a copy to it left when it was killed part-way: run the "
            "copy again (`epochcache copy SRC DEST` removes it)")


def no_cache_here(path: str) -> str:
    """Why ``path`` holds no cache, and what to do; names the leftover of a copy killed
    part-way beside it, if any."""
    return (f"{path}: no cache here (data.mdb is missing){leftover_hint(path)}; point the "
            "command at a cache (the cache.dir of a config), or make one: a daemon does, and "
            "Cache(path, capacity=...)")


#: The coverage directory beside the LMDB files: the ledgers `epochcache.coverage` writes there
#: under `ledger_lock`, and `copy` copies whole under the same lock.
COVERAGE_DIR = "coverage"
LOCK_FILE = "ledger.lock"


def coverage_dir(cache_path: str) -> str:
    return os.path.join(cache_path, COVERAGE_DIR)


@contextlib.contextmanager
def ledger_lock(cache_path: str) -> Iterator[None]:
    """Held while a process reads, changes and writes ledgers (released if it dies)."""
    directory = coverage_dir(cache_path)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(directory, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
