"""Weights count samples, not shards (issue 22, item 4).

A ``tar`` source lists shards and a ``files`` source objects: the mixer used to count refs, so
a tar source at weight 3 against a files source at weight 1 gave 99% of the samples from the
tar source (each of its refs a shard of many samples) instead of 75%. One sampler in this
process over two ``file://`` sources and a real cache; the mix is read from the order in
which samples were committed (sequence numbers).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from common.cachecheck import scan
from common.daemonproc import wait_for

from epochcache import Cache
from epochcache.config import EpochcacheConfig
from epochcache.demo import write_demo_data
from epochcache.ingest.sampler import Sampler

pytestmark = pytest.mark.timeout(120)


def test_a_tar_and_a_files_source_mix_by_samples(tmp_path: Path) -> None:
    web, books = (tmp_path / "web").as_uri(), (tmp_path / "books").as_uri()
    # 20 samples a shard: a batch of 4 shards is 80 samples, one of files 32
    write_demo_data(web, 3000, "tar", sample_bytes=256, samples_per_shard=20, seed=1)
    write_demo_data(books, 1500, "files", sample_bytes=256, seed=2)
    config = EpochcacheConfig.model_validate({
        "sources": [
            {"name": "web", "url": web, "layout": "tar", "pattern": "*.tar", "weight": 3},
            {"name": "books", "url": books, "pattern": "*.npy", "weight": 1},
        ],
        "cache": {"dir": str(tmp_path / "cache"), "capacity": "256MiB", "sync": False},
        "sampler": {"processes": 1, "concurrency": 8, "batch_size": 32},
    })
    Cache(config.cache.dir, "256MiB").close()
    stop = threading.Event()
    sampler = Sampler(config, 0, stop)
    runner = threading.Thread(target=sampler.run)
    runner.start()
    try:
        wait_for(lambda: len(sampler.cache) >= 2400, 90, "2,400 samples cached")
    finally:
        stop.set()
        runner.join(60)
        sampler.close()
    with Cache(config.cache.dir, readonly=True) as cache:
        state = scan(cache)
    first = [key for _, key in sorted(zip(state.seqs, state.keys))][:2400]
    for count in (800, 1600, 2400):  # over a few thousand samples, and on the way there
        share = sum(key.startswith("web/") for key in first[:count]) / count
        assert 0.70 <= share <= 0.80, (count, share)
