"""S3 configured the way users configure it: the endpoint, credentials and region in the
environment or ``~/.aws`` (never only in ``storage_options``), read by a daemon's samplers.

Every test points ``AWS_CONFIG_FILE`` and ``AWS_SHARED_CREDENTIALS_FILE`` into its own tmp dir
(the ``s3`` fixture's environment has no real ``~/.aws``); the bucket is moto's server on
127.0.0.1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from common.daemonproc import sampler_states, upload, wait_cached, wait_running, write_config
from conftest import S3Env

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("client", ["auto", pytest.param("obstore", marks=pytest.mark.slow)])
def test_a_daemon_fills_from_the_endpoint_in_aws_endpoint_url(
        s3: S3Env, tmp_path: Path, start_daemon: Any, monkeypatch: pytest.MonkeyPatch,
        client: str) -> None:
    """``AWS_ENDPOINT_URL=http://...`` (MinIO, Ceph RGW: what botocore reads) and nothing in
    storage_options: every sample is cached, by either client. Before: obstore refused the
    http scheme on every read while s3fs listed; 0 of 100 cached, retried forever."""
    n = 100
    upload(s3.url, s3.storage_options, "env", n, "files")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint_url)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    cache_dir = tmp_path / "cache"
    config = write_config(tmp_path / "cfg.yaml", url=s3.url("env"), cache_dir=cache_dir,
                          storage_options={}, source={"client": client})
    daemon = start_daemon(config)
    wait_running(daemon, cache_dir)
    wait_cached(daemon, cache_dir, n, timeout_s=60)
    assert daemon.terminate() == 0, daemon.logs()
    healths = sampler_states(cache_dir)
    assert sum(h["errors"] for h in healths.values()) == 0, healths


def test_obstore_asked_for_with_a_setting_it_cannot_honour_fails_at_start(
        tmp_path: Path, unreachable_endpoint: str) -> None:
    """``client: obstore`` with a setting obstore cannot honour: exit 2 before anything starts,
    one message naming the setting and what to do (nothing is asked of the remote)."""
    import subprocess
    import sys

    config = write_config(
        tmp_path / "cfg.yaml", url="s3://bucket/ds", cache_dir=tmp_path / "cache",
        storage_options={"endpoint_url": unreachable_endpoint, "key": "k", "secret": "s",
                         "config_kwargs": {"proxies": {"https": "http://proxy:3128"}}},
        source={"client": "obstore"})
    done = subprocess.run([sys.executable, "-m", "epochcache", "daemon", str(config)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "obstore cannot honour storage_options.config_kwargs.proxies" in done.stderr
    assert "client: s3fs or auto" in done.stderr
