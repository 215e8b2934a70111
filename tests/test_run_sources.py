"""A run trains on its own sources, never on whatever fills its cache (issue 33, item 4).

Real ``epochcache run`` subprocesses against a real daemon: a run configured for dataset B,
pointed at a cache a daemon fills from dataset A (or filled before), refuses to start, naming
both and how to proceed (before: it attached and trained on A's samples, with one INFO line).
The same source spelled another way (a trailing slash, ``file://``) is the same source; what
does not change the data (credentials, names, weights) does not count.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from common.daemonproc import upload, wait_cached, wait_running, write_config

from epochcache.config import load_config
from epochcache.ingest.layouts import SourceSpec
from epochcache.ingest.lineage import config_sources, source_name
from epochcache.run.startup import check_run_sources

pytestmark = pytest.mark.timeout(240)


def _run(config: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "epochcache", "run", str(config), "-q"],
                          cwd=cwd, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "COLUMNS": "400", "MPLBACKEND": "Agg"})


def _run_config(path: Path, url: str, cache_dir: Path, **train: Any) -> Path:
    path.write_text(yaml.safe_dump({
        "source": {"url": url, "layout": "tar", "pattern": "*.tar"},
        "cache": {"dir": str(cache_dir), "capacity": "8MiB"},
        "sampler": {"processes": 1},
        "loader": {"batch_size": 8},
        "train": {"epochs": 1, "min_samples": 16, "run_dir": str(path.parent / path.stem),
                  "manifests": False, "plot": False, **train},
    }))
    return path


def _daemon_filling(cache_dir: Path, dataset: Path, tmp_path: Path, start_daemon: Any) -> Any:
    """A daemon filling ``cache_dir`` from ``dataset``, once it has cached some samples."""
    daemon = start_daemon(write_config(tmp_path / "daemon-a.yaml", url=str(dataset),
                                       cache_dir=cache_dir, storage_options={},
                                       capacity="8MiB", layout="tar",
                                       sampler={"processes": 1}))
    wait_running(daemon, cache_dir)
    wait_cached(daemon, cache_dir, 20)
    return daemon


def test_a_run_refuses_a_cache_of_another_source(tmp_path: Path, start_daemon: Any,
                                               caplog: pytest.LogCaptureFixture) -> None:
    a, b = tmp_path / "dataset-a", tmp_path / "dataset-b"
    upload(lambda _p: str(a), {}, "", 60, "tar", samples_per_shard=20)  # the demo trainer's
    upload(lambda _p: str(b), {}, "", 60, "tar", samples_per_shard=20)
    cache_dir = tmp_path / "cache"
    daemon = _daemon_filling(cache_dir, a, tmp_path, start_daemon)

    # A's daemon fills the cache: a run for B refuses to start, naming both.
    refused = _run(_run_config(tmp_path / "run-b.yaml", str(b), cache_dir), tmp_path)
    assert refused.returncode == 2, refused.stderr[-3000:]
    line = refused.stderr.strip().splitlines()[-1]
    assert str(a) in line and str(b) in line and f"pid {daemon.pid}" in line, line
    assert "train.allow_other_sources: true" in line and "cache.dir of its own" in line, line
    # ... unless the config says that is what it wants (the check, in this process)
    allowing_b = _config(tmp_path, cache_dir, train={"allow_other_sources": True},
                         source={"url": str(b), "layout": "tar", "pattern": "*.tar"})
    caplog.set_level(logging.WARNING, logger="epochcache")
    check_run_sources(allowing_b)
    assert "training on what it fills" in caplog.text

    # The daemon gone, the cache still holds A's samples: B's run refuses them too.
    assert daemon.terminate() == 0
    refused = _run(tmp_path / "run-b.yaml", tmp_path)
    assert refused.returncode == 2, refused.stderr[-3000:]
    line = refused.stderr.strip().splitlines()[-1]
    assert f"samples of {a}" in line and str(b) in line and f"delete {cache_dir}" in line, line
    caplog.clear()
    check_run_sources(allowing_b)
    assert f"samples of {a}" in caplog.text and "training on them too" in caplog.text


@pytest.mark.slow
def test_the_same_source_spelled_another_way_trains(tmp_path: Path, start_daemon: Any) -> None:
    """A spelled another way (``file://``, a trailing slash) is A: the run attaches to A's
    daemon and trains; a run for B that allows other sources trains on A's samples."""
    a = tmp_path / "dataset-a"
    upload(lambda _p: str(a), {}, "", 60, "tar", samples_per_shard=20)
    cache_dir = tmp_path / "cache"
    _daemon_filling(cache_dir, a, tmp_path, start_daemon)
    same = _run(_run_config(tmp_path / "run-a.yaml", a.as_uri() + "/", cache_dir), tmp_path)
    assert same.returncode == 0, same.stderr[-3000:]
    allowed = _run(_run_config(tmp_path / "run-b.yaml", str(tmp_path / "dataset-b"), cache_dir,
                               allow_other_sources=True), tmp_path)
    assert allowed.returncode == 0, allowed.stderr[-3000:]


def _config(tmp_path: Path, cache_dir: Path, **sections: Any) -> Any:
    data = {"cache": {"dir": str(cache_dir), "capacity": "8MiB"}, **sections}
    path = tmp_path / "check.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(str(path))


def test_what_does_not_change_the_data_does_not_count(tmp_path: Path) -> None:
    """Credentials and other storage options, names and weights, a trailing slash, an
    upper-case host: the same source. Layout, pattern, endpoint, bucket: another."""
    base = {"url": "s3://bucket/train", "storage_options": {"endpoint_url": "http://minio:9000"}}

    def name(**changes: Any) -> str:
        spec = SourceSpec(**{**base, **changes})
        return source_name(spec).identity

    same = name()
    assert name(url="s3://bucket/train/") == same
    assert name(url="s3://key:secret@bucket/train") == same
    assert name(storage_options={"endpoint_url": "http://minio:9000/", "key": "k",
                                 "secret": "s", "client_kwargs": {"region_name": "eu"}}) == same
    assert name(layout="tar") != same
    assert name(pattern="*.jpg") != same
    assert name(url="s3://bucket/val") != same
    assert name(storage_options={"endpoint_url": "http://other:9000"}) != same
    local = SourceSpec(url=str(tmp_path / "data"))
    assert source_name(SourceSpec(url=(tmp_path / "data").as_uri() + "/")).identity == \
        source_name(local).identity
    # names and weights of sources: entries label and mix, they do not change the data
    one = _config(tmp_path, tmp_path / "c", sources=[
        {"name": "x", "url": "s3://b/one", "weight": 1}, {"name": "y", "url": "s3://b/two"}])
    two = _config(tmp_path, tmp_path / "c", sources=[
        {"name": "second", "url": "s3://b/two/", "weight": 3},
        {"name": "first", "url": "s3://b/one", "storage_options": {"anon": True}}])
    assert {s.identity for s in config_sources(one)} == {s.identity for s in config_sources(two)}
