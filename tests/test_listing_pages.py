"""Listing a large bucket (issue 22, item 1): a timeout and retries per page, not per listing;
the listing saved as it goes and gone on with after a restart; sampling from what is listed
while the rest is listed.

Real S3 (moto's server) behind a real TCP proxy on 127.0.0.1 that delays or holds listing
requests (``common.slowproxy``). Objects are put into moto's backend directly: uploading
2,500 objects over HTTP takes ~12 s here, the listing under test is what goes over the wire.
"""

from __future__ import annotations

import gzip
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
from common.daemonproc import cache_len, daemon_state, wait_for, write_config
from common.slowproxy import SlowListProxy
from conftest import S3Env

from epochcache.ingest.layouts import (
    KeyTable,
    PagedListing,
    SampleRef,
    SourceSpec,
    listing_cached,
    open_source,
    read_listing,
    source_fingerprint,
)

pytestmark = pytest.mark.timeout(180)

COUNT = 2500  # three pages of S3's 1,000
SAMPLED = 1200  # two pages: the daemon's test fetches every key, one GET each


def _fill(s3: S3Env, prefix: str, count: int) -> list[str]:
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    keys = [f"{i:05d}.bin" for i in range(count)]
    for key in keys:
        backend.put_object(s3.bucket, f"{prefix}/{key}", key.encode())
    return keys


@pytest.fixture
def proxy(s3: S3Env) -> Iterator[SlowListProxy]:
    target = urlparse(s3.endpoint_url)
    server = SlowListProxy(target.hostname or "127.0.0.1", int(target.port or 80))
    yield server
    server.close()


def _spec(s3: S3Env, proxy: SlowListProxy, **fields: Any) -> SourceSpec:
    options = {**s3.storage_options, "endpoint_url": proxy.endpoint}
    return SourceSpec(url=s3.url("big"), pattern="*.bin", storage_options=options,
                      list_deadline_s=5.0, retries=3, **fields)


def test_every_page_has_its_own_timeout(s3: S3Env, proxy: SlowListProxy,
                                        caplog: pytest.LogCaptureFixture) -> None:
    keys = _fill(s3, "big", COUNT)
    # Three pages take 4.5 s, longer than the timeout; each one has 2.5 s to spare for a busy
    # machine (0.7 s of 1.5 s was not always enough: a page was retried; 1.5 s of 2.5 s at a
    # load of 9 on two cores was not either: page 1 timed out four times).
    proxy.list_delay_s = 1.5
    source = open_source(_spec(s3, proxy, timeout_s=4.0))
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="epochcache"):
        listed = source.list_keys()
    assert time.monotonic() - started > 4.0  # longer than the timeout, and it succeeded
    assert [ref.key for ref in listed] == keys
    # Each page asked once, and again only where the log says it was retried.
    retries = sum("retrying in" in record.getMessage() for record in caplog.records)
    assert len(proxy.list_lines) == 3 + retries, (proxy.list_lines, caplog.text)
    assert len(set(proxy.list_lines)) == 3
    assert f"listed {COUNT:,} keys matching '*.bin'" in caplog.text


def test_a_listing_is_saved_as_it_goes_and_resumed(s3: S3Env, proxy: SlowListProxy,
                                                   tmp_path: Path) -> None:
    keys = _fill(s3, "big", COUNT)
    source = open_source(_spec(s3, proxy))
    partial = PagedListing(source, tmp_path).run(until_started=True)  # then the daemon dies
    assert not partial.complete and len(partial.table) == 1000
    saved = read_listing(tmp_path, source_fingerprint(source.spec))
    assert saved is not None and not saved.complete and len(saved.table) == 1000
    assert len(proxy.list_lines) == 1

    # A new process: the listing goes on after the last key saved, not from the first page.
    again = open_source(_spec(s3, proxy))
    listing = listing_cached(again, tmp_path)
    assert listing.complete and listing.generation != partial.generation
    assert listing.table.keys() == keys
    assert len(proxy.list_lines) == 3  # pages 2 and 3 only
    assert f"start-after=big/{keys[999]}" in proxy.list_lines[1]


def test_sampling_starts_from_the_keys_listed_while_the_rest_is_listed(
    s3: S3Env, proxy: SlowListProxy, tmp_path: Path, start_daemon: Any
) -> None:
    keys = _fill(s3, "big", SAMPLED)
    proxy.hold(after=1)  # the first page answers, the second waits
    cache_dir = tmp_path / "cache"
    options = {**s3.storage_options, "endpoint_url": proxy.endpoint}
    config = write_config(tmp_path / "cfg.yaml", url=s3.url("big"), cache_dir=cache_dir,
                          storage_options=options, source={"pattern": "*.bin", "checks": []},
                          sampler={"processes": 1, "batch_size": 64})
    daemon = start_daemon(config)
    try:
        # Samples arrive while the second page is still held: from the first 1,000 keys.
        wait_for(lambda: cache_len(cache_dir) >= 100, 60, "samples from the first page")
        assert len(proxy.list_lines) == 2 and not proxy.released.is_set()
        assert "sampling starts from the first 1000 samples listed" in daemon.logs()
        state = daemon_state(cache_dir) or {}
        assert state["listings"] == {s3.url("big"): {"keys": 1000, "complete": False}}
    finally:
        proxy.release()
    # The listing completes; the samplers take the whole listing (a new generation) in.
    wait_for(lambda: cache_len(cache_dir) >= SAMPLED, 90, "every key cached", interval_s=0.2)
    wait_for(lambda: (daemon_state(cache_dir) or {}).get("listings", {}).get(s3.url("big"))
             == {"keys": SAMPLED, "complete": True}, 30, "the listing complete in the state")
    assert daemon.terminate() == 0, daemon.logs()
    listing = read_listing(cache_dir, source_fingerprint(open_source(_spec(s3, proxy)).spec))
    assert listing is not None and listing.complete and listing.table.keys() == keys
    assert f"listed {SAMPLED:,} keys matching" in daemon.logs()


def test_listing_files_are_compact_and_version_1_files_are_still_read(tmp_path: Path) -> None:
    refs = [SampleRef(f"train/shard-{i // 100:04d}/sample-{i:08d}.jpg", 1000 + i)
            for i in range(10_000)]
    table = KeyTable.from_refs(refs)
    # The key's bytes plus 4 (offset) and 8 (size): no object per key.
    assert table.nbytes / len(table) <= 64
    from epochcache.ingest.layouts import Listing, save_listing

    save_listing(tmp_path, "fp", Listing(table, [4000, 10_000], {3}))
    loaded = read_listing(tmp_path, "fp")
    assert loaded is not None and loaded.table == table
    assert loaded.blocks == [4000, 10_000] and loaded.gone == {3} and loaded.complete

    # A listing saved by an earlier version (gzip'd JSON lines) is read, not listed again.
    old = tmp_path / "old"
    (old / "listings").mkdir(parents=True)
    header = {"version": 1, "fingerprint": "fp", "count": 2, "created": time.time(),
              "blocks": [2], "gone": []}
    rows = [json.dumps(header)] + [json.dumps(r.to_row()) for r in refs[:2]]
    (old / "listings" / "fp.jsonl.gz").write_bytes(gzip.compress("\n".join(rows).encode()))
    v1 = read_listing(old, "fp")
    assert v1 is not None and v1.refs == refs[:2] and v1.generation == ""
