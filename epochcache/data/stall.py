"""Stall watchdog: a batch slower than ``stall_s`` dumps the stacks, names the sample key, and
(by default) ends the job with [`StallError`][epochcache.StallError].

Invariant 6 (no hangs). Every process that reads samples (the training process and each
DataLoader worker) gets one `Watchdog`, started on first use, with a daemon thread that
wakes a few times per ``stall_s``. Readers wrap each batch in `Watchdog.watch` and write
the key of the sample being read into the returned `Activity` (one attribute store per
sample, so it costs nothing measurable). When an activity runs past the limit the thread writes
one line naming the process, the duration and the key, then ``faulthandler`` dumps every thread's
stack -- the only way to see where a C call (a stuck NFS read, a deadlocked transform) sits.
A training process waiting for its DataLoader workers also names the worker that owes the
batch and has each worker dump its own stacks: `arm_stack_dump` registers
``faulthandler`` on `DUMP_SIGNAL` in the trainer, whose forked workers inherit it
(handled in C, so a worker deadlocked at start-up still answers), and in spawned ones.

Then, with the action ``raise`` (``loader.stall_action``, the default), the stalled work fails
with a [`StallError`][epochcache.StallError] naming the epoch, batch, key and worker: a reader raises it where it
stalled (an asynchronous exception in its thread, turned into the full error when it leaves
`Watchdog.watch`); a trainer waiting for workers stops them, and their loss becomes the
error. A thread stuck in C code that never returns to Python cannot be interrupted: when it is
still stuck ``stall_s`` after the error (at least 30 s), the process ends with status
`STALL_EXIT_STATUS` (75, "temporary failure": a scheduler's restart and ``--resume``
recover, the lease kept for the resume). ``warn`` only reports. A report is also recorded in
the cache directory (``stalls/<pid>.json``), where ``epochcache status`` shows it.

Output goes to ``stall_file`` (appended; the same file from every worker) or to stderr (fd 2,
which DataLoader workers share with the trainer), and the line is also logged.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from ..errors import StallError
from ..paths import forget_stall, record_stall

log = logging.getLogger(__name__)

#: How long a report waits for a lazily named key (see `Activity.resolve`).
RESOLVE_TIMEOUT_S = 2.0
#: The exit status of a process whose stalled thread could not be interrupted (EX_TEMPFAIL).
STALL_EXIT_STATUS = 75
#: The signal on which a reading process dumps its threads' stacks (see `arm_stack_dump`).
DUMP_SIGNAL: int | None = (signal.SIGRTMIN + 4) if hasattr(signal, "SIGRTMIN") else None
#: The signal that wakes a main thread blocked in a system call (a lock, a sleep, a read) so
#: that its StallError is raised there (see `_raise_in`).
WAKE_SIGNAL: int | None = (signal.SIGRTMIN + 5) if hasattr(signal, "SIGRTMIN") else None
#: How long a report waits for a worker to write its stacks before the next one.
_WORKER_DUMP_WAIT_S = 0.5


@dataclass
class WorkerCheck:
    """What a stalled activity waits for (its workers), found when a report is due (see
    `Activity.check`): lines for the report, the pids of the processes whose stacks
    to dump, and the worker and key for the error."""

    lines: list[str] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)
    worker: str = ""
    key: str = ""


class Activity:
    """One watched batch: when it started, what it is, and the sample key it is on.

    ``key`` is the sample key, or, when ``resolve`` is set, a cheaper token that
    ``resolve(token)`` turns into the key only if a report needs it: the fast read path stores
    the record's 8-byte LMDB key instead of decoding the source key of every sample.
    ``check``, ``on_raise`` and ``cache_path`` are set by a trainer that waits for workers.
    """

    __slots__ = ("label", "started", "key", "resolve", "reported", "action", "check",
                 "on_raise", "error", "thread", "cache_path", "raised_at", "lock", "done")

    def __init__(self, label: str, action: str = "warn",
                 lock: threading.Lock | None = None) -> None:
        self.label = label
        self.started = time.monotonic()
        self.key: object = None
        self.resolve: Callable[[Any], str] | None = None
        self.reported = False
        self.action = action
        self.check: Callable[[], WorkerCheck] | None = None
        #: Makes the stalled work fail (a trainer stops its workers); default: an
        #: asynchronous StallError in the activity's thread.
        self.on_raise: Callable[[StallError], None] | None = None
        self.error: StallError | None = None
        self.thread = threading.get_ident()
        self.cache_path: str | None = None
        self.raised_at = 0.0
        # Deciding the error and leaving the block exclude each other: an error decided is
        # always raised by the block, never later in code after it (see Watchdog.watch). A
        # watchdog's activities share its lock: one allocated per batch showed in profiles.
        self.lock = lock or threading.Lock()
        self.done = False

    def describe_key(self) -> str:
        """The key for a report; a lazy one is resolved on a helper thread, with a time limit
        (the reader may be stuck on the very page that holds it)."""
        key, resolve = self.key, self.resolve
        if key is None:
            return "(none yet)"
        if resolve is None:
            return repr(key)
        return with_time_limit(lambda: repr(resolve(key)), f"token {key!r}")


def with_time_limit(fn: Callable[[], str], what: str) -> str:
    """``fn()`` on a helper thread, or a note if it fails or takes over RESOLVE_TIMEOUT_S."""
    found: list[str] = []

    def run() -> None:
        try:
            found.append(fn())
        except Exception as exc:  # noqa: BLE001 - the report must still go out
            found.append(f"({what}: {type(exc).__name__}: {exc})")

    helper = threading.Thread(target=run, name="epochcache-stall-key", daemon=True)
    helper.start()
    helper.join(RESOLVE_TIMEOUT_S)
    return found[0] if found else f"({what}: reading it timed out)"


def _process_name() -> str:
    torch_data = sys.modules.get("torch.utils.data")
    info = torch_data.get_worker_info() if torch_data is not None else None
    if info is not None:
        return f"DataLoader worker {info.id} (pid {os.getpid()})"
    return f"training process (pid {os.getpid()})"


def process_state(pid: int) -> str:
    """``"S (sleeping) in futex_wait_queue"``: a process's state and kernel wait channel."""
    try:
        with open(f"/proc/{pid}/status") as f:
            state = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("State:")), "?")
        with open(f"/proc/{pid}/wchan") as f:
            wchan = f.read().strip()
    except OSError:
        return "gone"
    return f"{state} in {wchan}" if wchan and wchan != "0" else state


def catches_signal(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` now (``SigCgt`` in
    ``/proc/<pid>/status``); False where that cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next((line.split(":", 1)[1] for line in f if line.startswith("SigCgt:")), "")
        return bool(int(mask, 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        return False


_waking: set[int] = set()  # threads with a StallError to raise (see _wake)


def _wake(signum: int, _frame: Any) -> None:
    if threading.get_ident() in _waking:
        raise StallError("stalled")  # replaced by the full error in Watchdog.watch


def _raise_in(thread: int) -> None:
    """Raise StallError in ``thread`` at its next Python instruction; a main thread blocked in
    a system call (where that instruction never comes) is woken by `WAKE_SIGNAL`."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread),
                                               ctypes.py_object(StallError))
    if (thread == threading.main_thread().ident and WAKE_SIGNAL is not None
            and signal.getsignal(WAKE_SIGNAL) is _wake):
        _waking.add(thread)
        signal.pthread_kill(thread, WAKE_SIGNAL)


def _clear_raise(thread: int) -> None:
    """Drop a StallError pending for ``thread`` (the block it was meant for raises it)."""
    _waking.discard(thread)
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), None)


def _decided(activity: Activity) -> StallError | None:
    with activity.lock:
        activity.done = True
        error = activity.error
    if error is not None:
        _clear_raise(activity.thread)
    return error


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
        self._active: dict[int, Activity] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="epochcache-stall", daemon=True)
        self._thread.start()

    def watch(self, label: str, action: str = "warn") -> _Watch:
        """Watch the calling thread's work on ``label`` until the block exits
        (``with dog.watch(...) as activity:``).

        With ``action="raise"`` a stall makes the block fail with [`StallError`][epochcache.StallError].
        """
        return _Watch(self, Activity(label, action, self._lock))

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        interval = min(1.0, self.stall_s / 4)
        while not self._stop.wait(interval):
            now = time.monotonic()
            for activity in list(self._active.values()):
                if not activity.reported and now - activity.started > self.stall_s:
                    activity.reported = True
                    self._report(activity, now)
                elif activity.raised_at and now - activity.raised_at > max(30.0, self.stall_s):
                    self._emit(f"epochcache: the stalled {activity.label} in {_process_name()} "
                               f"did not return {now - activity.raised_at:.0f} s after its "
                               f"StallError (stuck in C code): ending the process with exit "
                               f"status {STALL_EXIT_STATUS}", dump=True)
                    os._exit(STALL_EXIT_STATUS)

    def _report(self, activity: Activity, now: float) -> None:
        key = activity.describe_key()
        check = activity.check() if activity.check is not None else WorkerCheck()
        if check.key:
            key = check.key
        self._emit(
            f"epochcache: STALL in {_process_name()}: {activity.label} has taken "
            f"{now - activity.started:.1f} s (stall_s={self.stall_s:g}); it is on "
            f"sample key {key}. Stacks of all its threads follow.", dump=True)
        for line in check.lines:
            self._emit(f"epochcache: {line}", dump=False)
        for pid in check.pids:  # each worker writes its own stacks (see arm_stack_dump)
            if DUMP_SIGNAL is None:
                break
            # The signal's default action ends a process: a worker that has not armed its
            # handler yet (a spawned one still importing) would be killed by its report.
            if not catches_signal(pid, DUMP_SIGNAL):
                self._emit(f"epochcache: process {pid} cannot dump its stacks yet (still "
                           f"starting up: {process_state(pid)}); it is left alone", dump=False)
                continue
            try:
                os.kill(pid, DUMP_SIGNAL)
            except OSError:
                continue
            time.sleep(_WORKER_DUMP_WAIT_S)
        if activity.cache_path:
            _record_stall(activity, key, check.worker, now)
        if activity.action != "raise":
            return
        error = StallError(
            f"{activity.label} stalled for {now - activity.started:.0f} s (stall_s="
            f"{self.stall_s:g}) in {_process_name()}"
            + (f", waiting for {check.worker}" if check.worker else "")
            + ("" if activity.key is None and not check.key else f"; sample key {key}")
            + ". The stacks were written to "
            f"{self.stall_file or 'stderr'}: a stuck read, a deadlocked transform or worker? "
            "The job ends here (stall_action 'raise'); restart it with --resume, or raise "
            "stall_s for batches that are slow by design")
        with activity.lock:
            if activity.done:
                return
            activity.error = error
            activity.raised_at = time.monotonic()
            if activity.on_raise is None:
                _raise_in(activity.thread)
        if activity.on_raise is not None:
            activity.on_raise(error)

    def _emit(self, message: str, dump: bool) -> None:
        log.warning("%s", message)
        stream: IO[str] | None = None
        try:
            if self.stall_file is not None:
                stream = open(self.stall_file, "a", encoding="utf-8")  # noqa: SIM115 - closed below
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


class _Watch:
    """One `Watchdog.watch` block: the activity is watched from ``__enter__`` to
    ``__exit__``. A class, not a generator: readers open one per batch, and two nested
    generator context managers cost 7 us a batch (3% of a batch of 64 1 KiB samples)."""

    __slots__ = ("activity", "dog", "previous")

    def __init__(self, dog: Watchdog, activity: Activity) -> None:
        self.dog, self.activity = dog, activity
        self.previous: Activity | None = None

    def __enter__(self) -> Activity:
        activity = self.activity
        active = self.dog._active
        self.previous = active.get(activity.thread)
        active[activity.thread] = activity
        return activity

    def __exit__(self, _exc_type: type[BaseException] | None, exc: BaseException | None,
                 _tb: types.TracebackType | None) -> None:
        activity = self.activity
        try:
            error = _decided(activity)
        finally:
            if self.previous is None:
                self.dog._active.pop(activity.thread, None)
            else:
                self.dog._active[activity.thread] = self.previous
            if activity.reported:
                _forget_stall(activity)
                if activity.error is None:
                    elapsed = time.monotonic() - activity.started
                    self.dog._emit(f"epochcache: stalled {activity.label} finished after "
                                   f"{elapsed:.1f} s in {_process_name()}", dump=False)
        if error is None or exc is error:
            return
        if exc is None:  # finished just as the stall was decided: the job ends
            raise error
        raise error from (None if isinstance(exc, StallError) else exc)


def _record_stall(activity: Activity, key: str, worker: str, now: float) -> None:
    """Record the stall in the cache for ``epochcache status`` (best effort)."""
    assert activity.cache_path is not None
    try:
        record_stall(activity.cache_path, {
            "process": _process_name(), "what": activity.label, "key": key, "worker": worker,
            "action": activity.action, "since": time.time() - (now - activity.started)})
    except OSError as exc:
        log.debug("could not record the stall in %s: %s", activity.cache_path, exc)


def _forget_stall(activity: Activity) -> None:
    # A stall that ended is no longer current (the job's log keeps it); one that raised
    # stays until the process ends.
    if activity.cache_path and activity.error is None:
        forget_stall(activity.cache_path)


_lock = threading.Lock()
#: This process's pid, kept current across forks: os.getpid() is a system call, and the read
#: path asks for its watchdog once a batch.
_pid = os.getpid()
_watchdogs: dict[tuple[int, float, str | None], Watchdog] = {}
_armed: dict[int, Any] = {}  # pid -> the file the stack dump goes to (kept open)


def arm_stack_dump(stall_file: str | None = None) -> None:
    """Make this process dump every thread's stack on `DUMP_SIGNAL` (once per process;
    processes forked from it inherit the handler), and, called in the main thread, let
    `WAKE_SIGNAL` raise a decided StallError there. Real-time signals no launcher or
    framework uses (Slurm and Lightning use SIGUSR1/SIGUSR2); a handler someone else put on
    them is left alone."""
    if (WAKE_SIGNAL is not None and threading.current_thread() is threading.main_thread()
            and signal.getsignal(WAKE_SIGNAL) == signal.SIG_DFL):
        signal.signal(WAKE_SIGNAL, _wake)
    pid = os.getpid()
    if DUMP_SIGNAL is None or pid in _armed:
        return
    target: Any = 2
    if stall_file is not None:
        try:
            target = open(stall_file, "a", encoding="utf-8")  # noqa: SIM115 - kept open
        except OSError:
            target = 2
    try:
        faulthandler.register(DUMP_SIGNAL, file=target, all_threads=True, chain=False)
    except (OSError, RuntimeError, ValueError) as exc:
        log.debug("cannot arm the stack dump on signal %s: %s", DUMP_SIGNAL, exc)
        return
    _armed[pid] = target


def _after_fork_in_child() -> None:
    # A fork from a background thread may catch another thread holding the lock; the child
    # would then block on it forever. (The stack-dump handler is inherited, and stays armed.)
    global _lock, _pid
    _lock = threading.Lock()
    _pid = os.getpid()
    _watchdogs.clear()
    parent = next(iter(_armed.values()), None)
    _armed.clear()
    if parent is not None:
        _armed[os.getpid()] = parent


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def get_watchdog(stall_s: float | None, stall_file: str | None = None) -> Watchdog | None:
    """This process's watchdog for these settings (None when ``stall_s`` is None).

    Watchdog threads do not survive ``fork()``, so the registry is keyed by pid and a forked
    worker starts its own on first use.
    """
    if stall_s is None:
        return None
    key = (_pid, float(stall_s), stall_file)
    dog = _watchdogs.get(key)
    if dog is None:
        with _lock:
            dog = _watchdogs.get(key)
            if dog is None:
                dog = _watchdogs[key] = Watchdog(stall_s, stall_file)
    return dog


def watching(stall_s: float | None, label: str, stall_file: str | None = None,
             action: str = "warn",
             cache_path: str | None = None) -> contextlib.AbstractContextManager[Activity | None]:
    """``with watching(stall_s, "batch 3") as activity:`` -- a no-op (``activity`` None) when
    ``stall_s`` is None."""
    dog = get_watchdog(stall_s, stall_file)
    if dog is None:
        return _UNWATCHED
    if action == "raise" and _pid not in _armed:
        arm_stack_dump(stall_file)
    watch = dog.watch(label, action)
    watch.activity.cache_path = cache_path
    return watch


_UNWATCHED: contextlib.nullcontext[None] = contextlib.nullcontext()
