"""``source.listing_ttl_s``: a growing bucket is re-listed in the background and its new keys are
sampled without restarting anything (issue 10, item 5).

The listing only grows (new keys appended as a block, earlier refs keep their index), so the
key order's saved positions stay valid; the daemon lists, samplers follow the saved file.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import s3fs
from common.cachecheck import full_check
from common.daemonproc import (
    daemon_state,
    sampler_states,
    upload,
    wait_cached,
    wait_running,
    write_config,
)
from conftest import S3Env

from epochcache.ingest.layouts import (
    Listing,
    SampleRef,
    merge_listing,
    read_listing,
    save_listing,
)

pytestmark = pytest.mark.timeout(120)


def _refs(*keys: str, size: int = 10) -> list[SampleRef]:
    return [SampleRef(key, size) for key in keys]


def test_merge_appends_new_keys_as_a_block_and_marks_the_gone(tmp_path: Path) -> None:
    old = Listing(_refs("a", "c", "e"))
    assert old.blocks == [3]
    fresh = [SampleRef("e", 99), *_refs("d", "a", "b")]  # c is gone, e was rewritten
    merged, added = merge_listing(old, fresh)
    assert added == 2
    assert [r.key for r in merged.refs] == ["a", "c", "e", "b", "d"]  # old indices kept
    assert merged.blocks == [3, 5]
    assert merged.gone == {1}
    assert merged.refs[2].size == 99
    again, added = merge_listing(merged, _refs("a", "b", "c", "d", "e"))
    assert added == 0 and again.blocks == [3, 5] and again.gone == set()

    # a manifest read again: weights and checksums of listed keys are the fresh ones
    manifest = Listing([SampleRef("a", 1, 2.0, "crc32:00000001"), SampleRef("b", 1)])
    remerged, added = merge_listing(manifest, [SampleRef("b", 5, 3.0, "crc32:00000002"),
                                               SampleRef("c", 7)])
    assert added == 1 and remerged.gone == {0}
    assert remerged.refs == [SampleRef("a", 1, 2.0, "crc32:00000001"),
                             SampleRef("b", 5, 3.0, "crc32:00000002"), SampleRef("c", 7)]

    save_listing(tmp_path, "fp", merged.refs, blocks=merged.blocks, gone=merged.gone)
    loaded = read_listing(tmp_path, "fp")
    assert loaded is not None
    assert loaded.refs == merged.refs and loaded.blocks == [3, 5] and loaded.gone == {1}
    assert loaded.created > 0


def test_a_growing_bucket_is_relisted_and_its_new_keys_cached(
    s3: S3Env, tmp_path: Path, start_daemon: Any
) -> None:
    first = upload(s3.url, s3.storage_options, "ds", 60, "files")
    cache_dir = tmp_path / "cache"
    config = write_config(
        tmp_path / "cfg.yaml", url=s3.url("ds"), cache_dir=cache_dir,
        storage_options=s3.storage_options, source={"listing_ttl_s": "1s"},
    )
    daemon = start_daemon(config)
    state = wait_running(daemon, cache_dir)
    pids = {name: s["pid"] for name, s in state["samplers"].items()}
    wait_cached(daemon, cache_dir, 60)
    # The bucket grows: 40 more objects (the demo writer's keys continue the numbering).
    fs = s3fs.S3FileSystem(**s3.storage_options)
    more = upload(s3.url, s3.storage_options, "more", 100, "files")[60:]
    for key in more:
        fs.copy(f"{s3.bucket}/more/{key}", f"{s3.bucket}/ds/{key}")
    added_at = time.monotonic()
    wait_cached(daemon, cache_dir, 100, timeout_s=30)
    took = time.monotonic() - added_at
    doc = daemon_state(cache_dir)
    assert doc is not None
    assert {name: s["pid"] for name, s in doc["samplers"].items()} == pids  # nothing restarted
    assert all(s["restarts"] == 0 for s in doc["samplers"].values())
    assert daemon.terminate() == 0
    assert sorted(full_check(str(cache_dir)).keys) == sorted(first + more)
    healths = sampler_states(cache_dir)
    assert sum(h["fetched"] for h in healths.values()) == 100  # nothing fetched twice
    logs = daemon.logs()
    new_keys = [int(line.split(" new keys")[0].rsplit(" ", 1)[1])
                for line in logs.splitlines() if " new keys, " in line]
    assert sum(new_keys) == 40, logs[-3000:]  # one re-list or more, as the copy went on
    assert "the listing grew to 100 keys" in logs
    assert took < 20


def test_a_relist_takes_memory_in_proportion_to_the_keys_not_to_the_longest(
    tmp_path: Path,
) -> None:
    """A re-list built fixed-width arrays of every key times the longest key, twice: 300,000
    keys took 54 MiB, 1,158 MiB once one legal 1 KiB key was listed (~38 GiB at ten million),
    in the training process when ``epochcache run`` started the daemon. Here the re-list of a
    source that grew by 1,000 keys and one 1 KiB key is measured in a process of its own."""
    from common.peakmem import run_measured

    done = run_measured(f"""
        import numpy as np
        from epochcache.ingest.keytable import KeyTableBuilder
        from epochcache.ingest.layouts import (
            Listing, SourceSpec, read_listing, relist, save_listing, source_fingerprint)
        from epochcache.ingest.layouts.files import FilesSource

        def table(indices, long_key=False):
            builder = KeyTableBuilder()
            for i in indices:
                builder.add(f"train/part-{{i % 997:04d}}/sample-{{i:08d}}.npy", 1000 + i % 50)
            if long_key:
                builder.add("train/long/" + "k" * 1013 + ".npy", 7)  # 1,024 bytes: legal in S3
            return builder.build()

        class GrownSource(FilesSource):
            def list_table(self):  # what a listing does with its pages: sort them
                return fresh.sorted()

        cache_dir = {str(tmp_path / "cache")!r}
        source = GrownSource(SourceSpec(url={tmp_path.as_uri()!r}))
        save_listing(cache_dir, source_fingerprint(source.spec),
                     Listing(table(range(299_000)).sorted()))
        fresh = table(np.random.default_rng(0).permutation(300_000), long_key=True)
        key_bytes = len(fresh.blob)
        mark()
        listing, added = relist(source, cache_dir)
        report()
        print("ADDED", added, len(listing), len(read_listing(cache_dir, source_fingerprint(
            source.spec)).table), "KEY_MIB", key_bytes / 2**20)
    """, limit_mib=600)
    assert not done.over_limit, "the re-list took more than 600 MiB"
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ADDED 1001 300001 300001" in done.stdout
    key_mib = float(done.stdout.split("KEY_MIB ")[1])  # ~10 MiB, and 8-16 bytes a key of numbers
    # ~55 MiB measured: the old and fresh listings, their sort and join, 8-byte indices
    assert done.growth_mib < 12 * key_mib, done.stdout
