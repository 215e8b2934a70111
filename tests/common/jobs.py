"""A job under test and every process it starts: found, signalled and killed the ways a
cluster stops a job (issue 26, items 6 and 7).

A job is started in a session of its own with a marker in its environment
(``EPOCHCACHE_TEST_JOB=<id>``). Every process it starts inherits the marker, whatever session,
process group or parent it ends up in: torchrun starts its ranks in sessions of their own (so
``killpg`` of the job's group misses them), and a process whose parent died is re-parented to
init (so a walk of the tree from the root misses it). "Every process of the job" is therefore
the marker's processes plus the root's descendants, read from /proc; zombies are dead.

Synchronisation is by conditions polled with generous deadlines (:func:`wait_for`), never by
sleeping a fixed time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

MARKER = "EPOCHCACHE_TEST_JOB"

T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout_s: float, what: str,
             poll_s: float = 0.05) -> T:
    """Poll ``condition`` until it returns something true, and return that; AssertionError
    naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(poll_s)


def _stat(pid: int) -> tuple[str, int] | None:
    """``(state, parent pid)`` of a process, None once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # The command name is in parentheses and may hold anything: split after the last one.
    fields = raw[raw.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[1])


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def marked(marker: str) -> set[int]:
    """Live processes whose environment holds ``EPOCHCACHE_TEST_JOB=marker``."""
    needle = f"{MARKER}={marker}".encode()
    found = set()
    for pid in _pids():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:  # gone, or another user's
            continue
        if needle in environ.split(b"\0") and alive(pid):
            found.add(pid)
    return found


def descendants(root: int) -> set[int]:
    """Live processes below ``root`` in the process tree (not ``root`` itself)."""
    children: dict[int, list[int]] = {}
    for pid in _pids():
        stat = _stat(pid)
        if stat is not None and stat[0] != "Z":
            children.setdefault(stat[1], []).append(pid)
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def describe(pids: Sequence[int] | set[int]) -> str:
    """``pid (command line)`` for each process, for a failure message."""
    parts = []
    for pid in sorted(pids):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            cmd = "?"
        parts.append(f"{pid} ({cmd.strip()[:120]})")
    return ", ".join(parts) or "none"


def _default_sigint() -> None:
    # As a job started from a terminal: pytest-xdist's workers ignore SIGINT, and a process
    # inherits that (epochcache run then keeps ignoring it, as a shell's background job).
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Job:
    """A job started in a session of its own, its output in files under ``logdir``.

    Args:
        argv: the command.
        cwd: its working directory.
        env: its environment (the marker is added).
        name: names its output files (``NAME.out``, ``NAME.err``).
        logdir: where they go.
    """

    def __init__(self, argv: Sequence[str], *, cwd: Path, env: dict[str, str], name: str,
                 logdir: Path) -> None:
        self.name = name
        self.marker = uuid.uuid4().hex
        self.out_path, self.err_path = logdir / f"{name}.out", logdir / f"{name}.err"
        self._files: list[IO[Any]] = [open(self.out_path, "wb"), open(self.err_path, "wb")]
        self.popen = subprocess.Popen(
            list(argv), cwd=cwd, env={**env, MARKER: self.marker}, stdin=subprocess.DEVNULL,
            stdout=self._files[0], stderr=self._files[1], start_new_session=True,
            preexec_fn=_default_sigint)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def returncode(self) -> int | None:
        """The root's exit status (None while it runs); reaps it."""
        return self.popen.poll()

    def processes(self) -> set[int]:
        """Every live process of the job (see the module docstring), the root included."""
        self.popen.poll()  # a root that exited is reaped, not counted as a zombie
        found = marked(self.marker) | descendants(self.pid)
        if self.popen.returncode is None and alive(self.pid):
            found.add(self.pid)
        return found

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the job's process group (a terminal's Ctrl-C; Slurm, torchrun
        and systemd signal the job the same way, and torchrun passes it to its ranks)."""
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:
            pass

    def kill(self, pid: int) -> None:
        """SIGKILL one process of the job (the OOM killer's choice)."""
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def kill_all(self, timeout_s: float = 60.0) -> set[int]:
        """SIGKILL every process of the job at once (a node failure) and wait until none is
        left; returns the processes killed.

        Each process found is frozen first (SIGSTOP), so none can start another or react to
        its parent's death before it is killed; the search is repeated until it finds nothing
        new.

        Raises:
            AssertionError: some process survived ``timeout_s``.
        """
        frozen: set[int] = set()
        while True:
            found = self.processes() - frozen
            if not found:
                break
            for pid in found:
                try:
                    os.kill(pid, signal.SIGSTOP)
                except ProcessLookupError:
                    pass
            frozen |= found
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        left = self.wait_gone(timeout_s)
        assert not left, f"{self.name}: still running after SIGKILL: {describe(left)}"
        return frozen

    def wait_exit(self, timeout_s: float) -> int | None:
        """The root's exit status, or None if it still runs after ``timeout_s``."""
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def wait_gone(self, timeout_s: float) -> set[int]:
        """Wait until no process of the job is left; returns those still there after
        ``timeout_s`` (empty when none)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = self.processes()
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    def close(self) -> set[int]:
        """Kill whatever is left of the job (returns what was) and close its files."""
        left = self.processes()
        try:
            if left:
                self.kill_all()
        finally:
            for f in self._files:
                f.close()
        return left
