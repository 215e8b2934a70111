"""Source contract on S3 (moto's server on 127.0.0.1, reached through s3fs), plus S3-only failures."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import pytest
import s3fs

from epochcache.errors import SourceUnavailable
from epochcache.ingest.layouts import SourceSpec, open_source

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..conftest import S3Env

from .contract import Backend, SourceContract


class TestS3Source(SourceContract):
    """The contract with either client reading the objects (s3fs lists in both)."""

    @pytest.fixture(params=["s3fs", "obstore"])
    def backend(self, s3: S3Env, request: pytest.FixtureRequest) -> Backend:
        fs = s3fs.S3FileSystem(**s3.storage_options)

        def put(key: str, data: bytes) -> None:
            fs.pipe_file(f"{s3.bucket}/{key}", data)

        return Backend(root=s3.url(), storage_options=s3.storage_options, put=put,
                       client=request.param)


def test_missing_bucket_fails_fast_with_url(s3: S3Env) -> None:
    start = time.monotonic()
    config = SourceSpec(url="s3://no-such-bucket/train", storage_options=s3.storage_options)
    with pytest.raises(SourceUnavailable) as info:
        open_source(config).list_keys()
    assert time.monotonic() - start < 60  # not timeout_s x retries (150 s) of retries
    assert "s3://no-such-bucket/train" in str(info.value)
    assert "testing-secret-value" not in str(info.value)


def test_unreachable_endpoint_fails_fast_with_url(
    unreachable_endpoint: str, s3_options_for: Callable[[str], dict[str, Any]]
) -> None:
    options = s3_options_for(unreachable_endpoint)
    config = SourceSpec(url="s3://bucket/train", storage_options=options, pattern="*.npy")
    start = time.monotonic()
    with pytest.raises(SourceUnavailable) as info:
        open_source(config).list_keys()
    elapsed = time.monotonic() - start
    s3fs.S3FileSystem.clear_instance_cache()
    assert elapsed < 60  # not timeout_s x retries (150 s) of retries; ~8 s on a loaded machine
    message = str(info.value)
    assert "s3://bucket/train" in message and "*.npy" in message
    assert "testing-secret-value" not in message and "testing-key-id" not in message


# -- source.client: who reads the objects --------------------------------------------------------


def test_auto_reads_with_obstore_where_installed_and_s3fs_on_request(s3: S3Env) -> None:
    s3fs.S3FileSystem(**s3.storage_options).pipe_file(f"{s3.bucket}/c/a.bin", b"abc")
    auto = open_source(SourceSpec(url=s3.url("c"), storage_options=s3.storage_options,
                                  checks=()))
    plain = open_source(SourceSpec(url=s3.url("c"), storage_options=s3.storage_options,
                                   checks=(), client="s3fs"))
    assert (auto.client, plain.client) == ("obstore", "s3")
    for source in (auto, plain):
        [(_ref, data)] = source.fetch_many(source.list_keys())
        assert data == b"abc"
        assert source.gate.stats["gets"] == 1 and source.gate.stats["bytes"] == 3


def test_obstore_takes_credentials_from_botocore_when_the_options_have_none(s3: S3Env) -> None:
    """No key/secret in storage_options: s3fs finds them in the environment (botocore's chain);
    obstore must find the same ones (the s3 fixture sets AWS_ACCESS_KEY_ID and friends)."""
    s3fs.S3FileSystem(**s3.storage_options).pipe_file(f"{s3.bucket}/env/a.bin", b"xyz")
    options = {"endpoint_url": s3.endpoint_url}
    source = open_source(SourceSpec(url=s3.url("env"), storage_options=options, checks=(),
                                    client="obstore"))
    [(_ref, data)] = source.fetch_many(source.list_keys())
    assert data == b"xyz"


def test_an_s3fs_only_option_keeps_s3fs_or_fails_naming_it(s3: S3Env) -> None:
    from epochcache.errors import ConfigError

    options = {**s3.storage_options, "config_kwargs": {"proxies": {"https": "http://proxy:3128"}}}
    spec = SourceSpec(url=s3.url("p"), storage_options=options)
    from epochcache.ingest.s3 import resolve_client

    assert resolve_client("auto", spec.url, options, field="source.client") is None
    with pytest.raises(ConfigError, match=r"source\.client.*storage_options\.config_kwargs\."
                                          r"proxies.*s3fs"):
        resolve_client("obstore", spec.url, options, field="source.client")
    with pytest.raises(ConfigError, match="obstore reads s3:// sources"):
        resolve_client("obstore", "gs://bucket/x", {}, field="source.client")


def test_obstore_asked_for_but_missing_is_a_config_error(monkeypatch: pytest.MonkeyPatch,
                                                         s3: S3Env) -> None:
    from epochcache.errors import ConfigError
    from epochcache.ingest import s3 as clients

    monkeypatch.setattr(clients, "obstore_installed", lambda: False)
    with pytest.raises(ConfigError, match=r"obstore is not installed: pip install"):
        clients.resolve_client("obstore", s3.url("x"), s3.storage_options,
                               field="source.client")
    assert clients.resolve_client("auto", s3.url("x"), s3.storage_options,
                                  field="source.client") is None


@pytest.mark.parametrize("client", ["s3fs", "obstore"])
def test_a_throttled_get_is_recognised_and_asked_again_by_either_client(
        s3: S3Env, remote_proxy: Any, client: str) -> None:
    """503 SlowDown reaches s3fs as an OSError(EBUSY) from botocore's ClientError, obstore as a
    GenericError naming the status: both are Throttled, and the same key is asked again."""
    fs = s3fs.S3FileSystem(**s3.storage_options)
    fs.pipe({f"{s3.bucket}/t/{i:02d}.bin": bytes([i]) * 100 for i in range(12)})
    proxy = remote_proxy(s3.endpoint_url, latency_s=0.0, rate_per_s=20, burst=2)
    options = {**s3.storage_options, "endpoint_url": proxy.endpoint}
    source = open_source(SourceSpec(url=s3.url("t"), storage_options=options, checks=(),
                                    client=client), concurrency=8)
    refs = source.list_keys()
    results = source.fetch_with_retries(refs)
    assert [data for _, data in results] == [bytes([i]) * 100 for i in range(12)]
    assert proxy.stats.throttled > 0
    counted = source.gate.stats.as_dict()
    assert counted["throttled"] == proxy.stats.throttled and counted["errors"] == 0
    assert counted["gets"] == 12 + proxy.stats.throttled


def test_obstore_signs_for_the_region_the_bucket_is_in(s3: S3Env,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """No region in the options nor the environment: s3fs follows a bucket into its region by
    itself, obstore signs for one; the sampler asks the bucket where it lives."""
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    fs = s3fs.S3FileSystem(**{**s3.storage_options,
                              "client_kwargs": {"region_name": "eu-central-1"}})
    fs.mkdir("frankfurt-bucket", region_name="eu-central-1")
    fs.pipe_file("frankfurt-bucket/x/a.bin", b"guten tag")
    options = {k: v for k, v in s3.storage_options.items() if k != "client_kwargs"}
    source = open_source(SourceSpec(url="s3://frankfurt-bucket/x", storage_options=options,
                                    checks=(), client="obstore"))
    [(_ref, data)] = source.fetch_many(source.list_keys())
    assert data == b"guten tag"
    store = source.fetch_fs._construct_store("frankfurt-bucket")
    assert store.config["region"] == "eu-central-1"
