"""A job under test and every process it starts: found, signalled and killed the ways a
cluster stops a job (issue 26, items 6 and 7).

A job is started in a session of its own with a tag in its environment (see
:mod:`common.procs`, which finds a job's processes by the tag, the process tree and the
sessions it leads: torchrun starts its ranks in sessions of their own, and a process whose
parent died is re-parented to init).

Synchronisation is by conditions polled with generous deadlines (:func:`wait_for`), never by
sleeping a fixed time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

from common.procs import cmdline, freeze_and_kill, job_procs, job_tag, proc_stat

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


def describe(pids: Sequence[int] | set[int]) -> str:
    """``pid (command line)`` for each process, for a failure message."""
    return ", ".join(f"{pid} ({cmdline(pid, 120)})" for pid in sorted(pids)) or "none"


def _default_sigint() -> None:
    # As a job started from a terminal: pytest-xdist's workers ignore SIGINT, and a process
    # inherits that (epochcache run then keeps ignoring it, as a shell's background job).
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Job:
    """A job started in a session of its own, its output in files under ``logdir``.

    Its processes are found and killed with :mod:`common.procs` (a tag in the environment,
    the process tree and the sessions it leads).

    Args:
        argv: the command.
        cwd: its working directory.
        env: its environment (the tag is added).
        name: names its output files (``NAME.out``, ``NAME.err``).
        logdir: where they go.
    """

    def __init__(self, argv: Sequence[str], *, cwd: Path, env: dict[str, str], name: str,
                 logdir: Path) -> None:
        self.name = name
        self.tag = job_tag()
        self.out_path, self.err_path = logdir / f"{name}.out", logdir / f"{name}.err"
        self._files: list[IO[Any]] = [open(self.out_path, "wb"),  # noqa: SIM115 - closed by close()
                                      open(self.err_path, "wb")]  # noqa: SIM115
        self.popen = subprocess.Popen(
            list(argv), cwd=cwd, env={**env, self.tag[0]: self.tag[1]},
            stdin=subprocess.DEVNULL, stdout=self._files[0], stderr=self._files[1],
            start_new_session=True, preexec_fn=_default_sigint)
        root = proc_stat(self.popen.pid)
        self._roots = {} if root is None else {root.pid: root.start}

    @property
    def pid(self) -> int:
        return self.popen.pid

    def returncode(self) -> int | None:
        """The root's exit status (None while it runs); reaps it."""
        return self.popen.poll()

    def processes(self) -> set[int]:
        """Every live process of the job, the root included."""
        self.popen.poll()  # a root that exited is reaped, not counted as a zombie
        return {stat.pid for stat in job_procs(self._roots, self.tag)}

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
        """SIGKILL every process of the job at once (a node failure; frozen first, so none
        escapes: :func:`common.procs.freeze_and_kill`) and wait until none is left; returns
        the processes killed.

        Raises:
            AssertionError: some process survived ``timeout_s``.
        """
        killed = self.processes()
        left = freeze_and_kill(self._roots, self.tag, timeout_s)
        self.popen.poll()
        assert not left, f"{self.name}: still running after SIGKILL: " \
            f"{describe([stat.pid for stat in left])}"
        return killed

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
