"""``epochcache.Daemon``: the samplers of ``epochcache daemon`` started from Python.

Real processes throughout: the daemon is a child process with spawned samplers, sources are
``file://`` directories (fast) or moto's S3 server, and a "training script" or "notebook
kernel" is a Python subprocess that is killed with real signals.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from common.daemonproc import REPO, cache_len, pid_running, wait_for

import epochcache as ec

pytestmark = pytest.mark.timeout(120)


def make_source(tmp_path: Path, samples: int = 200, name: str = "remote") -> str:
    from epochcache.demo import write_demo_data

    url = (tmp_path / name).as_uri()
    write_demo_data(url, samples, "files", sample_bytes=1024)
    return url


def config_dict(url: str, cache_dir: Path, **sections: Any) -> dict[str, Any]:
    return {
        "source": {"url": url, "pattern": "*.npy", "timeout_s": 5, "list_deadline_s": 3},
        "cache": {"dir": str(cache_dir), "capacity": "64MiB"},
        "sampler": {"processes": 2, "concurrency": 4, "batch_size": 16},
        **sections,
    }


def test_context_manager_fills_the_cache_and_stops_in_order(tmp_path: Path) -> None:
    url = make_source(tmp_path)
    cache_dir = tmp_path / "cache"
    with ec.Daemon(config_dict(url, cache_dir)) as daemon:
        assert daemon.alive and daemon.pid is not None
        wait_for(lambda: cache_len(cache_dir) == 200, 60, "200 samples cached")
        status = daemon.status()
        assert status["samples"] == 200
        assert status["daemon"]["alive"] and status["daemon"]["pid"] == daemon.pid
        samplers = [s["pid"] for s in status["daemon"]["samplers"].values()]
        assert len(samplers) == 2 and all(pid_running(p) for p in samplers)
    assert not daemon.alive and daemon.exit_status == 0
    assert not any(pid_running(p) for p in samplers)
    with ec.Cache(cache_dir, readonly=True) as cache:
        assert cache.stats()["daemon"]["stopped"] is True


def test_config_as_a_path_or_a_config(tmp_path: Path) -> None:
    import yaml

    url = make_source(tmp_path, samples=20)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config_dict(url, tmp_path / "cache")))
    for config in (str(path), path, ec.load_config(str(path))):
        daemon = ec.Daemon(config).start()
        try:
            wait_for(lambda: cache_len(tmp_path / "cache") == 20, 60, "20 samples cached")
        finally:
            assert daemon.stop() == 0
        assert daemon.stop() == 0  # idempotent


def test_a_second_daemon_on_the_same_cache_is_refused(tmp_path: Path) -> None:
    url = make_source(tmp_path, samples=50)
    config = config_dict(url, tmp_path / "cache")
    with ec.Daemon(config) as first:
        second = ec.Daemon(config)
        with pytest.raises(ec.DaemonAlreadyRunning, match=f"pid {first.pid}"):
            second.start()
        assert not second.alive and first.alive


def test_unreachable_source_and_bad_config_raise_before_anything_runs(
    tmp_path: Path, unreachable_endpoint: str, s3_options_for: Any
) -> None:
    with pytest.raises(ec.ConfigError, match="sampler.processes"):
        ec.Daemon(config_dict("file:///x", tmp_path / "c", sampler={"processes": 0}))
    with pytest.raises(TypeError, match="config: expected a path"):
        ec.Daemon(42)
    config = config_dict("s3://bucket/train/", tmp_path / "cache")
    config["source"]["storage_options"] = s3_options_for(unreachable_endpoint)
    daemon = ec.Daemon(config)
    started = time.monotonic()
    with pytest.raises(ec.SourceUnavailable, match="s3://bucket/train"):
        daemon.start()
    assert time.monotonic() - started < 30
    assert not daemon.alive and daemon.exit_status == 2


def _script(body: str, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def test_a_training_script_without_a_main_guard_runs_once(tmp_path: Path) -> None:
    """Samplers are spawned by the daemon process, so they never re-run the user's script
    (spawn re-imports the main module of the process that starts them)."""
    url = make_source(tmp_path, samples=100)
    config = config_dict(url, tmp_path / "cache")
    marker = tmp_path / "ran.txt"
    script = _script(f"""
        import json, time
        import epochcache as ec
        with open({str(marker)!r}, "a") as f:
            f.write("x")
        with ec.Daemon(json.loads({json.dumps(json.dumps(config))})) as d:
            deadline = time.monotonic() + 60
            while d.status()["samples"] < 100 and time.monotonic() < deadline:
                time.sleep(0.1)
            print("samples", d.status()["samples"])
        print("exit", d.exit_status)
    """, tmp_path, "train.py")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=100, env=_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "samples 100" in result.stdout and "exit 0" in result.stdout
    assert marker.read_text() == "x"  # the script's top level ran exactly once


def test_the_daemon_stops_in_order_when_its_parent_dies(tmp_path: Path) -> None:
    """A notebook kernel killed (kill -9) or restarted: its daemon must not run on forever."""
    url = make_source(tmp_path, samples=100)
    config = config_dict(url, tmp_path / "cache")
    script = _script(f"""
        import json, sys, time
        import epochcache as ec
        d = ec.Daemon(json.loads({json.dumps(json.dumps(config))})).start()
        print(d.pid, flush=True)
        time.sleep(600)
    """, tmp_path, "kernel.py")
    kernel = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env=_env(), cwd=tmp_path)
    try:
        assert kernel.stdout is not None
        daemon_pid = int(kernel.stdout.readline())
        wait_for(lambda: cache_len(tmp_path / "cache") > 0, 60, "samples cached")
        with ec.Cache(tmp_path / "cache", readonly=True) as cache:
            samplers = [s["pid"] for s in cache.stats()["daemon"]["samplers"].values()]
        kernel.send_signal(signal.SIGKILL)
        kernel.wait(10)
        wait_for(lambda: not pid_running(daemon_pid), 30, "the orphaned daemon to stop")
        wait_for(lambda: not any(pid_running(p) for p in samplers), 30, "its samplers to stop")
        with ec.Cache(tmp_path / "cache", readonly=True) as cache:
            assert cache.stats()["daemon"]["stopped"] is True  # it stopped in order
    finally:
        if kernel.poll() is None:
            kernel.kill()
            kernel.wait()


def test_import_epochcache_stays_light() -> None:
    code = ("import sys, epochcache\n"
            "heavy = [m for m in ('torch', 'pydantic', 'fsspec', 'prometheus_client') "
            "if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "assert epochcache.Daemon.__module__ == 'epochcache.daemon'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, env=_env())
    assert result.returncode == 0, result.stderr
