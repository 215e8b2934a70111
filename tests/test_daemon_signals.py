"""The daemon's SIGTERM/SIGINT handler is safe wherever the main thread is (issue 10, item 10),
and a SIGTERM that reaches the samplers stops the daemon in order (issue 26, item 8).

A Python signal handler runs in the main thread between two bytecodes. If the handler took a
lock that the interrupted code holds (``Event.set()`` inside ``Event.wait()``), the main thread
would wait for itself forever. The test makes that moment likely: the main thread waits on the
daemon's stop request in a tight loop, exactly as the supervision loop does with a timeout,
while SIGTERM arrives at random moments, hundreds of times, in a real process.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from common.cachecheck import full_check
from common.daemonproc import (
    daemon_state,
    pid_running,
    sampler_states,
    upload,
    wait_cached,
    wait_running,
    write_config,
)
from common.procs import spawn_script

pytestmark = pytest.mark.timeout(120)


def test_stop_signal_at_any_moment_of_the_supervision_wait_is_handled(tmp_path: Path) -> None:
    proc = spawn_script(tmp_path, "signals", """
        import os, random, signal, sys, threading
        from epochcache.config import EpochcacheConfig
        from epochcache.ingest.supervisor import Supervisor

        config = EpochcacheConfig.model_validate({
            "source": {"url": sys.argv[1]}, "cache": {"dir": sys.argv[2], "capacity": "1MiB"}})
        for trial in range(int(sys.argv[3])):
            daemon = Supervisor(config)
            signal.signal(signal.SIGTERM, daemon.stop)  # what run_daemon installs
            timer = threading.Timer(random.uniform(0, 0.003), os.kill, (os.getpid(), signal.SIGTERM))
            timer.start()
            while not daemon._stop.wait(0):  # the wait of Supervisor.run's loop (HEARTBEAT_S -> 0)
                pass
            timer.join()
            if trial % 50 == 0:
                print("TRIAL", trial, flush=True)
        print("DONE", flush=True)
    """, str(tmp_path / "data"), str(tmp_path / "cache"), "400")
    try:
        proc.wait_line("DONE", timeout_s=30)
        proc.wait_ok(30)
    finally:
        proc.close()


@pytest.mark.parametrize("who", ["samplers", "group"])
def test_sigterm_that_reaches_the_samplers_stops_the_daemon_without_restarting_them(
    tmp_path: Path, start_daemon: Any, who: str
) -> None:
    """Slurm signals every process of a job step, systemd every process of a unit's control
    group, ``timeout`` its whole process group: the samplers get SIGTERM too, often before the
    daemon. A sampler stopped that way exited 0 and the daemon restarted it ("exited with 0;
    restarting it in 0.5s"), again and again with the stop flag set, until it gave up (exit
    1) or its own signal came. ``samplers``: only the samplers are signalled (they came first
    in the control group's list); ``group``: the daemon's whole process group."""
    n = 400
    upload(lambda prefix: (tmp_path / prefix).as_uri(), {}, "ds", n, "files")
    cache_dir = tmp_path / "cache"
    config = write_config(
        tmp_path / "cfg.yaml", url=(tmp_path / "ds").as_uri(), cache_dir=cache_dir,
        storage_options={},
        sampler={"bandwidth_limit": 600_000},  # about 150 samples/s: it is mid-run when stopped
    )
    daemon = start_daemon(config)
    state = wait_running(daemon, cache_dir)
    sampler_pids = [s["pid"] for s in state["samplers"].values()]
    wait_cached(daemon, cache_dir, 60)
    if who == "samplers":
        for pid in sampler_pids:
            os.kill(pid, signal.SIGTERM)
    else:
        os.killpg(daemon.pid, signal.SIGTERM)  # the daemon leads its own session and group
    assert daemon.wait(30) == 0, daemon.logs()[-3000:]
    logs = daemon.logs()
    assert "restarting" not in logs, logs[-3000:]
    assert not any(pid_running(pid) for pid in sampler_pids)
    deadline = time.monotonic() + 10
    while daemon.session_pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert daemon.session_pids() == []
    doc = daemon_state(cache_dir)
    assert doc is not None and doc["stopped"] is True and doc["failure"] is None
    assert all(not s["restarts"] for s in doc["samplers"].values()), doc["samplers"]
    checked = full_check(str(cache_dir))
    healths = sampler_states(cache_dir)
    # A stop in order: everything fetched was committed.
    assert sum(h["committed"] for h in healths.values()) == len(checked.keys), healths


SLOW_START = """\
import os, sys, time
# A sampler process that takes a while to start (a slow disk, a loaded machine, heavy imports):
# it says it is starting, then sleeps before anything of epochcache runs.
marker = os.environ.get("EPOCHCACHE_TEST_SLOW_SPAWN")
if marker and any("spawn_main" in arg for arg in getattr(sys, "orig_argv", ())):
    open(os.path.join(marker, str(os.getpid())), "w").close()
    time.sleep(3)
"""


def test_a_signal_while_a_sampler_starts_stops_the_daemon_in_order(
    tmp_path: Path, start_daemon: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C (SIGINT to the process group) while a sampler process is still starting: it
    died with a KeyboardInterrupt traceback from the middle of its start-up, before its
    handlers existed, and the daemon took that for a crash ("exited with -2; restarting it").
    Samplers start with both signals blocked and handle them once they can: the daemon stops
    in order, and no traceback is printed."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SLOW_START)
    starting = tmp_path / "starting"
    starting.mkdir()
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv("EPOCHCACHE_TEST_SLOW_SPAWN", str(starting))
    upload(lambda prefix: (tmp_path / prefix).as_uri(), {}, "ds", 50, "files")
    config = write_config(tmp_path / "cfg.yaml", url=(tmp_path / "ds").as_uri(),
                          cache_dir=tmp_path / "cache", storage_options={})
    daemon = start_daemon(config)
    deadline = time.monotonic() + 90
    while not any(starting.iterdir()):  # a sampler process is in its start-up
        assert time.monotonic() < deadline, daemon.logs()[-3000:]
        assert daemon.popen.poll() is None, daemon.logs()[-3000:]
        time.sleep(0.05)
    os.killpg(daemon.pid, signal.SIGINT)
    assert daemon.wait(60) == 0, daemon.logs()[-3000:]
    logs = daemon.logs()
    assert "Traceback" not in logs and "KeyboardInterrupt" not in logs, logs[-3000:]
    assert "restarting" not in logs, logs[-3000:]
