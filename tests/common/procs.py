"""Helper processes for fault tests: run a small Python script, wait for its marker, kill -9;
and kill a whole job, every process of it, as a node failure does (:func:`kill_job`).

Synchronisation is by lines the child prints on stdout (``READY``, ``SNAP ...``), read with a
timeout, never by sleeping. The child's stderr goes to a file that is shown when it fails.
"""

from __future__ import annotations

import gc
import os
import selectors
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from dataclasses import dataclass
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


def platform_start_method() -> None:
    """Make this spawned process start its children as a fresh interpreter would, as torchrun
    starts a rank: with the platform's multiprocessing start method. A process started from a
    spawn context otherwise starts its own children (DataLoader workers) by spawn too
    (BaseProcess._bootstrap forces its own method), each importing torch again: two seconds
    of CPU a worker, a third of the CPU of the suite's DDP tests."""
    import multiprocessing as mp

    mp.set_start_method(None, force=True)


def as_launched(target: Any, *args: Any) -> None:
    """``target(*args)`` after :func:`platform_start_method`: the target of a rank's process."""
    platform_start_method()
    target(*args)


def run_processes(target: Any, args_of: list[tuple[Any, ...]], timeout_s: float) -> None:
    """Run ``target(*args)`` for each of ``args_of`` in spawned processes (ranks of a test
    job) and wait for all; a process still running after ``timeout_s`` is killed and fails
    the test, as does one that exits non-zero."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=as_launched, args=(target, *args)) for args in args_of]
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


# -- whole jobs: every process found, frozen, killed -----------------------------------------
#
# "Kill the whole job" (a node failure, a preemption without notice) means every process the
# job started, wherever it went: torchrun starts each rank in a session of its own, so
# ``killpg`` of torchrun's group leaves the ranks running (and re-parented to init once
# torchrun is gone, out of reach of a walk from it). :func:`kill_job` finds a job's processes
# by their parent chains, by the sessions its processes lead, and optionally by a tag in their
# environment, which every child inherits whatever session or parent it ends up with.

#: The environment variable that tags every process a test session starts (see conftest).
SESSION_TAG = "EPOCHCACHE_TEST_SESSION"


@dataclass(frozen=True)
class ProcStat:
    """What ``/proc/<pid>/stat`` says about a process that matters here."""

    pid: int
    state: str
    ppid: int
    session: int
    start: int  # clock ticks after boot: with the pid, names one process (pids are reused)

    @property
    def alive(self) -> bool:
        return self.state not in ("Z", "X")


def proc_stat(pid: int) -> ProcStat | None:
    """The process's stat, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the name in parentheses may hold spaces
    return ProcStat(pid, fields[0], int(fields[1]), int(fields[3]), int(fields[19]))


def all_procs() -> dict[int, ProcStat]:
    """Every process of the machine, by pid."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = proc_stat(int(entry))
            if stat is not None:
                found[stat.pid] = stat
    return found


def cmdline(pid: int, limit: int = 200) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:limit]
    except OSError:
        return "?"


def has_tag(pid: int, name: str, value: str) -> bool:
    """Whether the process was started with ``name=value`` in its environment."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{name}={value}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def _ancestors(pid: int) -> set[int]:
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        stat = proc_stat(pid)
        if stat is None:
            break
        pid = stat.ppid
    return seen


def job_procs(roots: dict[int, int], tag: tuple[str, str] | None = None,
              procs: dict[int, ProcStat] | None = None, since: int = 0) -> list[ProcStat]:
    """The live processes of a job, parents before children: ``roots`` (pid -> start time),
    their descendants, every process in a session one of them leads, and with ``tag`` every
    process whose environment has it (of those started at ``since`` or later: older ones
    cannot have it). Never this process or its ancestors."""
    procs = all_procs() if procs is None else procs
    children: dict[int, list[int]] = {}
    sessions: dict[int, list[int]] = {}
    for stat in procs.values():
        children.setdefault(stat.ppid, []).append(stat.pid)
        sessions.setdefault(stat.session, []).append(stat.pid)
    found: dict[int, ProcStat] = {}
    todo = [pid for pid, start in roots.items() if pid in procs and procs[pid].start == start]
    if tag is not None:
        todo += [pid for pid, stat in procs.items() if stat.start >= since and has_tag(pid, *tag)]
    while todo:
        pid = todo.pop(0)  # breadth first: parents are found (and frozen) before children
        if pid in found:
            continue
        found[pid] = procs[pid]
        todo += children.get(pid, [])
        if procs[pid].session == pid:
            todo += sessions.get(pid, [])
    mine = _ancestors(os.getpid())
    return [stat for pid, stat in found.items() if pid not in mine and stat.alive]


def _signal(stat: ProcStat, sig: int) -> None:
    now = proc_stat(stat.pid)
    if now is not None and now.start == stat.start:  # the same process, not a reused pid
        try:
            os.kill(stat.pid, sig)
        except ProcessLookupError:
            pass


def _still_running(stats: list[ProcStat]) -> list[ProcStat]:
    left = []
    for stat in stats:
        now = proc_stat(stat.pid)
        if now is not None and now.start == stat.start and now.alive:
            left.append(now)
    return left


def freeze_and_kill(roots: dict[int, int], tag: tuple[str, str] | None = None,
                    timeout_s: float = 30.0) -> list[ProcStat]:
    """SIGKILL every process of a job (see :func:`job_procs`) so that none escapes: first
    SIGSTOP them all, parents before children, looking again for processes forked meanwhile
    until a look finds no new one (a stopped process forks no more, and a process whose
    parents are all stopped keeps its parent), then SIGKILL them all. Returns the processes
    that are still running ``timeout_s`` later (none, unless one is stuck in the kernel)."""
    frozen: dict[int, ProcStat] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        found = job_procs({**roots, **{p: s.start for p, s in frozen.items()}}, tag)
        new = [stat for stat in found if stat.pid not in frozen]
        if not new:
            break
        for stat in new:
            _signal(stat, signal.SIGSTOP)
            frozen[stat.pid] = stat
        # A stop is delivered asynchronously: a process forking right now may still add a
        # child. Wait until each is stopped (or gone), then look again. One in the kernel
        # (state D) stops when it comes back: it is not waited for long.
        settle = min(deadline, time.monotonic() + 2.0)
        while time.monotonic() < settle:
            if all(s.state in ("T", "t") for s in _still_running(new)):
                break
            time.sleep(0.01)
        if time.monotonic() >= deadline:
            break
    for stat in frozen.values():
        _signal(stat, signal.SIGKILL)
    while True:
        left = _still_running(list(frozen.values()))
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.02)


def kill_job(*roots: Any, tag: tuple[str, str] | None = None, timeout_s: float = 30.0) -> None:
    """Kill a whole job at once, as a node failure would (:func:`freeze_and_kill`), and fail
    if any of its processes is still running afterwards.

    Args:
        roots: the job's first processes: ``subprocess.Popen`` objects (reaped here),
            :class:`Proc` helpers, or pids.
        tag: ``(name, value)`` of an environment variable given to the job only: its
            processes are found wherever they went (a daemon's re-parented children too).
    """
    starts: dict[int, int] = {}
    popens = []
    for root in roots:
        popen = root.popen if isinstance(root, Proc) else root
        pid = popen.pid if isinstance(popen, subprocess.Popen) else int(popen)
        if isinstance(popen, subprocess.Popen):
            popens.append(popen)
        stat = proc_stat(pid)
        if stat is not None:
            starts[pid] = stat.start
    left = freeze_and_kill(starts, tag, timeout_s)
    for popen in popens:
        popen.wait(timeout=timeout_s)
    assert not left, "still running after SIGKILL of the whole job: " + "; ".join(
        f"pid {s.pid} ({s.state}) {cmdline(s.pid)}" for s in left)


def job_tag(name: str = "EPOCHCACHE_TEST_JOB") -> tuple[str, str]:
    """A fresh ``(name, value)`` to put in a job's environment for :func:`kill_job`."""
    return name, uuid.uuid4().hex


class Job:
    """A command started as a job of its own: a new session, and a tag in its environment
    that every process of it inherits (:func:`job_tag`), so :meth:`kill` finds them all.

    Args:
        argv: the command.
        env: its environment (default this process's); the tag is added to it.
        popen_kwargs: more arguments for ``subprocess.Popen`` (cwd, stdout, text, ...).
    """

    def __init__(self, argv: list[str], *, env: dict[str, str] | None = None,
                 **popen_kwargs: Any) -> None:
        self.tag = job_tag()
        env = dict(os.environ if env is None else env)
        env[self.tag[0]] = self.tag[1]
        self.popen: subprocess.Popen[Any] = subprocess.Popen(
            argv, env=env, start_new_session=True, **popen_kwargs)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def procs(self) -> list[ProcStat]:
        """Its processes still running."""
        stat = proc_stat(self.pid)
        return job_procs({} if stat is None else {self.pid: stat.start}, self.tag)

    def kill(self, timeout_s: float = 30.0) -> None:
        """SIGKILL every process of the job at once (a node failure); fails if one is left."""
        kill_job(self.popen, tag=self.tag, timeout_s=timeout_s)


#: Helpers multiprocessing starts once for the process that uses it and keeps until it exits.
_LIFELONG = ("from multiprocessing.resource_tracker import main",
             "from multiprocessing.forkserver import main")


class LeftoverCheck:
    """What a test left running: the processes started by this process (tagged with ``tag``
    in their environment, or its descendants) that were not running at :meth:`__init__`.
    multiprocessing's resource tracker and forkserver of this process itself are not counted
    (they live as long as it does).

    Args:
        tag: ``(name, value)`` every process this one starts inherits.
        grace_s: how long :meth:`check` lets them take to end.
    """

    def __init__(self, tag: tuple[str, str], grace_s: float) -> None:
        self.tag, self.grace_s = tag, grace_s
        me = proc_stat(os.getpid())
        self._since = 0 if me is None else me.start  # nothing older carries our tag
        self._before = {(pid, stat.start) for pid, stat in self._started_here().items()}

    def _started_here(self) -> dict[int, ProcStat]:
        me = os.getpid()
        procs = all_procs()
        # From the children, never from this process: its own session holds strangers.
        children = {pid: stat.start for pid, stat in procs.items() if stat.ppid == me}
        return {stat.pid: stat for stat in job_procs(children, self.tag, procs, self._since)
                if not (stat.ppid == me and any(text in cmdline(stat.pid) for text in _LIFELONG))}

    def left(self) -> list[ProcStat]:
        """The new processes running now."""
        return [stat for pid, stat in self._started_here().items()
                if (pid, stat.start) not in self._before]

    def check(self) -> str | None:
        """Wait up to ``grace_s`` for the new processes to end; kill those that do not (and
        all of theirs), and return a report of them (None: nothing was left)."""
        started = time.monotonic()
        collected = False
        while True:
            left = self.left()
            waited = time.monotonic() - started
            if not left or waited >= self.grace_s:
                break
            if not collected and waited >= min(2.0, self.grace_s / 2):
                gc.collect()  # a loader's workers that only garbage keeps end with it
                collected = True
            time.sleep(0.1)
        if not left:
            return None
        shown = "\n".join(f"  pid {stat.pid} (parent {stat.ppid}): {cmdline(stat.pid)}"
                          for stat in left)
        freeze_and_kill({stat.pid: stat.start for stat in left})
        return (f"{len(left)} process(es) still running {self.grace_s:g} s after the test "
                f"(now killed):\n{shown}")


def wait_until_gone(pids: list[int], timeout_s: float) -> None:
    """Wait until none of ``pids`` (processes this one did not start, e.g. the DataLoader
    workers of a trainer killed alone) runs any more; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [pid for pid in pids if (stat := proc_stat(pid)) is not None and stat.alive]
        if not alive:
            return
        assert time.monotonic() < deadline, f"processes {alive} still run after {timeout_s} s"
        time.sleep(0.1)
