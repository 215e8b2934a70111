"""``epochcache copy SRC DST`` / ``cache.copy_to(dst)``: a consistent copy to start a node warm.

The copy is LMDB's own (``mdb_env_copy2`` with compaction): it reads the source in one read
transaction, so it is consistent while the source's daemon and trainers go on writing, and it
leaves free pages behind (the copy's data file holds what is stored, no more). The source is
never written to. What the copy keeps and leaves behind:

* kept: the samples, their key index, counters and limits (capacity, headroom), the stats
  history, the quarantine rows, the per-source counters, the origin rows, the saved listings
  (``listings/``: a daemon on the copy with the same source config does not list again) and
  the coverage ledgers (``coverage/``);
* left behind: the leases (a lease names a process of the source's machine: the copy's samples
  are all free for eviction), release plans, owner and lock files, and every state document
  (the daemon's heartbeat, samplers' positions and health, streams' shares, jobs).

The destination must be new or an empty directory; it is created private to the user (0700,
files 0600), as caches are. On a live source the read transaction of the copy pins the pages
writers free meanwhile, so the source's data file may grow by what is written during the copy.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import TYPE_CHECKING, Any

from ..errors import CacheError
from ..writable import check_writable
from .env import make_private_dir
from .ledger import COVERAGE_DIR, LOCK_FILE, ledger_lock
from .schema import DB_LEASES, DB_STATE

if TYPE_CHECKING:
    from .cache import SampleStore

#: Directories of a cache copied along with its LMDB environment.
LISTINGS_DIR = "listings"


def check_destination(dst: str) -> None:
    """Raise [`CacheError`][epochcache.CacheError] unless ``dst`` is a new or empty directory,
    [`PathNotWritable`][epochcache.PathNotWritable] unless it can be written."""
    if os.path.lexists(dst) and not os.path.isdir(dst):
        raise CacheError(f"{dst}: exists and is not a directory; `epochcache copy` writes a new "
                         "cache into a new or empty directory")
    if os.path.isdir(dst) and os.listdir(dst):
        raise CacheError(f"{dst}: the directory is not empty; `epochcache copy` writes a new "
                         "cache: give it a new or empty directory (it never merges into, or "
                         "overwrites, another)")
    check_writable(dst, "the copy")


def _copy_files(src_dir: str, dst_dir: str, skip: tuple[str, ...] = ()) -> int:
    """Copy the plain files of ``src_dir`` (not hidden temporaries) into ``dst_dir``, private."""
    try:
        names = sorted(os.listdir(src_dir))
    except FileNotFoundError:
        return 0
    make_private_dir(dst_dir)
    copied = 0
    for name in names:
        path = os.path.join(src_dir, name)
        if name.startswith(".") or name in skip or not os.path.isfile(path):
            continue
        target = os.path.join(dst_dir, name)
        shutil.copyfile(path, target)  # a listing replaced meanwhile: the old or the new, whole
        os.chmod(target, 0o600)
        copied += 1
    return copied


def copy_cache(source: SampleStore, dst: str | os.PathLike[str]) -> dict[str, Any]:
    """Copy ``source`` to ``dst`` (see the module docstring); return what was copied.

    Raises:
        CacheError: ``dst`` exists and is not an empty directory, or it is the source.
    """
    from .cache import SampleStore

    dst = os.path.realpath(os.fspath(dst))
    if dst == source.path or dst.startswith(source.path + os.sep):
        raise CacheError(f"{dst}: the copy cannot go into the cache it copies ({source.path})")
    check_destination(dst)
    started = time.monotonic()
    make_private_dir(dst)
    source.store.env.copy(dst, compact=True)
    for name in os.listdir(dst):
        os.chmod(os.path.join(dst, name), 0o600)
    listings = _copy_files(os.path.join(source.path, LISTINGS_DIR),
                           os.path.join(dst, LISTINGS_DIR))
    with ledger_lock(source.path):  # whole ledgers: no update is half-way
        ledgers = _copy_files(os.path.join(source.path, COVERAGE_DIR),
                              os.path.join(dst, COVERAGE_DIR), skip=(LOCK_FILE,))
    copy = SampleStore(dst)
    try:
        def leave_behind(txn: Any) -> tuple[int, int]:
            leases = states = 0
            for db_name in (DB_LEASES, DB_STATE):
                cursor = txn.cursor(db=copy.dbs[db_name])
                while cursor.first():
                    cursor.delete()
                    if db_name == DB_LEASES:
                        leases += 1
                    else:
                        states += 1
            return leases, states

        leases, states = copy.store.write(leave_behind)
        counters = copy.counters()
        report = {"source": source.path, "path": dst, "samples": counters.samples,
                  "bytes": counters.bytes, "file_bytes": copy.file_bytes(),
                  "listings": listings,
                  "ledgers": sum(name.endswith(".ledger") for name in
                                 os.listdir(os.path.join(dst, COVERAGE_DIR))) if ledgers else 0,
                  "leases_left_behind": leases, "states_left_behind": states,
                  "seconds": round(time.monotonic() - started, 3)}
    finally:
        copy.close()
    return report
