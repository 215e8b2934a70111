"""The tests' own "kill the whole job" (``common.procs.kill_job``) leaves nothing running, and
the check that no test leaves a process behind finds what one did (issue 26, item 7).

``killpg`` of a launcher's group is not a node failure: torchrun starts every rank in a session
of its own, a daemon's children outlive it re-parented to init, and a process forking while it
is killed leaves its new child behind. The job here does all three; every one of its processes
must be gone after :func:`kill_job`.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from common.procs import (
    LeftoverCheck,
    cmdline,
    job_procs,
    job_tag,
    kill_job,
    proc_stat,
    spawn_script,
)

JOB = """
import os, subprocess, sys, time

def sleeper(new_session):
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                            start_new_session=new_session).pid

pids = [sleeper(True), sleeper(True)]  # ranks in sessions of their own, as torchrun starts them
daemon = os.fork()
if daemon == 0:  # a daemon: its child is re-parented (to init) once it exits
    os.setsid()
    if os.fork() == 0:
        time.sleep(600)
    os._exit(0)
os.waitpid(daemon, 0)  # reaped: nothing leads the orphan's session any more
forker = os.fork()
if forker == 0:  # forks short-lived children all the time
    while True:
        if os.fork() == 0:
            time.sleep(0.05)
            os._exit(0)
        time.sleep(0.01)
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
print("READY", *pids, forker, flush=True)
time.sleep(600)
"""


def test_kill_job_leaves_no_process_of_the_job(tmp_path: Path) -> None:
    tag = job_tag()
    job = spawn_script(tmp_path, "job", JOB, env=dict([tag]))
    try:
        ranks = [int(p) for p in job.wait_line("READY").split()[1:3]]
        # What killpg of the launcher's group misses: the ranks lead sessions of their own ...
        assert all(os.getsid(rank) == rank for rank in ranks)
        # ... and the orphan of the daemon is out of reach of any walk from the job's root.
        start = proc_stat(job.pid).start  # type: ignore[union-attr]
        tagged = {stat.pid: stat for stat in job_procs({job.pid: start}, tag)}
        walked = {stat.pid for stat in job_procs({job.pid: start})}
        assert {job.pid, *ranks} <= walked
        assert [pid for pid, stat in tagged.items() if stat.ppid not in tagged], tagged
    finally:
        kill_job(job, tag=tag)
        job.close()
    assert job.popen.returncode == -signal.SIGKILL
    left = job_procs({}, tag)
    assert left == [], [(s.pid, cmdline(s.pid)) for s in left]


def test_what_a_test_leaves_running_is_reported_and_killed(tmp_path: Path,
                                                           session_tag: tuple[str, str]) -> None:
    """The conftest's no_process_left_behind: a job whose processes outlive the test (the
    old ranks of a torchrun job, a daemon's orphan) is named and killed; a process that ends
    within the grace is not reported."""
    check = LeftoverCheck(session_tag, grace_s=5.0)
    quick = spawn_script(tmp_path, "quick", "import sys; print('READY'); sys.stdin.read()")
    job = spawn_script(tmp_path, "job", JOB)
    try:
        quick.wait_line("READY")
        job.wait_line("READY")
        quick.popen.stdin.close()  # type: ignore[union-attr]  # it ends now, within the grace
        report = check.check()
        assert report is not None and "job.py" in report and "time.sleep(600)" in report
        assert "quick.py" not in report
        assert check.left() == []  # all killed, the daemon's orphan too
    finally:
        kill_job(job, quick)
        job.close()
        quick.close()
