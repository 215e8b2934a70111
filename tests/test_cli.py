"""The command line as a user meets it (issue 10, item 9): it starts without the ``plot`` extra,
logs go to stderr at the level asked for, stdout carries only what a command prints, and a run
with a bad source fails before the seconds torch takes to import.

Internals: ``plumbing.append_history`` writes the daemon's stats rows that ``plot`` draws.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from common.cachecheck import content_for

from epochcache import Cache
from epochcache.store.plumbing import append_history

REPO = Path(__file__).resolve().parents[1]


def _env(*prepend: Path) -> dict[str, str]:
    paths = [str(p) for p in prepend] + [str(REPO), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths)), "COLUMNS": "300"}


def _cli(*args: str, cwd: Path, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "epochcache", *args], cwd=cwd,
                          env=env or _env(), capture_output=True, text=True, timeout=120)


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    path = tmp_path / "cache"
    with Cache(path, "1MiB", sync=False) as cache:
        cache.put_many([(f"k{i}", content_for(f"k{i}", 1000)) for i in range(20)])
        append_history(cache)
    return path


def test_the_cli_starts_without_matplotlib_and_plot_exits_2_with_the_hint(
    tmp_path: Path, cache_dir: Path
) -> None:
    """matplotlib is shadowed by a package that cannot be imported (as when it is missing or
    broken): every command but plot works, and plot says how to install it."""
    blocker = tmp_path / "blocked" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(
        "raise ImportError(\"No module named 'matplotlib' (blocked by the test)\")\n")
    env = _env(tmp_path / "blocked")
    assert _cli("--help", cwd=tmp_path, env=env).returncode == 0
    status = _cli("status", str(cache_dir), cwd=tmp_path, env=env)
    assert status.returncode == 0 and "samples" in status.stdout, status.stderr
    shown = _cli("status", "--json", str(cache_dir), cwd=tmp_path, env=env)
    assert shown.returncode == 0 and json.loads(shown.stdout)["samples"] == 20
    plot = _cli("plot", str(cache_dir), "-o", str(tmp_path / "fill.png"), cwd=tmp_path, env=env)
    assert plot.returncode == 2, plot.stdout + plot.stderr
    assert "pip install 'epochcache[plot]'" in plot.stderr and "Traceback" not in plot.stderr
    assert not (tmp_path / "fill.png").exists()
    # not installed at all: the same
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from epochcache.cli import main\n"
            f"sys.exit(main(['plot', {str(cache_dir)!r}, '-o', {str(tmp_path / 'x.png')!r}]))\n")
    missing = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True,
                             text=True, timeout=120)
    assert missing.returncode == 2 and "epochcache[plot]" in missing.stderr, missing.stderr


@pytest.mark.parametrize("where", ["before", "after"])
def test_logs_go_to_stderr_and_status_json_parses_with_v(
    tmp_path: Path, cache_dir: Path, where: str
) -> None:
    args = ["-v", "status", "--json", str(cache_dir)]
    if where == "after":
        args = ["status", "--json", str(cache_dir), "-v"]
    done = _cli(*args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["samples"] == 20  # not one log line on stdout
    assert "DEBUG" in done.stderr and "epochcache 0." in done.stderr  # -v logs, on stderr
    quiet = _cli("status", "--json", str(cache_dir), cwd=tmp_path)
    assert "DEBUG" not in quiet.stderr and json.loads(quiet.stdout)["samples"] == 20


def test_verify_json_stays_parseable_while_it_logs(tmp_path: Path, cache_dir: Path) -> None:
    import lmdb

    env = lmdb.open(str(cache_dir), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.put(b"bytes", (1).to_bytes(8, "big"), db=env.open_db(b"meta", txn=txn))
    env.close()
    done = _cli("-v", "verify", "--repair", "--json", str(cache_dir), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["repairs"]["counters_rewritten"] == 1
    assert "repaired" in done.stderr


@pytest.mark.parametrize(("flags", "level"), [((), logging.INFO), (("-v",), logging.DEBUG),
                                              (("-q",), logging.WARNING)])
def test_v_is_debug_and_q_is_warning(tmp_path: Path, flags: tuple[str, ...], level: int) -> None:
    code = ("import logging, sys\n"
            "from epochcache.cli import main\n"
            f"main([*{list(flags)!r}, 'status', {str(tmp_path / 'none')!r}])\n"
            "print(logging.getLogger('epochcache').getEffectiveLevel())\n"
            "logging.getLogger('epochcache.x').info('an info line')\n")
    done = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.strip()) == level
    assert ("an info line" in done.stderr) == (level <= logging.INFO)


def test_run_with_a_bad_source_fails_before_importing_torch(
    tmp_path: Path, unreachable_endpoint: str
) -> None:
    config = {
        "source": {"url": "s3://no-such-bucket/train", "list_deadline_s": 3,
                   "storage_options": {"endpoint_url": unreachable_endpoint, "key": "k",
                                       "secret": "s"}},
        "cache": {"dir": "cache", "capacity": "8MiB"},
        "train": {"run_dir": "run"},  # the default trainer imports torch
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    code = ("import sys, time\n"
            "from epochcache.cli import main\n"
            "start = time.monotonic()\n"
            "status = main(['run', 'cfg.yaml'])\n"
            "print('TORCH', 'torch' in sys.modules, 'SECONDS', time.monotonic() - start)\n"
            "sys.exit(status)\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - started
    assert done.returncode == 2, done.stdout + done.stderr
    assert "s3://no-such-bucket/train" in done.stderr and "Traceback" not in done.stderr
    assert "TORCH False" in done.stdout, done.stdout
    assert elapsed < 90, elapsed  # not a hang (about 2-3 s idle; torch adds 1-5 s; load more)
    assert not (tmp_path / "run").exists()


def test_q_quiets_the_samplers_and_a_stop_on_sigterm_is_logged(
        tmp_path: Path, s3: Any, start_daemon: Any) -> None:
    """``-q`` did not reach the sampler processes (``sampler 0: ... starting at
    Position(...)``, and botocore's "Found credentials in environment variables." at every
    level), and a daemon stopped by SIGTERM said nothing (issue 37, item 4). The credentials
    come from the environment, as botocore then says so."""
    from common.daemonproc import upload, wait_cached, write_config

    upload(s3.url, s3.storage_options, "train", 20, "files")
    daemons = {}
    for flags in ((), ("-q",)):  # side by side
        cache_dir = tmp_path / f"cache{len(flags)}"
        config = write_config(tmp_path / f"d{len(flags)}.yaml", url=s3.url("train"),
                              cache_dir=cache_dir, sampler={"processes": 1},
                              storage_options={"endpoint_url": s3.endpoint_url})
        daemons[flags] = (start_daemon(config, args=flags), cache_dir)
    for daemon, cache_dir in daemons.values():
        wait_cached(daemon, cache_dir, 20)
    for daemon, _ in daemons.values():
        assert daemon.terminate() == 0
    default, quiet = (daemon.logs() for daemon, _ in daemons.values())
    assert "Found credentials" not in default, default
    assert "20 samples, starting at sample 0 of pass 0" in default, default
    assert "the daemon stopped on SIGTERM; the cache holds 20 samples" in default, default
    assert quiet.strip() == "", quiet
