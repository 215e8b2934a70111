"""Helper processes for fault tests: run a small Python script, wait for its marker, kill -9.

Synchronisation is by lines the child prints on stdout (``READY``, ``SNAP ...``), read with a
timeout, never by sleeping. The child's stderr goes to a file that is shown when it fails.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


class Proc:
    """A running helper script. Use :meth:`wait_line` for markers and :meth:`kill9` to crash it."""

    def __init__(self, popen: subprocess.Popen[bytes], stderr_path: Path, name: str) -> None:
        self.popen = popen
        self.stderr_path = stderr_path
        self.name = name
        self.lines: list[str] = []
        self._buf = b""

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def _fail(self, why: str) -> None:
        raise AssertionError(
            f"helper {self.name} (pid {self.pid}): {why}\n--- stderr ---\n{self.stderr()}"
        )

    def wait_line(self, prefix: str, timeout_s: float = 30.0) -> str:
        """Return the first (unread) stdout line starting with ``prefix``."""
        assert self.popen.stdout is not None
        deadline = time.monotonic() + timeout_s
        fd = self.popen.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                while b"\n" in self._buf:
                    raw, self._buf = self._buf.split(b"\n", 1)
                    line = raw.decode(errors="replace")
                    self.lines.append(line)
                    if line.startswith(prefix):
                        return line
                left = deadline - time.monotonic()
                if left <= 0:
                    self._fail(
                        f"no line starting with {prefix!r} within {timeout_s}s; "
                        f"got {self.lines[-5:]}"
                    )
                if sel.select(timeout=min(left, 1.0)):
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        self.popen.wait()
                        self._fail(
                            f"exited ({self.popen.returncode}) before printing {prefix!r}; "
                            f"got {self.lines[-5:]}"
                        )
                    self._buf += chunk

    def send(self, line: str) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(line.encode() + b"\n")
        self.popen.stdin.flush()

    def kill9(self) -> int:
        """SIGKILL the process and reap it; return its exit status."""
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGKILL)
        return self.popen.wait(timeout=30)

    def wait(self, timeout_s: float = 60.0) -> int:
        try:
            code = self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill9()
            self._fail(f"did not exit within {timeout_s}s")
        return code

    def wait_ok(self, timeout_s: float = 60.0) -> None:
        code = self.wait(timeout_s)
        if code != 0:
            self._fail(f"exited with status {code}; stdout tail {self.lines[-5:]}")

    def close(self) -> None:
        self.kill9()
        for stream in (self.popen.stdout, self.popen.stdin):
            if stream is not None:
                stream.close()


def spawn_script(
    workdir: Path, name: str, code: str, *args: str, env: dict[str, str] | None = None,
    prefix: tuple[str, ...] = (),
) -> Proc:
    """Write ``code`` to ``workdir/name.py`` and run it with this interpreter.

    The script gets ``sys.argv[1:] == args``; ``tests/`` is on its ``sys.path`` so it can
    import ``common``. stdout is a pipe (markers), stdin a pipe (commands), stderr a file.
    ``prefix`` runs it under another command (``unshare --pid --fork --kill-child ...``).
    """
    script = workdir / f"{name}.py"
    script.write_text(textwrap.dedent(code))
    stderr_path = workdir / f"{name}.stderr"
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "tests"), str(REPO), child_env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    child_env["PYTHONUNBUFFERED"] = "1"
    child_env.update(env or {})
    with open(stderr_path, "wb") as err:
        popen = subprocess.Popen(
            [*prefix, sys.executable, str(script), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            env=child_env,
            cwd=workdir,
        )
    return Proc(popen, stderr_path, name)


def run_processes(target: Any, args_of: list[tuple[Any, ...]], timeout_s: float) -> None:
    """Run ``target(*args)`` for each of ``args_of`` in spawned processes (ranks of a test
    job) and wait for all; a process still running after ``timeout_s`` is killed and fails
    the test, as does one that exits non-zero."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args) for args in args_of]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
        p.join(5)
    assert not alive, f"{len(alive)} of {len(procs)} processes still running after {timeout_s} s"
    assert [p.exitcode for p in procs] == [0] * len(procs), [p.exitcode for p in procs]


def wait_until_gone(pids: list[int], timeout_s: float) -> None:
    """Wait until none of ``pids`` (processes this one did not start, e.g. an orphaned
    DataLoader worker) runs any more; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
            except OSError:
                continue
            if state != b"Z":  # a zombie has exited (its parent reaps it)
                alive.append(pid)
        if not alive:
            return
        assert time.monotonic() < deadline, f"processes {alive} still run after {timeout_s} s"
        time.sleep(0.1)
