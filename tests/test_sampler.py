"""One sampler in this process (fetch loop, committer thread, a real cache) over ``memory://``.

A sampler holds at most ``sampler.max_bytes_in_flight`` between fetch and commit (issue 10,
item 7), counted in bytes from the listed sizes, not only in requests: followed from the moment
a fetch returns the bytes until their batch is finished with. And it stores samples the way the
config's ``cache`` section says.

Internals: the sampler writes records (``cache.writer.encode``) and health documents
(``cache.tables``), which no public call shows.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest

from epochcache import Cache
from epochcache.config import EpochcacheConfig
from epochcache.ingest.sampler import Sampler

pytestmark = pytest.mark.timeout(120)

MiB = 1024**2


def _config(tmp_path: Path, name: str, **sampler: Any) -> EpochcacheConfig:
    config = EpochcacheConfig.model_validate({
        "source": {"url": f"memory://{name}", "pattern": "*.bin", "checks": []},
        "cache": {"dir": str(tmp_path / name), "capacity": "256MiB", "sync": False},
        "sampler": {"processes": 1, "concurrency": 8, "batch_size": 64, **sampler},
    })
    Cache(config.cache.dir, "256MiB").close()  # as the daemon creates it
    return config


def _run_until_cached(sampler: Sampler, stop: threading.Event, count: int) -> None:
    runner = threading.Thread(target=sampler.run)
    runner.start()
    try:
        while len(sampler.cache) < count and runner.is_alive():
            stop.wait(0.02)
    finally:
        stop.set()
        runner.join(60)
        sampler.close()
    assert not runner.is_alive()


def _peak_held(tmp_path: Path, name: str, limit: str | None) -> int:
    fs = fsspec.filesystem("memory")
    for i in range(24):  # incompressible: a batch's records hold as many bytes as its objects
        fs.pipe_file(f"/{name}/obj-{i:03d}.bin", random.Random(i).randbytes(MiB))
    config = _config(tmp_path, name, **({} if limit is None else {"max_bytes_in_flight": limit}))
    stop = threading.Event()
    sampler = Sampler(config, 0, stop)
    held, peak, lock = 0, 0, threading.Lock()
    fetch, done = sampler.feeds[0].source.fetch_with_retries, sampler._done

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

    sampler.feeds[0].source.fetch_with_retries = counting_fetch  # type: ignore[method-assign]
    sampler._done = counting_done  # type: ignore[method-assign]
    sampler.committer.done = counting_done
    _run_until_cached(sampler, stop, 24)
    return peak


def test_bytes_in_flight_stay_within_the_limit(tmp_path: Path) -> None:
    bounded = _peak_held(tmp_path, "bounded", "3MiB")
    unbounded = _peak_held(tmp_path, "default", None)  # 512 MiB: requests are the only bound
    assert bounded <= 3 * MiB, bounded / MiB
    assert unbounded > 3 * MiB, unbounded / MiB  # the measure can see more than the limit


def test_samplers_store_samples_with_the_configured_compression(tmp_path: Path) -> None:
    from epochcache.store.records import Codec

    fs = fsspec.filesystem("memory")
    for i in range(10):
        fs.pipe_file(f"/plain/obj-{i:03d}.bin", b"compressible text " * 1000)
    config = _config(tmp_path, "plain")
    config.cache.compression = "none"  # the sampler used to ignore it (always zstd)
    stop = threading.Event()
    _run_until_cached(Sampler(config, 0, stop), stop, 10)
    with Cache(config.cache.dir, readonly=True) as cache:
        assert {cache.info(seq).codec for seq in range(10)} == {Codec.RAW}


def test_a_sample_larger_than_the_headroom_does_not_hold_up_the_rest_while_epochs_train(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    caplog.set_level(logging.WARNING, logger="epochcache")
    fs = fsspec.filesystem("memory")
    for i in range(40):
        fs.pipe_file(f"/headroom/s-{i:03d}.bin", random.Random(i).randbytes(2000))
    big = random.Random(99).randbytes(30_000)  # < capacity (80 KB), > headroom (8 KB)
    fs.pipe_file("/headroom/big.bin", big)
    config = EpochcacheConfig.model_validate({
        "source": {"url": "memory://headroom", "pattern": "*.bin", "checks": []},
        "cache": {"dir": str(tmp_path / "c"), "capacity": 80_000, "sync": False},
        "sampler": {"processes": 1, "concurrency": 4, "batch_size": 4},
    })
    cache = Cache(config.cache.dir, 80_000)
    # A trainer: epochs back to back, each snapshot taken before the last one is released.
    for i in range(40):
        cache.put(f"old-{i}", random.Random(1000 + i).randbytes(2000))
    stop, trained = threading.Event(), threading.Event()

    def train() -> None:
        snap = cache.snapshot(epoch=0)
        epoch = 0
        while not trained.is_set():
            trained.wait(0.05)
            epoch += 1
            nxt = cache.snapshot(epoch=epoch)
            snap.release()
            snap = nxt
        snap.release()

    trainer = threading.Thread(target=train)
    trainer.start()
    sampler = Sampler(config, 0, stop)
    runner = threading.Thread(target=sampler.run)
    runner.start()
    try:
        small = [f"s-{i:03d}.bin" for i in range(40)]
        deadline = time.monotonic() + 30
        seen: set[str] = set()
        while time.monotonic() < deadline and not set(small) <= seen:
            seen |= {key for key in small if key in cache}  # the cache turns over: remember
            time.sleep(0.02)
        assert set(small) <= seen, f"{len(seen)} of 40 small samples got in"
        assert "big.bin" not in cache
        assert sampler.health.deferred >= 1
    finally:
        stop.set()
        runner.join(60)
        trained.set()
        trainer.join(30)
        sampler.close()
        cache.close()
    assert any("big.bin" in r.getMessage() and "cache.headroom" in r.getMessage()
               for r in caplog.records)


def test_without_prctl_a_sampler_waiting_for_space_stops_when_its_daemon_is_gone(
    tmp_path: Path,
) -> None:
    """Where the kernel cannot kill samplers with their daemon, every wait loop checks the
    parent: here the committer waits for space behind a lease when the daemon goes away."""
    import os

    fs = fsspec.filesystem("memory")
    for i in range(60):
        fs.pipe_file(f"/orphan/s-{i:03d}.bin", random.Random(i).randbytes(4000))
    config = _config(tmp_path, "orphan")
    config.cache.capacity = 40_000
    Cache(config.cache.dir, 40_000).close()
    cache = Cache(config.cache.dir)
    stop = threading.Event()
    sampler = Sampler(config, 0, stop, parent_pid=os.getppid())
    runner = threading.Thread(target=sampler.run)
    runner.start()
    try:
        while len(cache) < 5:
            time.sleep(0.02)
        snap = cache.snapshot()  # pins what is there: the sampler fills the headroom, then waits
        deadline = time.monotonic() + 30
        while not sampler.health.waiting_for_space and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sampler.health.waiting_for_space
        sampler.lifeline.parent_pid = -1  # what getppid() shows once the daemon has died
        runner.join(10)
        assert not runner.is_alive(), "the sampler kept waiting for space without its daemon"
        assert stop.is_set()
        snap.release()
    finally:
        stop.set()
        runner.join(30)
        sampler.close()
        cache.close()


class _CountingCommitter:
    def __init__(self) -> None:
        self.checks = 0

    def check(self) -> None:
        self.checks += 1


def test_waiting_for_a_slow_batch_does_not_spin_on_a_later_one_that_is_done() -> None:
    # Batches of one source commit in order, so with the oldest still fetching and a later one
    # done there is nothing to do but wait. Waiting on every batch returned at once each time
    # (the later one is done): the loop spun, holding the GIL the fetch threads and fsspec's IO
    # loop need (found profiling ingest over HTTP, issue 14).
    from collections import deque
    from concurrent.futures import Future
    from types import SimpleNamespace

    from epochcache.ingest.process import Lifeline
    from epochcache.ingest.sampler import _Fetching

    feed = SimpleNamespace(name="")
    slow: Future[list[Any]] = Future()
    done: Future[list[Any]] = Future()
    done.set_result([])
    first = _Fetching(slow, feed, [], {}, 0, 0.0)  # type: ignore[arg-type]
    second = _Fetching(done, feed, [], {}, 0, 0.0)  # type: ignore[arg-type]
    sampler = object.__new__(Sampler)  # only the fields the wait uses
    sampler.fetching = deque([first, second])
    sampler.committer = committer = _CountingCommitter()  # type: ignore[assignment]
    sampler.lifeline = Lifeline(None)
    threading.Timer(0.6, slow.set_result, ([],)).start()

    assert sampler._wait_fetched() is first
    # one committer check per poll round (0.25 s) while waiting, not one per spin
    assert committer.checks <= 4, committer.checks
    assert list(sampler.fetching) == [second]


def test_batches_queued_behind_a_slow_commit_are_committed_in_one_transaction(
    tmp_path: Path
) -> None:
    """Another process holds the cache's write lock (as a commit with a slow fsync does): the
    batches handed over meanwhile are committed together, in one transaction, in order."""
    import subprocess
    import sys

    from epochcache.ingest.committer import Batch, Committer
    from epochcache.ingest.sampler import SamplerHealth
    from epochcache.store import SampleStore

    config = _config(tmp_path, "group")
    store = SampleStore(config.cache.dir, sync=False)
    health = SamplerHealth(index=0)
    done: list[Batch] = []
    committer = Committer(store, health, stop=threading.Event(), should_stop=lambda: False,
                          quarantine=lambda key, why: None, done=done.append)
    hold = (f"import lmdb, sys\nenv = lmdb.open({str(config.cache.dir)!r}, max_dbs=16, "
            "map_size=1 << 30)\ntxn = env.begin(write=True)\nprint('held', flush=True)\n"
            "sys.stdin.readline()\ntxn.abort()\n")
    holder = subprocess.Popen([sys.executable, "-c", hold], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        committer.start()
        batches = []
        for b in range(4):
            keys = [f"b{b}/k{i}" for i in range(3)]
            records = [(key, store.writer.encode(key, f"{key} payload".encode())) for key in keys]
            batches.append(Batch(records, {"pass": b}, keys, sum(len(r) for _, r in records)))
        committer.hand_over(batches[0])
        deadline = time.monotonic() + 10
        while committer._batches.qsize() and time.monotonic() < deadline:
            time.sleep(0.01)  # the committer took the first one and waits for the lock
        handing = threading.Thread(target=lambda: [committer.hand_over(b) for b in batches[1:]])
        handing.start()
        while committer._batches.qsize() < 3 and time.monotonic() < deadline:
            time.sleep(0.01)  # (a queue of one would hold them back one by one)
        before = store.env.lmdb_env.info()["last_txnid"]
        assert holder.stdin is not None
        holder.stdin.write("\n")
        holder.stdin.flush()
        handing.join(10)
        committer.finish()
    finally:
        holder.kill()
        holder.wait()
    assert done == batches  # each released once committed, in order
    assert health.committed == 12 and health.position == {"pass": 3}
    assert all(key in store for batch in batches for key in batch.keys)
    # the first batch's commit, the group's, and at most one health document
    assert store.env.lmdb_env.info()["last_txnid"] - before <= 3
    assert committer.grouped == 2  # batches 2-4 rode in one transaction after the first
    store.close()


def test_warnings_of_samples_larger_than_the_headroom_are_few_and_their_keys_bounded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A source of large samples and a small headroom (issue 22, item 5): one warning per key
    and a set of every key warned about would grow with the source."""
    import logging

    from epochcache.ingest import committer as committer_module
    from epochcache.ingest.committer import Batch, Committer
    from epochcache.ingest.sampler import SamplerHealth
    from epochcache.store import SampleStore

    caplog.set_level(logging.WARNING, logger="epochcache")
    cache = SampleStore(tmp_path / "c", capacity=40_000, headroom=1000, sync=False)
    for i in range(20):
        cache.put(f"old-{i}", random.Random(i).randbytes(2000))
    snapshot = cache.snapshot(epoch=0)  # an epoch trains on all of it: nothing may go
    health = SamplerHealth(index=0)
    stop = threading.Event()
    committer = Committer(cache, health, stop=stop, should_stop=stop.is_set,
                          quarantine=lambda key, why: None, done=lambda batch: None)
    committer.start()
    big = random.Random(7).randbytes(3000)  # > headroom
    records = [(f"big-{i:05d}", cache.writer.encode(f"big-{i:05d}", big)) for i in range(3000)]
    committer.hand_over(Batch(records, {}, [key for key, _ in records], 0))
    wait_for_deferred = time.monotonic() + 60
    while health.deferred < 3000 and time.monotonic() < wait_for_deferred:
        time.sleep(0.05)
    committer.finish()
    snapshot.release()
    cache.close()
    assert health.deferred == 3000
    warnings = [r for r in caplog.records if "more than the cache's headroom" in r.getMessage()]
    assert 1 <= len(warnings) <= 2, len(warnings)
    assert len(committer._deferred_logged) <= committer_module.DEFERRED_KEYS


def test_a_cache_pointed_at_another_source_starts_it_at_its_own_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A sampler's saved position is an offset in one listing's key order (issue 22, item 7):
    applied to another source's keys it skipped their start."""
    import logging

    from epochcache.ingest.keyorder import Position

    fs = fsspec.filesystem("memory")
    for name in ("first", "second"):
        for i in range(200):
            fs.pipe_file(f"/{name}/obj-{i:03d}.bin", random.Random(i).randbytes(100))
    config = _config(tmp_path, "first", batch_size=16)
    stop = threading.Event()
    _run_until_cached(Sampler(config, 0, stop), stop, 100)
    with Cache(config.cache.dir, readonly=True) as cache:
        saved = cache.tables.get_state("sampler/0")["position"]
    assert saved["pass_index"] > 0 or saved["offset"] > 0  # where this source goes on

    moved = config.model_copy(deep=True)
    moved.source.url = "memory://second"  # type: ignore[union-attr]
    caplog.set_level(logging.INFO, logger="epochcache")
    second = Sampler(moved, 0, threading.Event())
    try:
        assert second.feeds[0].order.position == Position(0, 0)
    finally:
        second.close()
    assert "belongs to another listing" in caplog.text
