"""Stall watchdog: a batch slower than ``stall_s`` dumps the stacks and names the sample key.

Invariant 6 (no silent hangs). Every process that reads samples (the training process and each
DataLoader worker) gets one :class:`Watchdog`, started on first use, with a daemon thread that
wakes a few times per ``stall_s``. Readers wrap each batch in :meth:`Watchdog.watch` and write
the key of the sample being read into the returned :class:`Activity` (one attribute store per
sample, so it costs nothing measurable). When an activity runs past the limit the thread writes
one line naming the process, the duration and the key, then ``faulthandler`` dumps every thread's
stack -- the only way to see where a C call (a stuck NFS read, a deadlocked transform) sits.

Output goes to ``stall_file`` (appended; the same file from every worker) or to stderr (fd 2,
which DataLoader workers share with the trainer), and the line is also logged.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

log = logging.getLogger(__name__)


#: How long a report waits for a lazily named key (see :attr:`Activity.resolve`).
RESOLVE_TIMEOUT_S = 2.0


class Activity:
    """One watched batch: when it started, what it is, and the sample key it is on.

    ``key`` is the sample key, or, when ``resolve`` is set, a cheaper token that
    ``resolve(token)`` turns into the key only if a report needs it: the fast read path stores
    the record's 8-byte LMDB key instead of decoding the source key of every sample.
    """

    __slots__ = ("label", "started", "key", "resolve", "reported")

    def __init__(self, label: str) -> None:
        self.label = label
        self.started = time.monotonic()
        self.key: object = None
        self.resolve: Callable[[Any], str] | None = None
        self.reported = False

    def describe_key(self) -> str:
        """The key for a report; a lazy one is resolved on a helper thread, with a time limit
        (the reader may be stuck on the very page that holds it)."""
        key, resolve = self.key, self.resolve
        if key is None:
            return "(none yet)"
        if resolve is None:
            return repr(key)
        found: list[str] = []

        def run() -> None:
            try:
                found.append(repr(resolve(key)))
            except Exception as exc:  # the report must still go out
                found.append(f"(token {key!r}: {type(exc).__name__}: {exc})")

        helper = threading.Thread(target=run, name="epochcache-stall-key", daemon=True)
        helper.start()
        helper.join(RESOLVE_TIMEOUT_S)
        return found[0] if found else f"(token {key!r}: reading its key timed out)"


def _process_name() -> str:
    torch_data = sys.modules.get("torch.utils.data")
    info = torch_data.get_worker_info() if torch_data is not None else None
    if info is not None:
        return f"DataLoader worker {info.id} (pid {os.getpid()})"
    return f"training process (pid {os.getpid()})"


class Watchdog:
    """Watches the activities of one process and reports those running past ``stall_s``.

    Args:
        stall_s: the limit per batch, in seconds.
        stall_file: append reports here instead of stderr.
    """

    def __init__(self, stall_s: float, stall_file: str | None = None) -> None:
        if not stall_s > 0:
            raise ValueError(f"stall_s: must be a positive number of seconds, got {stall_s!r}")
        self.stall_s = float(stall_s)
        self.stall_file = stall_file
        self.reports = 0
        self._active: dict[int, Activity] = {}
        self._pid = os.getpid()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="epochcache-stall", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def watch(self, label: str) -> Iterator[Activity]:
        """Watch the calling thread's work on ``label`` until the block exits."""
        activity = Activity(label)
        ident = threading.get_ident()
        previous = self._active.get(ident)
        self._active[ident] = activity
        try:
            yield activity
        finally:
            if previous is None:
                self._active.pop(ident, None)
            else:
                self._active[ident] = previous
            if activity.reported:
                elapsed = time.monotonic() - activity.started
                self._emit(f"epochcache: stalled {activity.label} finished after {elapsed:.1f} s "
                           f"in {_process_name()}", dump=False)

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        interval = min(1.0, self.stall_s / 4)
        while not self._stop.wait(interval):
            now = time.monotonic()
            for activity in list(self._active.values()):
                if not activity.reported and now - activity.started > self.stall_s:
                    activity.reported = True
                    self.reports += 1
                    key = activity.describe_key()
                    self._emit(
                        f"epochcache: STALL in {_process_name()}: {activity.label} has taken "
                        f"{now - activity.started:.1f} s (stall_s={self.stall_s:g}); it is on "
                        f"sample key {key}. Stacks of all its threads follow.",
                        dump=True,
                    )

    def _emit(self, message: str, dump: bool) -> None:
        log.warning("%s", message)
        stream: IO[str] | None = None
        try:
            if self.stall_file is not None:
                stream = open(self.stall_file, "a", encoding="utf-8")
                fd = stream.fileno()
            else:
                fd = 2  # the real stderr: sys.stderr may be a capture object without a fileno
            os.write(fd, (message + "\n").encode("utf-8", errors="replace"))
            if dump:
                faulthandler.dump_traceback(file=fd, all_threads=True)
        except OSError:
            log.exception("could not write the stall report")
        finally:
            if stream is not None:
                stream.close()


_lock = threading.Lock()
_watchdogs: dict[tuple[int, float, str | None], Watchdog] = {}


def _after_fork_in_child() -> None:
    # A fork from a background thread (epochs() builds DataLoaders there) may catch another
    # thread holding the lock; the child would then block on it forever.
    global _lock
    _lock = threading.Lock()
    _watchdogs.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def get_watchdog(stall_s: float | None, stall_file: str | None = None) -> Watchdog | None:
    """This process's watchdog for these settings (None when ``stall_s`` is None).

    Watchdog threads do not survive ``fork()``, so the registry is keyed by pid and a forked
    worker starts its own on first use.
    """
    if stall_s is None:
        return None
    key = (os.getpid(), float(stall_s), stall_file)
    dog = _watchdogs.get(key)
    if dog is None:
        with _lock:
            dog = _watchdogs.get(key)
            if dog is None:
                dog = _watchdogs[key] = Watchdog(stall_s, stall_file)
    return dog


@contextlib.contextmanager
def watching(stall_s: float | None, label: str,
             stall_file: str | None = None) -> Iterator[Activity | None]:
    """``with watching(stall_s, "batch 3"):`` -- a no-op when ``stall_s`` is None."""
    dog = get_watchdog(stall_s, stall_file)
    if dog is None:
        yield None
        return
    with dog.watch(label) as activity:
        yield activity
