"""Stall records in a cache directory: the trainers reading it that a stall watchdog caught.

A process whose batch stalled (see `epochcache.data.stall`) writes ``stalls/<pid>.json``
-- what stalled, since when, the sample key and worker, and the action taken -- and removes it
when the batch finishes after all. ``epochcache status`` shows the records of processes that
still run: a trainer stuck on a batch (action ``warn``), or one ending with its StallError.
Files, not LMDB: the process writing one may be stuck inside the store.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

from .boot import process_record, recorded_alive
from .paths import atomic_write

STALLS_DIR = "stalls"


def _path(cache_path: str, pid: int) -> str:
    return os.path.join(cache_path, STALLS_DIR, f"{pid}.json")


def record_stall(cache_path: str, doc: dict[str, Any]) -> None:
    """Record this process's stall (``doc``); raises OSError when it cannot."""
    path = _path(cache_path, os.getpid())
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    with atomic_write(path) as f:
        f.write(json.dumps({**doc, **process_record()}).encode())


def forget_stall(cache_path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(_path(cache_path, os.getpid()))


def read_stalls(cache_path: str) -> list[dict[str, Any]]:
    """The stall records of processes that still run, oldest first."""
    directory = os.path.join(cache_path, STALLS_DIR)
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for name in names:
        try:
            with open(os.path.join(directory, name)) as f:
                doc = dict(json.load(f))
        except (OSError, ValueError):
            continue
        if recorded_alive(doc):
            found.append(doc)
    return sorted(found, key=lambda doc: float(doc.get("since", 0)))
