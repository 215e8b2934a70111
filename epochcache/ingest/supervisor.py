"""The supervisor behind ``epochcache daemon CONFIG`` (and [`epochcache.Daemon`][epochcache.Daemon]): the sampler
processes that keep a cache growing, started, watched and restarted.

The daemon validates the config and lists the source before starting anything (a bad config or
an unreachable source exits 2 with nothing started), holds an exclusive lock on the cache so a
second daemon refuses to start, starts ``sampler.processes`` samplers with ``spawn`` (LMDB and
fork do not mix), restarts any that die, writes its heartbeat and the samplers' health into the
cache, appends stats history rows for plots, and on SIGTERM/SIGINT stops the samplers in order:
each commits its batch in flight, then exits; the daemon exits 0. A SIGTERM that reaches a
sampler (sent to the whole process group or control group: Slurm, systemd, ``timeout``) stops
the daemon the same way: a sampler stopped by a signal is not a crash to restart.

The lock is taken before the cache is opened with the config's capacity, so a refused daemon
changes nothing. Samplers die with the daemon (see `process`). The signal handler only
sets a flag and writes to a pipe (`StopRequest`): the supervision loop waits on that pipe,
never on a lock a handler could need.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import multiprocessing
import os
import select
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from typing import Any

from ..config import EpochcacheConfig
from ..errors import DaemonAlreadyRunning
from ..paths import first_missing, process_record
from ..redact import redact_url
from ..store import SampleStore
from ..store.env import make_private_dir
from ..store.owners import lock_held
from ..store.plumbing import append_history, reclaim_leases, register_sources
from ..units import format_count, format_size
from .committer import state_name
from .daemon_sources import DaemonSources
from .health import ingest_rate
from .lineage import DAEMON_LOCK_FILE, daemon_doc, daemon_sources
from .process import Lifeline
from .prometheus import MetricsServer, daemon_metrics, require_prometheus
from .sampler import StopFlag, log_levels, run_sampler

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
HISTORY_S = 5.0
PROGRESS_LOG_S = 30.0
STOP_GRACE_S = 30.0
#: A sampler that dies this often in a row is given up on (and the daemon exits 1).
MAX_RESTARTS_IN_A_ROW = 10


class DaemonLock:
    """An exclusive ``flock`` on the cache's lock file: released by the kernel if we die. The
    file says who holds it and the sources it fills from (`lineage.daemon_doc`): a run reads
    them before it attaches."""

    def __init__(self, cache_dir: str, doc: dict[str, Any]) -> None:
        self.path = os.path.join(cache_dir, DAEMON_LOCK_FILE)
        self._doc = doc
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DaemonAlreadyRunning(
                f"{os.path.dirname(self.path)}: another epochcache daemon is already filling this "
                f"cache (pid {self.pid()}); stop it first, or point cache.dir elsewhere"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(self._doc).encode())
        self._fd = fd

    def pid(self) -> str:
        """The pid of the daemon holding the lock now, as its file says (``unknown``)."""
        found = daemon_sources(os.path.dirname(self.path))
        return str(found[0]) if found is not None and found[0] else "unknown"

    @staticmethod
    def is_held(cache_dir: str) -> bool:
        return lock_held(os.path.join(cache_dir, DAEMON_LOCK_FILE)) is True

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


class StopRequest:
    """A stop flag that a signal handler may set while the main thread waits on it.

    ``threading.Event`` is not safe for that: ``Event.set()`` takes the lock that ``Event.wait()``
    holds around its condition variable, and a handler runs in the main thread, between two
    bytecodes of that very ``wait()``: the main thread then waits for itself forever. Here
    `set` assigns a flag and writes a byte to a pipe (no lock); `wait` sleeps in
    ``select`` on the pipe. Safe from signal handlers and from other threads.
    """

    def __init__(self) -> None:
        self._flag = False
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def set(self) -> None:
        self._flag = True
        if self._write >= 0:
            with contextlib.suppress(OSError):  # the pipe is full: a wake-up is pending anyway
                os.write(self._write, b"x")

    def is_set(self) -> bool:
        return self._flag

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep until `set` or ``timeout``; return whether it is set."""
        if not self._flag:
            if self._read < 0:
                raise ValueError("StopRequest is closed")
            select.select([self._read], [], [], timeout)
            with contextlib.suppress(BlockingIOError):  # drained
                while os.read(self._read, 512):
                    pass
        return self._flag

    def close(self) -> None:
        """Close the pipe (`set` still sets the flag afterwards)."""
        fds, self._read, self._write = (self._read, self._write), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)

    def __del__(self) -> None:
        self.close()


@dataclass
class _SamplerProcess:
    """One sampler process the supervisor keeps running (restarted when it dies)."""

    index: int
    process: Any = None
    restarts: int = 0
    deaths_in_a_row: int = 0
    started: float = field(default_factory=time.monotonic)
    restart_at: float | None = None  # a dead sampler waits out its backoff until then


class Supervisor:
    """Supervises the samplers of one config. `run` blocks until `stop`.

    Args:
        config: a validated config (``source`` or ``sources``, ``cache``, ``sampler``).
        parent_pid: stop in order once this process is gone (None: run until stopped).
    """

    def __init__(self, config: EpochcacheConfig, *, parent_pid: int | None = None) -> None:
        self.config = config
        # Run for a Python program (epochcache.Daemon): stop in order when it is gone.
        self._parent = Lifeline(parent_pid)
        self.cache_dir = str(config.cache.dir)
        self._stop = StopRequest()
        self._ctx = multiprocessing.get_context("spawn")
        self._sampler_stop = StopFlag(self._ctx)
        self._slots = [_SamplerProcess(i) for i in range(config.sampler.processes)]
        self._lock = DaemonLock(self.cache_dir, daemon_doc(config))
        self.cache: SampleStore | None = None
        self.sources = DaemonSources(config)
        self.metrics: MetricsServer | None = None
        self._stopped_by: str | None = None  # the signal that stopped it, for the log
        #: Why `run` gave up (exit status 1), also in the daemon's state document.
        self.failure: str | None = None

    def prepare(self) -> int:
        """Take the lock, open the cache, list the sources. Raises before anything is started.

        Raises:
            DaemonAlreadyRunning: another daemon fills this cache (nothing was changed).
            SourceUnavailable: a source that is not optional cannot be listed (named).
        """
        cfg = self.config.cache
        if self.config.daemon.metrics_port is not None:
            require_prometheus("daemon.metrics_port")  # before anything is touched
        created = first_missing(self.cache_dir)  # removed again if the start fails
        make_private_dir(self.cache_dir)
        # The lock first: a daemon that is refused must not have rewritten the stored capacity.
        self._lock.acquire()
        try:
            self.cache = SampleStore(
                cfg.dir, capacity=cfg.capacity, headroom=cfg.headroom_bytes,
                compression=cfg.compression, level=cfg.level, sync=cfg.sync,
                eviction=cfg.eviction,
            )
            # the listings' request counters go on from the last daemon's
            self.sources.saved = self.cache.tables.get_state("daemon") or {}
            keys = self.sources.list_all()
            names = [entry.name for entry in self.config.source_entries() if entry.name]
            if names:  # per-source counters, kept by the store from now on
                register_sources(self.cache, names)
            port = self.config.daemon.metrics_port
            if port is not None:
                cache = self.cache
                self.metrics = MetricsServer(lambda: daemon_metrics(cache),
                                             self.config.daemon.metrics_host, port,
                                             "daemon.metrics_port")
        except BaseException:
            if self.cache is not None:
                self.cache.close()
                self.cache = None
            self._lock.release()
            if created is not None:  # a start that failed leaves no cache directory behind
                shutil.rmtree(created, ignore_errors=True)
            raise
        return keys

    def stop(self, signum: int | None = None, *_: Any) -> None:
        """Stop in order (also the SIGTERM/SIGINT handler: ``signum`` names it in the log)."""
        if signum is not None and self._stopped_by is None:
            self._stopped_by = signal.Signals(signum).name
        self._stop.set()

    def run(self) -> int:
        """Start the samplers and supervise them until stopped. Returns the exit status."""
        if self.cache is None:
            self.prepare()
        assert self.cache is not None  # for mypy: prepare() sets it
        started = time.time()
        status = 0
        try:
            self.sources.start()
            for slot in self._slots:
                self._start(slot)
            last_history = last_log = 0.0
            while not self._stop.is_set():
                now = time.monotonic()
                if self._parent.parent_gone():
                    break
                if not self._supervise():
                    status = 1
                    break
                if self._sampler_stop.is_set():
                    # Only a sampler's SIGTERM handler sets it while we run: the signal went
                    # to the whole process group or control group (Slurm's job step, systemd,
                    # `timeout`, a run's group), and reached the samplers first. A stop, not
                    # a crash: stop the others in order, as for our own SIGTERM.
                    log.info("a sampler was stopped by SIGTERM (sent to the whole process "
                             "group?); stopping the samplers")
                    break
                if self.sources.joined.is_set():
                    self.sources.joined.clear()
                    self._restart_samplers()
                self._heartbeat(started)
                if now - last_history >= HISTORY_S:
                    append_history(self.cache)
                    reclaim_leases(self.cache)
                    last_history = now
                if now - last_log >= PROGRESS_LOG_S:
                    self._log_progress()
                    last_log = now
                self._stop.wait(HEARTBEAT_S)
        except Exception as exc:
            self.failure = f"{type(exc).__name__}: {exc}"  # published by the last heartbeat
            raise
        finally:
            self.sources.stop()
            if self.metrics is not None:
                self.metrics.close()
            self._shutdown()
            self._heartbeat(started, stopped=True)
            append_history(self.cache)
            counters = self.cache.counters()
            log.info("the daemon stopped%s; the cache holds %s samples (%s)",
                     f" on {self._stopped_by}" if self._stopped_by else "",
                     f"{counters.samples:,}", format_size(counters.bytes))
            self._lock.release()
            self.cache.close()
            self._stop.close()
        return status

    def _start(self, slot: _SamplerProcess) -> None:
        data = self.config.to_transfer()  # keeps what the samplers must mask
        names = self.sources.names if self.config.sources is not None else None
        slot.process = self._ctx.Process(
            target=run_sampler,
            args=(data, slot.index, self._sampler_stop, os.getpid(), names, log_levels()),
            name=f"epochcache-sampler-{slot.index}",
            daemon=False,
        )
        # Started with SIGINT and SIGTERM blocked (the mask survives spawn's exec): a signal to
        # the process group while the sampler still imports would end it with a
        # KeyboardInterrupt traceback, or kill it before its handler exists (a crash to
        # restart). Blocked, not lost: run_sampler unblocks them once its handlers are set.
        # multiprocessing's resource tracker is started first: starting it unblocks both
        # signals in the calling thread afterwards.
        resource_tracker.ensure_running()
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            slot.process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        slot.started = time.monotonic()

    def _supervise(self) -> bool:
        """Restart dead samplers (after a backoff, without blocking the loop); False once one
        keeps dying."""
        now = time.monotonic()
        if self._sampler_stop.is_set():
            return True  # stopping (run() ends next): a sampler that exited was told to
        for slot in self._slots:
            if slot.restart_at is not None:
                if now >= slot.restart_at and not self._stop.is_set():
                    slot.restart_at = None
                    self._start(slot)
                continue
            proc = slot.process
            if proc.is_alive():
                if now - slot.started > 60:
                    slot.deaths_in_a_row = 0
                continue
            slot.restarts += 1
            slot.deaths_in_a_row += 1
            if slot.deaths_in_a_row > MAX_RESTARTS_IN_A_ROW:
                assert self.cache is not None  # for mypy: run() opened it
                last = (self.cache.tables.get_state(state_name(slot.index)) or {}).get(
                    "last_error") or "none recorded"
                self.failure = (f"sampler {slot.index} (pid {proc.pid}) exited with "
                                f"{proc.exitcode} {slot.deaths_in_a_row} times in a row; its last "
                                f"error: {last}")
                log.error("%s; giving up (see the errors above)", self.failure)
                return False
            delay = min(30.0, 0.5 * 2 ** (slot.deaths_in_a_row - 1))
            log.warning("sampler %d (pid %s) exited with %s; restarting it in %.1fs", slot.index,
                        proc.pid, proc.exitcode, delay)
            slot.restart_at = now + delay
        return True

    def _heartbeat(self, started: float, stopped: bool = False) -> None:
        assert self.cache is not None
        samplers: dict[str, Any] = {}
        states = self.cache.tables.states("sampler/")
        for slot in self._slots:
            doc = dict(states.get(state_name(slot.index), {}))
            alive = bool(slot.process is not None and slot.process.is_alive())
            doc.update(pid=slot.process.pid if slot.process else None, alive=alive, restarts=slot.restarts)
            samplers[str(slot.index)] = doc
        active = set(self.sources.names)
        self.cache.tables.put_state(
            "daemon",
            {
                **process_record(),
                "started": started,
                "heartbeat": time.time(),
                "stopped": stopped,
                "failure": self.failure,
                "source": redact_url(self.config.first_source.url),
                "metrics": self.metrics.url if self.metrics is not None else None,
                "listings": self.sources.progress(),
                "requests": self.sources.requests(),
                "sources": {
                    entry.name: {"url": redact_url(entry.config.url), "weight": entry.weight,
                                 "active": entry.name in active}
                    for entry in self.config.source_entries() if entry.name
                },
                "samplers": samplers,
            },
        )

    def _log_progress(self) -> None:
        cache = self.cache
        assert cache is not None
        counters = cache.counters()
        capacity = cache.effective_capacity
        fill = counters.bytes / capacity if capacity else 0.0
        ingest = ingest_rate(cache.history(limit=200))
        # Past 100% of the capacity is the headroom at work (epochs hold their snapshots):
        # the line says what the limit is, so 110% does not read as a broken promise.
        log.info(
            "cache %s / %s (%.0f%%; limit %s with the headroom), %s, ingest %.1f samples/s "
            "%s/s, evicted %s, quarantined %s",
            format_size(counters.bytes), format_size(capacity), 100 * fill,
            format_size(capacity + cache.headroom_bytes),
            format_count(counters.samples, "sample"), ingest["samples_per_s"],
            format_size(ingest["bytes_per_s"]), f"{counters.evicted:,}",
            f"{counters.quarantined:,}",
        )

    def _restart_samplers(self) -> None:
        """Stop the samplers in order and start them again (a source joined)."""
        self._shutdown()
        self._sampler_stop = StopFlag(self._ctx)
        for slot in self._slots:
            slot.restart_at = None
            self._start(slot)

    def _shutdown(self) -> None:
        self._sampler_stop.set()
        deadline = time.monotonic() + STOP_GRACE_S
        for slot in self._slots:
            if slot.process is None:
                continue
            slot.process.join(max(0.1, deadline - time.monotonic()))
            if slot.process.is_alive():
                log.warning("sampler %d did not stop in %.0fs; terminating it", slot.index, STOP_GRACE_S)
                slot.process.terminate()
                slot.process.join(5)
                if slot.process.is_alive():
                    slot.process.kill()
                    slot.process.join()


def run_daemon(config: EpochcacheConfig, *, parent_pid: int | None = None,
               ready: Callable[[Supervisor], None] | None = None) -> int:
    """Run a daemon in this process until SIGTERM/SIGINT; returns the exit status.

    Args:
        config: the validated config.
        parent_pid: stop (in order) once this process is gone (see `epochcache.daemon`).
        ready: called once the lock is held and the source listed, before samplers start.
    """
    daemon = Supervisor(config, parent_pid=parent_pid)
    daemon.prepare()
    # The handler is safe to run at any point of the main thread: see StopRequest.
    previous = {sig: signal.signal(sig, daemon.stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if ready is not None:
            ready(daemon)  # after the handlers: a stop asked from now on is an orderly one
        return daemon.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
