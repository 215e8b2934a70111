"""A sampler holds at most ``sampler.max_bytes_in_flight`` between fetch and commit (issue 10,
item 7): counted in bytes from the listed sizes, not only in requests.

A real sampler (fetch loop, committer thread, cache) over a ``memory://`` dataset of 1 MiB
objects, in this process so that the bytes it holds can be followed: from the moment a fetch
returns them until their batch is finished with.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import fsspec
import pytest

from epochcache.config import EpochcacheConfig
from epochcache.ingest.sampler import Sampler

pytestmark = pytest.mark.timeout(120)

MiB = 1024**2


def _peak_held(tmp_path: Path, name: str, limit: str | None) -> int:
    fs = fsspec.filesystem("memory")
    for i in range(24):
        fs.pipe_file(f"/{name}/obj-{i:03d}.bin", bytes([i]) * MiB)
    sampler_cfg: dict[str, Any] = {"processes": 1, "concurrency": 8, "batch_size": 64}
    if limit is not None:
        sampler_cfg["max_bytes_in_flight"] = limit
    config = EpochcacheConfig.model_validate({
        "source": {"url": f"memory://{name}", "pattern": "*.bin", "checks": []},
        "cache": {"dir": str(tmp_path / name), "capacity": "256MiB", "compression": "none",
                  "sync": False},
        "sampler": sampler_cfg,
    })
    from epochcache import Cache

    Cache(config.cache.dir, "256MiB").close()
    stop = threading.Event()
    sampler = Sampler(config, 0, stop)
    held, peak, lock = 0, 0, threading.Lock()
    fetch, done = sampler.source.fetch_with_retries, sampler._done

    def counting_fetch(refs: Any, **kwargs: Any) -> Any:
        nonlocal held, peak
        results = fetch(refs, **kwargs)
        with lock:
            held += sum(len(payload) for _, payload in results if isinstance(payload, bytes))
            peak = max(peak, held)
        return results

    def counting_done(batch: Any) -> None:
        nonlocal held
        with lock:
            held -= len(batch.keys) * MiB
        done(batch)

    sampler.source.fetch_with_retries = counting_fetch  # type: ignore[method-assign]
    sampler._done = counting_done  # type: ignore[method-assign]
    sampler.committer.done = counting_done
    runner = threading.Thread(target=sampler.run)
    runner.start()
    try:
        deadline = threading.Event()
        while len(sampler.cache) < 24 and runner.is_alive():
            deadline.wait(0.02)
    finally:
        stop.set()
        runner.join(60)
        sampler.close()
    assert not runner.is_alive()
    return peak


def test_bytes_in_flight_stay_within_the_limit(tmp_path: Path) -> None:
    bounded = _peak_held(tmp_path, "bounded", "3MiB")
    unbounded = _peak_held(tmp_path, "default", None)  # 512 MiB: requests are the only bound
    assert bounded <= 3 * MiB, bounded / MiB
    assert unbounded > 3 * MiB, unbounded / MiB  # the measure can see more than the limit
