"""Run ``python -m epochcache daemon CONFIG`` as a real process and watch it through its cache.

The daemon starts in a new session, so every process it creates (samplers, multiprocessing's
resource tracker) shares its session id: :meth:`DaemonProc.session_pids` finds them even after
the daemon itself died, which is how tests prove that no orphan is left, and :meth:`close` kills
whatever remains. Waiting is by polling the cache's state with a timeout, never a blind sleep.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from epochcache import Cache
from epochcache.errors import CacheError

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")
#: demo samples are float32 ``.npy`` noise of about this size: incompressible, so stored bytes
#: track remote bytes and capacities can be given in samples
SAMPLE_BYTES = 4096


def upload(
    url_of: Callable[[str], str], storage_options: dict[str, Any], prefix: str, samples: int, layout: str,
    **kwargs: Any,
) -> list[str]:
    """Write the demo dataset under ``url_of(prefix)``; return every remote sample key."""
    from epochcache.demo import write_demo_data

    write_demo_data(
        url_of(prefix), samples, layout, storage_options=storage_options,  # type: ignore[arg-type]
        sample_bytes=SAMPLE_BYTES, **kwargs,
    )
    if layout == "files":
        return [f"sample-{i:06d}.npy" for i in range(samples)]
    per_shard = kwargs.get("samples_per_shard", 100)
    return [f"shard-{i // per_shard:06d}.tar/{i:06d}" for i in range(samples)]


def write_config(
    path: Path,
    *,
    url: str,
    cache_dir: Path,
    storage_options: dict[str, Any],
    layout: str = "files",
    capacity: int | str = "64MiB",
    source: dict[str, Any] | None = None,
    cache: dict[str, Any] | None = None,
    sampler: dict[str, Any] | None = None,
) -> Path:
    """Write a daemon config (small, fast defaults: 2 processes, short timeouts)."""
    data = {
        "source": {
            "url": url,
            "layout": layout,
            "pattern": "*.npy" if layout == "files" else "*.tar",
            "storage_options": storage_options,
            "timeout_s": 5,
            "connect_timeout_s": 2,
            "list_deadline_s": 3,
            **(source or {}),
        },
        "cache": {"dir": str(cache_dir), "capacity": capacity, **(cache or {})},
        "sampler": {"processes": 2, "concurrency": 8, "batch_size": 16, **(sampler or {})},
    }
    path.write_text(yaml.safe_dump(data))
    return path


def wait_for(predicate: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def read_cache(cache_dir: Path, fn: Callable[[Cache], T]) -> T | None:
    """``fn(cache)`` on a read-only view of the cache, or None if it does not exist yet."""
    try:
        cache = Cache(cache_dir, readonly=True)
    except CacheError:
        return None
    try:
        return fn(cache)
    finally:
        cache.close()


def cache_len(cache_dir: Path) -> int:
    return read_cache(cache_dir, len) or 0


def daemon_state(cache_dir: Path) -> dict[str, Any] | None:
    return read_cache(cache_dir, lambda c: c.tables.get_state("daemon"))


def sampler_states(cache_dir: Path) -> dict[str, dict[str, Any]]:
    """The samplers' own health documents (``sampler/<i>``)."""
    return read_cache(cache_dir, lambda c: c.tables.states("sampler/")) or {}


def all_samplers(cache_dir: Path, count: int, predicate: Callable[[dict[str, Any]], Any]) -> bool:
    """``count`` samplers have written their health and ``predicate`` holds for each (no
    documents yet is not "all of them": ``all()`` of nothing would be true)."""
    states = sampler_states(cache_dir)
    return len(states) >= count and all(predicate(h) for h in states.values())


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, session id) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[3])


def pid_running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    stat = _proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


class DaemonProc:
    """One ``epochcache daemon`` process; stdout and stderr go to files in ``workdir``."""

    def __init__(self, workdir: Path, config: Path, *, name: str = "daemon", args: tuple[str, ...] = (),
                 daemon_args: tuple[str, ...] = ()) -> None:
        self.name = name
        self.out_path = workdir / f"{name}.stdout"
        self.err_path = workdir / f"{name}.stderr"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["PYTHONUNBUFFERED"] = "1"
        env["COLUMNS"] = "200"  # rich wraps log lines at 80 columns otherwise (and splits URLs)
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "epochcache", *args, "daemon", str(config), *daemon_args],
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=workdir,
                start_new_session=True,
            )
        self.pid = self.popen.pid

    def logs(self) -> str:
        parts = []
        for path in (self.out_path, self.err_path):
            try:
                parts.append(path.read_text(errors="replace"))
            except OSError:
                pass
        return "\n".join(parts)

    def session_pids(self) -> list[int]:
        """Live (non-zombie) processes of the daemon's session, the daemon included."""
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                stat = _proc_stat(int(entry))
                if stat is not None and stat[2] == self.pid and stat[0] not in ("Z", "X"):
                    found.append(int(entry))
        return found

    def wait(self, timeout_s: float = 30.0) -> int:
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} did not exit in {timeout_s}s\n{self.logs()[-3000:]}") from None

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM and wait for the exit status."""
        self.signal(signal.SIGTERM)
        return self.wait(timeout_s)

    def kill9(self) -> int:
        self.signal(signal.SIGKILL)
        return self.wait(10)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def close(self) -> None:
        """Kill everything left in the daemon's session (teardown)."""
        for pid in self.session_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(timeout=30)


def wait_running(daemon: DaemonProc, cache_dir: Path, timeout_s: float = 30.0) -> dict[str, Any]:
    """Wait until the daemon's state shows every sampler alive; return that state."""

    def ready() -> dict[str, Any] | None:
        if not daemon.alive():
            raise AssertionError(f"{daemon.name} exited ({daemon.popen.returncode})\n{daemon.logs()[-3000:]}")
        state = daemon_state(cache_dir)
        if state and state.get("pid") == daemon.pid and state.get("samplers"):
            if all(s.get("alive") for s in state["samplers"].values()):
                return state
        return None

    return wait_for(ready, timeout_s, f"{daemon.name} to report running samplers")


def wait_cached(daemon: DaemonProc | None, cache_dir: Path, count: int, timeout_s: float = 60.0) -> int:
    """Wait until at least ``count`` samples are cached (failing early if the daemon died)."""

    def enough() -> int:
        if daemon is not None and not daemon.alive():
            raise AssertionError(f"{daemon.name} exited ({daemon.popen.returncode})\n{daemon.logs()[-3000:]}")
        n = cache_len(cache_dir)
        return n if n >= count else 0

    return wait_for(enough, timeout_s, f"{count} cached samples in {cache_dir}")
