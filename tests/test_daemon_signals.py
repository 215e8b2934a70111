"""The daemon's SIGTERM/SIGINT handler is safe wherever the main thread is (issue 10, item 10).

A Python signal handler runs in the main thread between two bytecodes. If the handler took a
lock that the interrupted code holds (``Event.set()`` inside ``Event.wait()``), the main thread
would wait for itself forever. The test makes that moment likely: the main thread waits on the
daemon's stop request in a tight loop, exactly as the supervision loop does with a timeout,
while SIGTERM arrives at random moments, hundreds of times, in a real process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from common.procs import spawn_script

pytestmark = pytest.mark.timeout(120)


def test_stop_signal_at_any_moment_of_the_supervision_wait_is_handled(tmp_path: Path) -> None:
    proc = spawn_script(tmp_path, "signals", """
        import os, random, signal, sys, threading
        from epochcache.config import EpochcacheConfig
        from epochcache.ingest.daemon import Daemon

        config = EpochcacheConfig.model_validate({
            "source": {"url": sys.argv[1]}, "cache": {"dir": sys.argv[2], "capacity": "1MiB"}})
        for trial in range(int(sys.argv[3])):
            daemon = Daemon(config)
            signal.signal(signal.SIGTERM, daemon.stop)  # what run_daemon installs
            timer = threading.Timer(random.uniform(0, 0.003), os.kill, (os.getpid(), signal.SIGTERM))
            timer.start()
            while not daemon._stop.wait(0):  # the wait of Daemon.run's loop (HEARTBEAT_S -> 0)
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
