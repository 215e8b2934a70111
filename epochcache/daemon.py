"""``epochcache.Daemon``: the supervised samplers of ``epochcache daemon``, run from Python.

    with ec.Daemon("configs/s3.yaml"):          # or a dict in the YAML schema, or a Config
        for epoch, loader in cache.epochs(10): ...

The daemon runs in a child process of its own (`serve`), not in a thread of the caller,
because that is what survives both places people call it from:

* **a training script** need not guard its top level with ``if __name__ == "__main__"``:
  samplers are started with ``spawn`` (LMDB and fork do not mix), and ``spawn`` re-imports the
  main module of the process that starts them; from a thread of the script that would run the
  script again in every sampler. Here the samplers' parent is the daemon process, whose main
  module is a one-line ``-c`` of epochcache's. The supervision loop, the heartbeats and the metrics server do not
  share the training loop's GIL either;
* **a notebook**: the daemon outlives the cell that started it, a kernel interrupt (SIGINT)
  reaches neither it nor its samplers, and when the kernel dies or restarts the daemon sees
  its parent gone within a second and stops in order (samplers commit what they fetched).
  Its log lines are relayed into this process's ``logging`` (logger ``epochcache.daemon``).

[`Daemon.start`][epochcache.Daemon.start] raises the errors ``epochcache daemon`` exits 2 on.
Credentials go to the child through a pipe, never through a file or argv.

The child reads its config from stdin (JSON, `EpochcacheConfig.to_transfer`), then runs
`run_daemon` as ``epochcache daemon`` does. One JSON line on its stdout tells the parent how the
start went::

    {"event": "ready", "pid": 1234}                                     samplers are starting
    {"event": "error", "type": "SourceUnavailable", "message": "..."}  nothing was started

Its logs go to stderr as ``LEVEL logger: message`` lines (`LOG_FORMAT`), which the parent
relays. It stops in order on SIGTERM/SIGINT, and when its parent process is gone.

Importing this module imports nothing heavy; the config model is loaded by [`Daemon`][epochcache.Daemon].
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from typing import IO, TYPE_CHECKING, Any

from . import errors

if TYPE_CHECKING:
    from .config import EpochcacheConfig

log = logging.getLogger("epochcache.daemon")

#: The child's log lines, ``LEVEL logger: message``, as it writes them and the parent parses them.
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
LOG_LINE = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) ([\w.]+): (.*)$")
#: How long [`Daemon.stop`][epochcache.Daemon.stop] waits by default: the samplers' own grace period, and a margin.
STOP_TIMEOUT_S = 45.0


def resolve_config(config: Any) -> EpochcacheConfig:
    """A validated config from a path, a mapping in the YAML schema, or a config.

    Raises:
        ConfigError: the file or a field is invalid (the message names it).
        TypeError: ``config`` is none of those.
    """
    from .config import EpochcacheConfig, load_config, parse_config

    if isinstance(config, EpochcacheConfig):
        return config
    if isinstance(config, Mapping):
        return parse_config(config)
    if isinstance(config, (str, os.PathLike)):
        return load_config(config)
    raise TypeError(
        f"config: expected a path, a dict in the YAML schema or an epochcache Config, got "
        f"{type(config).__name__}"
    )


def _error_from(event: Mapping[str, Any]) -> errors.EpochcacheError:
    kind = getattr(errors, str(event.get("type")), None)
    message = str(event.get("message", "the daemon failed to start"))
    if isinstance(kind, type) and issubclass(kind, errors.EpochcacheError):
        return kind(message)
    return errors.EpochcacheError(message)


def _relay(stream: IO[bytes], tail: list[str]) -> None:
    """Log the child's stderr lines here, at their level, and keep the last few."""
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace").rstrip("\n")
        tail.append(line)
        del tail[:-40]
        match = LOG_LINE.match(line)
        if match:
            level, name, message = match.groups()
            log.log(getattr(logging, level), "%s: %s", name, message)
        elif line:
            log.info("%s", line)  # samplers' lines, tracebacks
    stream.close()


def _terminate(popen: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    """SIGTERM, wait, then SIGKILL (its samplers die with it); the exit status."""
    if popen.poll() is None:
        popen.send_signal(signal.SIGTERM)
        try:
            return popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.error("daemon pid %d did not stop within %.0fs; killing it (committed samples "
                      "are kept)", popen.pid, timeout_s)
            popen.kill()
            return popen.wait()
    return popen.returncode


class Daemon:
    """The sampler daemon of one config, in a child process (see the module docstring).

    Args:
        config: a path to a YAML config, a dict in the YAML schema, or a ``Config``
            ([`epochcache.load_config`][epochcache.load_config]). Validated here.

    Raises:
        ConfigError: the config is invalid (nothing is started).
    """

    def __init__(self, config: Any) -> None:
        self.config = resolve_config(config)
        self.cache_dir = str(self.config.cache.dir)
        self._popen: subprocess.Popen[bytes] | None = None
        self._relay: threading.Thread | None = None
        self._tail: list[str] = []
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self.exit_status: int | None = None

    # -- lifecycle --------------------------------------------------------------------------

    def start(self, timeout_s: float | None = None) -> Daemon:
        """Start the daemon; return once it holds the cache and has listed its sources.

        Args:
            timeout_s: give up (and stop it) if listing takes longer; None waits as long as
                the daemon lives.

        Raises:
            ConfigError, SourceUnavailable: as ``epochcache daemon`` exits 2 on them (the
                field, or the source and its URL, named).
            DaemonAlreadyRunning: another daemon fills this cache (the single-instance lock).
            EpochcacheError: the daemon process failed to start.
            RuntimeError: this daemon was already started.
        """
        if self._popen is not None:
            raise RuntimeError(f"{self!r} was already started; stop() it, or make a new Daemon")
        popen = subprocess.Popen(
            # -c, not -m: `python -m epochcache.daemon` would run this module a second time
            # (the package imports it first)
            [sys.executable, "-c",
             "from epochcache.daemon import serve; raise SystemExit(serve())"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            # Its own process group: a Ctrl-C meant for the training loop (or a notebook's
            # interrupt) must not stop the daemon behind the training's back.
            start_new_session=True,
        )
        self._popen = popen
        self._tail = []
        assert popen.stdin is not None and popen.stdout is not None and popen.stderr is not None
        self._relay = threading.Thread(target=_relay, args=(popen.stderr, self._tail),
                                       name="epochcache-daemon-log", daemon=True)
        self._relay.start()
        # At interpreter exit (or when this object is dropped) the daemon is stopped in order.
        self._finalizer = weakref.finalize(self, _terminate, popen, STOP_TIMEOUT_S)
        try:
            popen.stdin.write(json.dumps(self.config.to_transfer()).encode())
            popen.stdin.close()
            event = self._wait_ready(popen, timeout_s)
        except BaseException:
            self._finish(_terminate(popen, 10))
            raise
        if event.get("event") != "ready":
            self._finish(popen.wait())
            raise _error_from(event)
        log.info("daemon pid %d is filling %s", popen.pid, self.cache_dir)
        return self

    def _wait_ready(self, popen: subprocess.Popen[bytes], timeout_s: float | None) -> dict[str, Any]:
        assert popen.stdout is not None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        fd = popen.stdout.fileno()
        while True:
            wait = 0.5 if deadline is None else min(0.5, max(0.0, deadline - time.monotonic()))
            if select.select([fd], [], [], wait)[0]:
                line = popen.stdout.readline()
                if line:
                    return dict(json.loads(line))
                status = popen.wait()
                if self._relay is not None:
                    self._relay.join(5)
                tail = "\n".join(self._tail[-15:])
                raise errors.EpochcacheError(
                    f"{self.cache_dir}: the daemon process exited with status {status} before it "
                    f"started:\n{tail}")
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{self.cache_dir}: the daemon did not list its sources within "
                                   f"{timeout_s}s")

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """Stop the samplers in order (each commits what it fetched) and the daemon.

        Waits up to ``timeout`` seconds, then kills the daemon (its samplers die with it;
        committed samples are kept). Returns the daemon's exit status (0: stopped cleanly),
        None if it was never started. Safe to call more than once.
        """
        popen = self._popen
        if popen is None:
            return None
        self._finish(_terminate(popen, timeout))
        return self.exit_status

    def _finish(self, status: int | None) -> None:
        self.exit_status = status
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._relay is not None:
            self._relay.join(5)
        if self._popen is not None and self._popen.stdout is not None:
            self._popen.stdout.close()

    def __enter__(self) -> Daemon:
        if self._popen is None:
            self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- what it is doing -------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The daemon process's pid (None before [`start`][epochcache.Daemon.start])."""
        return None if self._popen is None else self._popen.pid

    @property
    def alive(self) -> bool:
        """Whether the daemon process is running (it exits 1 if its samplers keep dying)."""
        return self._popen is not None and self._popen.poll() is None

    def status(self) -> dict[str, Any]:
        """What ``epochcache status --json`` prints for this cache (samples, bytes, capacity,
        leases, ``daemon`` with per-sampler health, ...)."""
        from .status import stats_with_coverage
        from .store import SampleStore

        with SampleStore(self.cache_dir, readonly=True) as cache:
            return stats_with_coverage(cache)

    def __repr__(self) -> str:
        state = "alive" if self.alive else ("not started" if self._popen is None else
                                            f"exited {self._popen.returncode}")
        return f"Daemon({self.cache_dir!r}, pid={self.pid}, {state})"


# -- the child process ---------------------------------------------------------------------


def _say(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def serve() -> int:
    """The daemon process's entry point; returns the exit status (2: nothing was started)."""
    parent_pid = os.getppid()
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    from .config import EpochcacheConfig
    from .ingest.sampler import QUIET_LIBRARIES
    from .ingest.supervisor import run_daemon

    for noisy, level in QUIET_LIBRARIES.items():
        logging.getLogger(noisy).setLevel(level)

    started = False

    def ready(_daemon: Any) -> None:
        nonlocal started
        started = True
        _say({"event": "ready", "pid": os.getpid()})

    try:
        config = EpochcacheConfig.from_transfer(json.loads(sys.stdin.read()))
        return run_daemon(config, parent_pid=parent_pid, ready=ready)
    except errors.EpochcacheError as exc:
        if started:
            log.error("the daemon failed: %s", exc)
            return 1
        _say({"event": "error", "type": type(exc).__name__, "message": str(exc)})
        return 2
    except BaseException as exc:
        if not started:
            _say({"event": "error", "type": type(exc).__name__,
                  "message": f"{type(exc).__name__}: {exc}"})
        raise
