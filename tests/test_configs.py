"""Every reference config in configs/ loads, and configs/s3.yaml really trains against S3 (moto)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import S3Env

import epochcache
from epochcache.config import load_config, parse_config
from epochcache.demo import write_demo_data

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
ENV = {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": "example-secret-value"}


def test_the_reference_configs_are_there() -> None:
    assert {path.name for path in CONFIGS} >= {"demo.yaml", "s3.yaml", "ddp.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.name)
def test_every_config_loads(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    config = epochcache.load_config(str(path))  # the public API, reading the process environment
    assert config.cache.capacity > 0
    assert config.train.entrypoint
    shown = config.redacted_yaml()
    assert ENV["AWS_SECRET_ACCESS_KEY"] not in shown and ENV["AWS_ACCESS_KEY_ID"] not in shown


def test_s3_config_reads_the_endpoint_from_the_environment() -> None:
    environ = {**ENV, "EPOCHCACHE_S3_ENDPOINT": "http://127.0.0.1:9000", "EPOCHCACHE_S3_URL": "s3://b/x"}
    config = load_config(REPO / "configs" / "s3.yaml", environ=environ)
    options = config.source.storage_options
    assert options["endpoint_url"] == "http://127.0.0.1:9000"
    assert config.source.url == "s3://b/x"


@pytest.mark.parametrize("name", ["s3.yaml", "ddp.yaml"])
def test_s3_configs_load_on_a_node_with_an_instance_role(name: str) -> None:
    """A node whose credentials come from its instance role (or ~/.aws) has no AWS_* variables:
    the shipped S3 configs required ``${AWS_ACCESS_KEY_ID}`` and exited 2 there. They name no
    credentials now; s3fs and obstore find them the way botocore does."""
    config = load_config(REPO / "configs" / name, environ={})
    options = config.source.storage_options
    assert "key" not in options and "secret" not in options, options


def test_an_empty_credential_is_left_to_the_credential_chain() -> None:
    """``key: ${MY_KEY:-}`` with the variable unset gave s3fs an empty key (signed requests
    that fail with 403): an empty credential is left out, so the usual chain applies."""
    data = {"source": {"url": "s3://b/x", "storage_options": {
                "key": "${MY_KEY:-}", "secret": "${MY_SECRET:-}", "token": "",
                "endpoint_url": "${MY_ENDPOINT:-http://127.0.0.1:9000}", "anon": False}},
            "cache": {"dir": "/tmp/x", "capacity": "1MiB"}}
    options = parse_config(data, environ={}).source.storage_options
    assert options == {"endpoint_url": "http://127.0.0.1:9000", "anon": False}
    given = parse_config(data, environ={"MY_KEY": "k", "MY_SECRET": "s"}).source.storage_options
    assert given["key"] == "k" and given["secret"] == "s"


def test_ddp_config_takes_node_identity_from_torchrun() -> None:
    node1 = {**ENV, "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
             "EPOCHCACHE_CACHE_DIR": "/scratch"}
    config = load_config(REPO / "configs" / "ddp.yaml", environ=node1)
    assert config.sampler.node(node1) == (1, 2)
    # One cache per node, on its local disk: the path does not follow GROUP_RANK, which the c10d
    # rendezvous may hand another node at the next launch (the cache would start cold beside
    # the old one, twice the disk).
    assert str(config.cache.dir) == "/scratch"
    node0 = {**node1, "GROUP_RANK": "0"}
    assert str(load_config(REPO / "configs" / "ddp.yaml", environ=node0).cache.dir) == "/scratch"
    # torchrun's WORLD_SIZE/LOCAL_WORLD_SIZE alone also give the node count
    env = {**ENV, "GROUP_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    assert load_config(REPO / "configs" / "ddp.yaml", environ=env).sampler.node(env) == (1, 2)


@pytest.mark.slow  # the default suite runs configs/s3.yaml against moto in docs/howto/runs.md
def test_s3_config_runs_one_epoch_against_moto(s3: S3Env, tmp_path: Path) -> None:
    write_demo_data(s3.url("train"), 2000, "tar", s3.storage_options)
    env = dict(os.environ)
    env.update(
        AWS_ACCESS_KEY_ID=s3.storage_options["key"],
        AWS_SECRET_ACCESS_KEY=s3.storage_options["secret"],
        AWS_DEFAULT_REGION="us-west-2",
        EPOCHCACHE_S3_URL=s3.url("train"),
        EPOCHCACHE_S3_ENDPOINT=s3.endpoint_url,
        EPOCHCACHE_CACHE_DIR=str(tmp_path / "cache"),
        EPOCHCACHE_CAPACITY="4MiB",
        EPOCHCACHE_RUN_DIR=str(tmp_path / "run"),
        COLUMNS="1000",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "epochcache", "run", str(REPO / "configs" / "s3.yaml"), "--epochs", "1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in rows] == [0]
    assert rows[0]["samples"] >= 1000 and rows[0]["loss"] > 0  # min_samples: 1000
    assert (tmp_path / "run" / "checkpoint.pt").exists()
    assert s3.storage_options["secret"] not in (tmp_path / "run" / "config.yaml").read_text()
