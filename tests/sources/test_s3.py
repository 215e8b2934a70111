"""Source contract on S3 (moto's server on 127.0.0.1, reached through s3fs), plus S3-only failures."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import pytest
import s3fs

from epochcache.ingest.sources import SourceSpec
from epochcache.errors import SourceUnavailable
from epochcache.ingest.sources import open_source

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..conftest import S3Env

from .contract import Backend, SourceContract


class TestS3Source(SourceContract):
    @pytest.fixture
    def backend(self, s3: S3Env) -> Backend:
        fs = s3fs.S3FileSystem(**s3.storage_options)

        def put(key: str, data: bytes) -> None:
            fs.pipe_file(f"{s3.bucket}/{key}", data)

        return Backend(root=s3.url(), storage_options=s3.storage_options, put=put)


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
