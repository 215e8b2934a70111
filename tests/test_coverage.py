"""Coverage (issue 28, item 2): how much of each source training has seen, kept per cache.

A real daemon fills a cache from a local remote; the trainer's side records what epochs
trained on (``cache.record_trained``, which ``epochcache run`` calls per epoch), and
``cache.coverage()`` / ``status --json`` / the daemon's metrics report it. The listing
changing under the ledger (keys added or gone by a re-list, a new generation), several
processes recording at once, and caches without origins (an older version's) are each tested.

Internals: the origins table is read and dropped through ``cache.env`` to check what samplers
wrote and an older cache without it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from common.daemonproc import upload, wait_cached, wait_running, write_config
from common.procs import run_processes

from epochcache import Cache
from epochcache.coverage.ledger import Ledger, ledger_path, ledgers, remap
from epochcache.ingest.layouts import KeyTable
from epochcache.ingest.lineage import index_map
from epochcache.store import SampleStore
from epochcache.store.origins import Origin, register_listing
from epochcache.store.records import DB_ORIGINS, DB_SAMPLES, read_info

pytestmark = pytest.mark.timeout(180)


def _keys_by_seq(cache: Cache) -> dict[int, str]:
    with cache.env.read() as txn:
        return {int.from_bytes(bytes(k), "big"): read_info(v).key
                for k, v in txn.cursor(db=cache.env.dbs[DB_SAMPLES])}


def _fill(tmp_path: Path, start_daemon: Any, n: int, layout: str = "files",
          **config: Any) -> tuple[Path, Any, Path]:
    url = (tmp_path / "remote").as_uri()
    upload(lambda _p: url, {}, "", n, layout, samples_per_shard=50)
    cache_dir = tmp_path / "cache"
    cfg = write_config(tmp_path / "cfg.yaml", url=url, cache_dir=cache_dir, storage_options={},
                       layout=layout, **config)
    daemon = start_daemon(cfg)
    wait_running(daemon, cache_dir)
    return cache_dir, daemon, cfg


def test_coverage_counts_distinct_samples_and_epochs(tmp_path: Path, start_daemon: Any) -> None:
    """Epochs over part of a source, then over all of it: ``covered`` counts distinct samples,
    the histogram how many epochs each was trained in, exactly; status shows it."""
    cache_dir, daemon, _ = _fill(tmp_path, start_daemon, 200)
    wait_cached(daemon, cache_dir, 200)
    cache = Cache(cache_dir)
    try:
        with cache.snapshot() as snap:
            seqs = snap.seqs
        first, rest = seqs[:80], seqs
        assert cache.record_trained(first, epoch=0)["new"] == 80
        assert cache.record_trained(np.concatenate([rest, rest[:5]]), epoch=1) == {
            "trained": 200, "new": 120, "unattributed": 0}
        report = cache.coverage()
        (source,) = report["sources"]
        assert source["samples"] == 200 and source["covered"] == 200
        assert source["fraction"] == 1.0 and not source["estimated"]
        assert source["histogram"]["1"] == 120 and source["histogram"]["2"] == 80
        assert source["histogram"]["0"] == 0 and sum(source["histogram"].values()) == 200
        assert source["updates"] == 2 and source["coverage_per_s"] > 0
        assert source["eta_s"] == 0.0  # every sample seen
        # The counts are per listed key: the ledger's byte of each key is its epochs.
        names = _keys_by_seq(cache)
        ledger = Ledger.load(ledger_path(cache.path, _fingerprint(cache)))
        assert ledger is not None
        table = _listing_keys(cache_dir)
        for seq in first.tolist():
            assert ledger.counts[table.index(names[seq])] == 2
    finally:
        cache.close()
    stats = json.loads(_status(cache_dir))
    assert stats["coverage"]["sources"][0]["covered"] == 200


def _status(cache_dir: Path) -> str:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "epochcache", "status", str(cache_dir), "--json"],
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout


def _fingerprint(cache: Cache) -> str:
    from epochcache.store.origins import listings

    (info,) = listings(cache.env).values()
    return str(info["fingerprint"])


def _listing_keys(cache_dir: Path) -> list[str]:
    from epochcache.ingest.layouts import read_listing

    (path,) = (cache_dir / "listings").glob("*.keys")
    listing = read_listing(cache_dir, path.name.split(".")[0])
    assert listing is not None
    return listing.table.keys()


def test_tar_coverage_counts_samples_and_estimates_unread_shards(
        tmp_path: Path, start_daemon: Any) -> None:
    """A tar source lists shards: its samples are counted as shards are trained, the total
    estimated (and said to be) until every shard was."""
    cache_dir, daemon, _ = _fill(tmp_path, start_daemon, 300, layout="tar")
    wait_cached(daemon, cache_dir, 300)
    cache = Cache(cache_dir)
    try:
        names = _keys_by_seq(cache)
        seqs = np.array(sorted(names), dtype=np.uint64)
        half = np.array([s for s in seqs.tolist()
                         if names[s].split("/")[0] in ("shard-000000.tar", "shard-000001.tar",
                                                       "shard-000002.tar")], dtype=np.uint64)
        cache.record_trained(half[:120])  # two shards whole, a third in part
        (source,) = cache.coverage()["sources"]
        assert source["unit"] == "shard" and source["estimated"]
        assert source["covered"] == 120 and source["samples"] == 300  # 6 shards x 50, estimated
        cache.record_trained(seqs)
        (source,) = cache.coverage()["sources"]
        assert not source["estimated"] and source["samples"] == 300 and source["covered"] == 300
        assert source["histogram"]["2"] == 120 and source["histogram"]["1"] == 180
    finally:
        cache.close()


def test_relisted_keys_grow_the_ledger_and_gone_keys_are_counted(
        tmp_path: Path, start_daemon: Any) -> None:
    """``source.listing_ttl_s``: keys a re-list adds join the coverage (their counts start at
    0), earlier counts stay where they were, and keys gone from the bucket are reported."""
    cache_dir, daemon, _ = _fill(tmp_path, start_daemon, 100,
                                 source={"listing_ttl_s": "1s"})
    wait_cached(daemon, cache_dir, 100)
    cache = Cache(cache_dir)
    try:
        with cache.snapshot() as snap:
            cache.record_trained(snap.seqs, epoch=0)
        remote = tmp_path / "remote"
        for i in range(100, 150):  # the bucket grows...
            (remote / f"sample-{i:06d}.npy").write_bytes((remote / "sample-000000.npy").read_bytes())
        (remote / "sample-000003.npy").unlink()  # ... and loses a key
        wait_cached(daemon, cache_dir, 150, timeout_s=90)
        with cache.snapshot() as snap:
            cache.record_trained(snap.seqs, epoch=1)
        (source,) = cache.coverage()["sources"]
        assert source["samples"] == 150 and source["covered"] == 150
        assert source["gone"] == 1
        assert source["histogram"]["2"] == 100 and source["histogram"]["1"] == 50
    finally:
        cache.close()


def test_a_new_listing_generation_is_mapped_by_key(tmp_path: Path) -> None:
    """A listing made afresh orders its keys anew: the ledger and the origin rows of the old
    generation follow the keys (what a sampler does when it takes a new generation in); a
    generation no sampler could map from restarts the coverage, keeping the old totals."""
    cache = Cache(tmp_path / "cache", capacity="1MiB")
    try:
        old_keys = ["k/b", "k/c", "k/a", "k/d"]  # a listing under way: pages, unsorted
        info = {"source": "", "fingerprint": "fp", "generation": "g1", "url": "mem://x",
                "unit": "sample", "listed": 4, "gone": 0, "complete": False, "node_rank": 0,
                "num_nodes": 1}
        lid = register_listing(cache.env, info)
        put = cache.put_many([(k, k.encode()) for k in old_keys],
                             origins={k: Origin(lid, i) for i, k in enumerate(old_keys)})
        cache.record_trained(put.seqs[:2])  # k/b and k/c once
        new_keys = ["k/a", "k/b", "k/c", "k/e"]  # the finished listing: sorted, k/d gone
        mapping = index_map(KeyTable.from_refs(_refs(old_keys)), KeyTable.from_refs(_refs(new_keys)))
        assert mapping.tolist() == [1, 2, 0, -1]
        remap(cache, info, {**info, "generation": "g2", "complete": True}, lid, mapping)
        cache.record_trained(put.seqs)  # every sample once more: k/d has no key now
        ledger = Ledger.load(ledger_path(cache.path, "fp"))
        assert ledger is not None and ledger.header["generation"] == "g2"
        assert ledger.counts.tolist() == [1, 2, 2, 0]  # k/a, k/b, k/c, k/e
        assert cache.coverage()["unattributed"] == 1  # k/d: in no listing of this generation
        # No sampler held g2 when g3 came: the coverage starts afresh, the old totals kept.
        register_listing(cache.env, {**info, "generation": "g3", "listed": 4})
        cache.record_trained(put.seqs[:1])
        (source,) = cache.coverage()["sources"]
        assert source["generation"] == "g3" and source["covered"] == 0
        assert source["previous"][0]["generation"] == "g2"
        assert source["previous"][0]["covered"] == 3
    finally:
        cache.close()


def _refs(keys: list[str]) -> list[Any]:
    from epochcache.ingest.layouts import SampleRef

    return [SampleRef(key) for key in keys]


def test_a_cache_without_origins_counts_them_unattributed(tmp_path: Path) -> None:
    """A cache written by an older version has no origins sub-database: its samples are
    unattributed in coverage, never an error, and status works."""
    cache_dir = tmp_path / "cache"
    cache = Cache(cache_dir, capacity="1MiB")
    put = cache.put_many([(f"s/{i}", b"x" * 100) for i in range(20)])
    with cache.env.lmdb_env.begin(write=True) as txn:  # as an older version left it
        txn.drop(cache.env.dbs[DB_ORIGINS], delete=True)
    cache.close()
    old = Cache(cache_dir)
    try:
        assert old.record_trained(put.seqs) == {"trained": 0, "new": 0, "unattributed": 20}
        assert old.coverage() == {"sources": [], "unattributed": 20}
    finally:
        old.close()
    assert json.loads(_status(cache_dir))["coverage"]["unattributed"] == 20


def _record_many(cache_dir: str, seqs: list[int], times: int) -> None:
    cache = Cache(cache_dir)
    try:
        for epoch in range(times):
            cache.record_trained(np.array(seqs, dtype=np.uint64), epoch=epoch)
    finally:
        cache.close()


def test_processes_recording_at_once_lose_no_count(tmp_path: Path, start_daemon: Any) -> None:
    """Three trainer processes record epochs into one ledger at the same time (ranks, or jobs
    sharing the cache): every count is there."""
    cache_dir, daemon, _ = _fill(tmp_path, start_daemon, 120)
    wait_cached(daemon, cache_dir, 120)
    daemon.terminate()
    cache = Cache(cache_dir)
    with cache.snapshot() as snap:
        seqs = snap.seqs.tolist()
    cache.close()
    run_processes(_record_many, [(str(cache_dir), seqs, 6)] * 3, timeout_s=120)
    cache = Cache(cache_dir)
    try:
        (source,) = cache.coverage()["sources"]
        assert source["histogram"]["16-31"] == 120  # 3 processes x 6 epochs = 18 each
        ledger = Ledger.load(ledger_path(cache.path, _fingerprint(cache)))
        assert ledger is not None and set(ledger.counts.tolist()) == {18}
    finally:
        cache.close()


def test_daemon_metrics_export_coverage(tmp_path: Path, start_daemon: Any) -> None:
    pytest.importorskip("prometheus_client")
    cache_dir, daemon, _ = _fill(tmp_path, start_daemon, 60)
    wait_cached(daemon, cache_dir, 60)
    cache = Cache(cache_dir)
    try:
        with cache.snapshot() as snap:
            cache.record_trained(snap.seqs[:30])
    finally:
        cache.close()
    from epochcache.ingest.prometheus import MetricsServer, daemon_metrics

    store = SampleStore(cache_dir, readonly=True)
    server = MetricsServer(lambda: daemon_metrics(store), "127.0.0.1", 0, "daemon.metrics_port")
    try:
        text = urllib.request.urlopen(server.url, timeout=10).read().decode()
    finally:
        server.close()
        store.close()
    assert 'epochcache_coverage_covered_samples{source="' in text
    line = next(row for row in text.splitlines()
                if row.startswith("epochcache_coverage_covered_samples{"))
    assert line.endswith(" 30.0")
    assert 'epochcache_coverage_epochs_samples{epochs="0"' in text
    assert "epochcache_coverage_listed_samples" in text


def test_run_logs_coverage_per_epoch_and_plots_it(tmp_path: Path) -> None:
    """``epochcache run``: each epoch's log line and metrics row say the coverage; the run's
    plot and ``epochcache plot`` draw the coverage curve beside the fill panels."""
    from test_run import assert_png, cli, demo_config, read_metrics, write_yaml

    write_yaml(tmp_path / "cfg.yaml", demo_config(tmp_path, train={"epochs": 2, "plot": True}))
    result = cli("run", "cfg.yaml", cwd=tmp_path)
    assert result.returncode == 0, result
    assert "coverage " in result.stderr and "samples (" in result.stderr, result
    rows = read_metrics(tmp_path / "runs" / "demo")
    covered = [row["coverage"]["covered"] for row in rows]
    assert covered[0] > 0 and covered[1] >= covered[0], rows
    assert rows[-1]["coverage"]["samples"] == 2000
    plot = cli("plot", "demo-cache", "-o", "fill.png", cwd=tmp_path)
    assert plot.returncode == 0, plot
    assert_png(tmp_path / "fill.png", min_size=(1500, 300))  # three panels
    assert_png(tmp_path / "runs" / "demo" / "run.png", min_size=(1500, 600))


_HOLDING_TRAINER = '''\
"""Trains a tiny model; with HOLD set, the run's checkpoint named there is held in its write
(torch.save blocks once it has begun), so that the test kills the job during the write."""
import os, sys, time
import torch

_save = torch.save
HOLD = os.environ.get("HOLD", "")  # "mid:EPOCH:BATCHES" or "end:EPOCH"


def _held(obj):
    if not HOLD or not isinstance(obj, dict) or "epoch" not in obj:
        return False
    kind, epoch, *at = HOLD.split(":")
    mid = obj.get("resume")
    if kind == "mid":
        return bool(mid) and mid["epoch"] == int(epoch) and mid["batches"] >= int(at[0])
    return not mid and obj["epoch"] == int(epoch)


def _holding_save(obj, f, *args, **kwargs):
    if _held(obj):
        f.write(b"half a checkpoint")
        sys.stdout.write("HOLD\\n")
        sys.stdout.flush()
        time.sleep(600)
    return _save(obj, f, *args, **kwargs)


torch.save = _holding_save
if HOLD.startswith("counted:"):  # the checkpoint written, its coverage not yet counted
    import epochcache.coverage.staged as staged

    _commit, _commits = staged.commit, []

    def _holding_commit(cache, token):
        _kind, epoch, count = HOLD.split(":")
        if int(token.split(".")[1]) == int(epoch):
            _commits.append(token)
            if len(_commits) == int(count):
                sys.stdout.write("HOLD\\n")
                sys.stdout.flush()
                time.sleep(600)
        return _commit(cache, token)

    staged.commit = _holding_commit


def train_epoch(run, epoch, loader):
    model = run.state.get("model") or run.restore("model", torch.nn.Linear(16, 1))
    for i, batch in enumerate(loader):
        model(torch.nan_to_num(batch.float())).sum().backward()
        if i < len(loader) - 4:
            # Longer than train.checkpoint_every_s: a checkpoint after each batch but the
            # last four, which only the epoch's end covers.
            time.sleep(0.06)
    return {"loss": 0.0}
'''


@pytest.mark.parametrize(("hold", "settled"), [
    ("mid:1:5", (0, 1)),
    pytest.param("end:1", (0, 1), marks=pytest.mark.slow),
    pytest.param("counted:1:5", (1, 0), marks=pytest.mark.slow),
])
def test_a_job_killed_while_writing_a_checkpoint_counts_each_sample_once(
        tmp_path: Path, hold: str, settled: tuple[int, int]) -> None:
    """``epochcache run`` killed (SIGKILL, every process) while it writes a checkpoint --
    mid-epoch, or at an epoch's end -- or once it is written, before its coverage is counted;
    then resumed: the coverage ledger counts each sample once per epoch, and the manifests
    list it once (issue 33, item 5). On 3c6d3cb the batches a checkpoint was to cover were
    counted before it was written, and again by the resume: 10 of 120 samples counted 3 times
    in 2 epochs (mid-epoch), 40 (at the epoch's end)."""
    import yaml
    from common.procs import Job
    from test_run import cli, cli_env
    from test_run_resume import _dataset

    from epochcache.coverage.manifests import epoch_keys

    _dataset(tmp_path / "data", 120)
    (tmp_path / "holding_trainer.py").write_text(_HOLDING_TRAINER)
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump({
        "source": {"url": (tmp_path / "data").as_uri(), "pattern": "*.npy"},
        "cache": {"dir": str(tmp_path / "cache"), "capacity": "1MiB"},
        "sampler": {"processes": 1, "concurrency": 4},
        "loader": {"batch_size": 10, "num_workers": 0},
        "train": {"epochs": 2, "min_samples": 120, "entrypoint": "holding_trainer:train_epoch",
                  "run_dir": str(tmp_path / "run"), "checkpoint_every_s": 0.05,
                  "plot": False},
    }))
    job = Job([sys.executable, "-m", "epochcache", "run", str(config)], cwd=tmp_path,
              env=cli_env({"HOLD": hold}, pythonpath=tmp_path), stdout=subprocess.PIPE,
              stderr=subprocess.STDOUT, text=True)
    try:
        assert job.popen.stdout is not None
        lines = []
        for line in job.popen.stdout:  # until the checkpoint's write is held
            lines.append(line)
            if line.startswith("HOLD"):
                break
        else:
            raise AssertionError(f"the run exited {job.popen.wait()} before the checkpoint:\n"
                                 + "".join(lines[-40:]))
    finally:
        job.kill()
    resumed = cli("run", str(config), "--resume", cwd=tmp_path, env=cli_env(pythonpath=tmp_path))
    assert resumed.returncode == 0, resumed

    cache = Cache(tmp_path / "cache", readonly=True)
    try:
        (ledger,) = ledgers(cache.path, header_only=False)
        histogram = cache.coverage()["sources"][0]["histogram"]
    finally:
        cache.close()
    assert ledger.counts.tolist() == [2] * 120, np.bincount(ledger.counts).tolist()
    assert histogram["2"] == 120, histogram
    for epoch in range(2):
        assert sorted(epoch_keys(tmp_path / "run", epoch)) == [f"{i:06d}.npy" for i in
                                                                range(120)]
    assert ("coverage: {} update(s) a checkpoint covered counted now, {} its checkpoint never "
            "covered dropped".format(*settled)) in resumed.stderr, resumed.stderr[-3000:]
