"""`epochcache run` never waits forever for ``train.min_samples`` (issue 11, item 6).

The wait ends as soon as the number is known to be out of reach: the whole source is cached and
smaller (training starts on it, with a warning), every fetch fails for a while, or the daemon
filling the cache is gone (in this process or another). Each run is real: the CLI in a
subprocess, or a :class:`Run` in this process with its daemon thread and sampler processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
from common.daemonproc import DaemonProc, wait_for
from common.procs import kill_job
from test_run import cli_env, demo_config, write_yaml


def _run(cwd: Path, config: Path, timeout_s: float, env: dict[str, str] | None = None
         ) -> tuple[int, str]:
    """``(exit status, output)`` of ``epochcache run CONFIG``; a hang fails the test (and the
    run's whole session is killed)."""
    proc = subprocess.Popen([sys.executable, "-m", "epochcache", "run", str(config)], cwd=cwd,
                            env=cli_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_job(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"the run still waited after {timeout_s:.0f} s:\n{out[-3000:]}") from None
    return proc.returncode, out


def test_a_source_smaller_than_min_samples_trains_on_what_there_is(tmp_path: Path) -> None:
    config = demo_config(tmp_path, source={"demo_samples": 150},
                         cache={"capacity": "16MiB"},  # the whole source fits
                         train={"epochs": 1, "min_samples": 1000})
    status, out = _run(tmp_path, write_yaml(tmp_path / "cfg.yaml", config), timeout_s=90)
    assert status == 0, out[-3000:]
    assert "the whole source (this node's share of it) is cached: 150 samples, fewer than " \
           "train.min_samples=1000" in out, out[-3000:]
    assert "epoch 0:" in out
    # The run watches the daemon it started: it does not ask the user whether one runs.
    assert "waiting until 1000 samples are cached" in out and "daemon running?" not in out, out


def test_a_loader_waiting_on_its_own_asks_whether_a_daemon_runs(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from epochcache.data.schedule import wait_for_samples
    from epochcache.store import SampleStore

    cache = SampleStore(str(tmp_path / "cache"), capacity=1 << 20)
    try:
        with caplog.at_level("INFO", logger="epochcache"), pytest.raises(TimeoutError):
            wait_for_samples(cache, 10, timeout_s=0.3, poll_s=0.1)
    finally:
        cache.close()
    assert "waiting until 10 samples are cached (0 now); is the daemon running?" in caplog.text


def test_a_plain_script_waiting_with_no_daemon_is_told_so_within_seconds(tmp_path: Path) -> None:
    """``cache.epochs(min_samples=10)`` on an empty cache with no daemon printed nothing for
    400 s in a plain script: the hint was logged at INFO, which a script never shows (issue
    37). A WARNING reaches stderr with no logging configured, within seconds."""
    script = ("import epochcache as ec\n"
              f"cache = ec.Cache({str(tmp_path / 'cache')!r}, capacity='1MiB')\n"
              "for epoch, loader in cache.epochs(num_epochs=1, min_samples=10):\n"
              "    pass\n")
    err = tmp_path / "stderr.txt"
    with open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, stderr=stderr,
                                stdout=subprocess.DEVNULL, env=cli_env(), start_new_session=True)
    try:
        wait_for(lambda: "no daemon is filling this cache" in err.read_text(), 60,
                 "the warning on stderr")
    finally:
        kill_job(proc)
    text = err.read_text()
    assert "waiting for min_samples=10 (0 cached, none new for " in text, text
    assert "start one (`epochcache daemon CONFIG`, or `with epochcache.Daemon(config):`" in text


def test_a_wait_without_progress_warns_again_at_an_interval_not_at_every_poll(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from epochcache.data import schedule
    from epochcache.store import SampleStore

    monkeypatch.setattr(schedule, "NO_DAEMON_WARN_S", 0.1)
    monkeypatch.setattr(schedule, "WARN_EVERY_S", 0.3)
    # The wait's clock advances by its sleeps only: a loaded machine (a full run at -n 3 on two
    # cores) stretched the real one's polls and the count of warnings with them.
    clock = [0.0]
    fake_time = types.SimpleNamespace(monotonic=lambda: clock[0], time=time.time,
                                      sleep=lambda s: clock.__setitem__(0, clock[0] + s))
    monkeypatch.setattr(schedule, "time", fake_time)
    cache = SampleStore(str(tmp_path / "cache"), capacity=1 << 20)
    try:
        with caplog.at_level("WARNING", logger="epochcache"), pytest.raises(TimeoutError):
            schedule.wait_for_samples(cache, 10, timeout_s=1.0, poll_s=0.05)
    finally:
        cache.close()
    warned = [r for r in caplog.records if "no daemon is filling this cache" in r.getMessage()]
    # 20 polls: the first warning once none grew for 0.1 s, then one per 0.3 s, not one a poll
    assert len(warned) in (3, 4), [r.getMessage() for r in warned]


def test_every_fetch_failing_ends_the_wait_naming_the_error(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    # A manifest of objects that are not there: every fetch fails (as with a 403 on S3).
    (data / "keys.csv").write_text("key\n" + "".join(f"gone-{i}.npy\n" for i in range(20)))
    config = demo_config(tmp_path, source={"url": str(data), "layout": "files",
                                           "pattern": "*.npy", "manifest": "data/keys.csv",
                                           "demo_samples": None},
                         train={"epochs": 1, "min_samples": 10})
    status, out = _run(tmp_path, write_yaml(tmp_path / "cfg.yaml", config), timeout_s=60,
                       env={"EPOCHCACHE_MIN_SAMPLES_FAILING_S": "3"})
    assert status == 1, out[-3000:]
    assert "train.min_samples=10 cannot be reached" in out, out[-3000:]
    assert "every fetch has failed" in out and "gone-" in out, out[-3000:]


def test_a_killed_daemon_ends_the_wait_of_a_run_attached_to_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = demo_config(tmp_path, cache={"capacity": "16MiB"},
                         # slow: the 2,000 samples take minutes, the run waits for 1,900
                         sampler={"bandwidth_limit": "20KB"},
                         train={"epochs": 1, "min_samples": 1900})
    cfg = write_yaml(tmp_path / "cfg.yaml", config)
    from epochcache.config import load_config
    from epochcache.run import ensure_demo_data

    monkeypatch.chdir(tmp_path)  # the config's relative paths
    ensure_demo_data(load_config(cfg))
    daemon = DaemonProc(tmp_path, cfg)
    try:
        wait_for(lambda: (tmp_path / "demo-cache" / "daemon.lock").exists(), 30, "the daemon")
        proc = subprocess.Popen([sys.executable, "-m", "epochcache", "run", str(cfg)],
                                cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            time.sleep(3)  # attached, waiting
            assert proc.poll() is None
            daemon.kill9()
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            kill_job(proc)
            out, _ = proc.communicate()
            raise AssertionError(f"the run still waits for a dead daemon:\n{out[-3000:]}") from None
    finally:
        daemon.close()
    assert proc.returncode == 1, out[-3000:]
    assert "attaching to the daemon" in out
    assert "train.min_samples=1900 cannot be reached" in out and "is not running" in out, out


def test_an_in_process_daemon_that_gives_up_ends_the_wait_with_its_cause(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import epochcache.ingest.supervisor as daemon_module
    from epochcache.config import parse_config
    from epochcache.errors import MinSamplesUnreachable
    from epochcache.run import Run, ensure_demo_data

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(daemon_module, "MAX_RESTARTS_IN_A_ROW", 0)  # the first death gives up
    raw: dict[str, Any] = demo_config(tmp_path, cache={"capacity": "16MiB"},
                                      sampler={"bandwidth_limit": "20KB"},
                                      train={"epochs": 1, "min_samples": 1900})
    config = parse_config(raw)
    ensure_demo_data(config)
    run = Run(config)
    run.start_daemon()
    try:
        assert run.daemon is not None
        slot = run.daemon._slots[0]
        wait_for(lambda: slot.process is not None and slot.process.pid, 30, "the sampler")
        os.kill(slot.process.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(MinSamplesUnreachable) as info:
            run.train()
        assert time.monotonic() - started < 30
    finally:
        run.stop_daemon()
    message = str(info.value)
    assert "train.min_samples=1900 cannot be reached" in message
    assert "the daemon filling it stopped: exit status 1 (sampler 0 (pid " in message
    assert "exited with -9 1 times in a row" in message, message
