"""Coverage staged for a checkpoint: what a run trained is counted once the checkpoint that
covers it is written, all or nothing.

``epochcache run`` counts the batches a checkpoint covers in the coverage ledger
(`epochcache.coverage.ledger`). Counted before the checkpoint was written, a job killed while
writing it (a checkpoint of a large model takes seconds) had counted batches its resume trains
and counts again. So the count goes in two steps:

1. before the checkpoint, `stage` writes the batches' sequence numbers to a file of their own,
   ``<cache>/coverage/staged/<token>.seqs``, and the checkpoint names the token;
2. once the checkpoint is written (every rank: after the barrier that follows it), `commit`
   counts the file in the ledgers and deletes it.

A kill before the checkpoint leaves a staged file no checkpoint names: the resume drops it
(its batches are trained again, and counted then). A kill between the checkpoint and the
commit leaves one the checkpoint names: the resume commits it (`settle`). A commit killed
half-way (between two sources' ledgers, or before the file's deletion) is committed again:
each ledger remembers the tokens it counted (`ledger.note_applied`) and counts one once.

A token is ``<run>.<epoch>.<random>``: ``run`` a digest of the run directory, so that the
runs sharing a cache settle only their own files.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lmdb
import numpy as np

from ..errors import CacheError
from ..paths import atomic_write
from ..store.datafile import coverage_dir
from .ledger import record_trained

if TYPE_CHECKING:
    from ..store.sample_store import SampleStore

log = logging.getLogger(__name__)

STAGED_DIR = "staged"
_SUFFIX = ".seqs"


def run_key(run_dir: str | os.PathLike[str]) -> str:
    """The run part of a run's tokens: a digest of its (resolved) directory."""
    return hashlib.sha256(os.fsencode(os.path.realpath(run_dir))).hexdigest()[:16]


def _staged_dir(cache: SampleStore) -> str:
    return os.path.join(coverage_dir(cache.path), STAGED_DIR)


def _path(cache: SampleStore, token: str) -> str:
    return os.path.join(_staged_dir(cache), token + _SUFFIX)


def stage(cache: SampleStore, seqs: np.ndarray, *, run: str, epoch: int, job: str) -> str:
    """Write ``seqs`` (trained in ``epoch``, to be covered by the next checkpoint) to a staged
    file, on disk before the checkpoint can name it; return its token."""
    token = f"{run}.{epoch}.{uuid.uuid4().hex[:12]}"
    head = json.dumps({"epoch": epoch, "job": job, "count": len(seqs)}).encode()
    with atomic_write(_path(cache, token), prefix=".staged-", durable=True) as f:
        f.write(head + b"\n")
        f.write(np.asarray(seqs, dtype="<u8").tobytes())
    return token


def _read(path: str) -> tuple[dict[str, Any], np.ndarray] | None:
    """A staged file's header and seqs; None when it is gone (committed) or unreadable."""
    try:
        with open(path, "rb") as f:
            head = json.loads(f.readline())
            seqs = np.frombuffer(f.read(), dtype="<u8").astype(np.uint64)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("%s: unreadable staged coverage (%s); dropped", path, exc)
        return None
    if len(seqs) != int(head.get("count", -1)):
        log.warning("%s: truncated staged coverage; dropped", path)
        return None
    return head, seqs


def commit(cache: SampleStore, token: str) -> dict[str, Any]:
    """Count the staged file ``token`` in the ledgers (once, however often it is called) and
    delete it; returns what this call counted (``{"trained", "new", "unattributed"}``)."""
    path = _path(cache, token)
    found = _read(path)
    counted: dict[str, Any] = {"trained": 0, "new": 0, "unattributed": 0}
    if found is not None:
        head, seqs = found
        counted = record_trained(cache, seqs, epoch=int(head["epoch"]),
                                 job=str(head.get("job") or ""), token=token)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return counted


def settle(cache: SampleStore, run: str, covered: Callable[[int, str], bool],
           before: float) -> tuple[int, int]:
    """At a run's start, its staged files written before ``before`` (a ``time.time()``: by
    its earlier attempts, not by a rank of this one): commit those its checkpoint covers
    (``covered(epoch, token)``), drop the others. Returns ``(committed, dropped)``."""
    try:
        names = sorted(os.listdir(_staged_dir(cache)))
    except FileNotFoundError:
        return 0, 0
    committed = dropped = 0
    for name in names:
        token = name[: -len(_SUFFIX)]
        parts = token.split(".")
        if (not name.endswith(_SUFFIX) or len(parts) != 3 or parts[0] != run
                or not parts[1].isdigit()):
            continue
        path = _path(cache, token)
        try:
            if os.stat(path).st_mtime >= before:
                continue
        except FileNotFoundError:
            continue  # another rank of the node settled it
        if covered(int(parts[1]), token):
            try:
                commit(cache, token)
            except (OSError, ValueError, lmdb.Error, CacheError) as exc:
                # Left for the next start; the run goes on (an audit record).
                log.warning("coverage: could not count %s (%s)", path, exc)
                continue
            committed += 1
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            dropped += 1
    if committed or dropped:
        log.info("coverage: %d update(s) a checkpoint covered counted now, %d its checkpoint "
                 "never covered dropped (trained again)", committed, dropped)
    return committed, dropped

