"""Per-epoch training manifests (issue 28, item 3).

``epochcache run`` writes, per epoch and rank, the sample keys it trained on, in order;
``epochcache manifest RUN_DIR --epoch N`` prints them. An epoch killed (SIGKILL of the whole
job) and resumed from its mid-epoch checkpoint has a manifest with each of its samples once,
in the epoch's order, and the coverage ledger counts each once. A manifest fed back as
``source.manifest`` refetches exactly those samples: one source, several (keys carry the
source's name), and tar shards (a sample inside its shard).

Internals: the raw records (``cache.env``) give the keys a manifest must list.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from common.daemonproc import all_samplers, upload, wait_cached, wait_for, wait_running
from test_run import cli, cli_env
from test_run_resume import TRAINER, _config, _dataset, _rows, _start, _wait_to_die

from epochcache import Cache
from epochcache.coverage.ledger import Ledger, ledgers
from epochcache.coverage.manifests import ManifestWriter, epoch_keys, manifest_path
from epochcache.store.records import DB_SAMPLES, read_info

pytestmark = pytest.mark.timeout(300)


def _ids(keys: list[str]) -> list[int]:
    return [int(key.split("/")[-1].split(".")[0]) for key in keys]


def _orders(log: Path) -> dict[int, list[int]]:
    """Each epoch's lane as its (last) attempt planned it, from the trainer's log."""
    orders: dict[int, list[int]] = {}
    first_pid = None
    for row in _rows(log):
        if "order" in row:
            first_pid = first_pid or row["pid"]
            # A resumed epoch logs the rest of its lane: the whole lane is the first attempt's.
            if row["epoch"] not in orders or row["pid"] == first_pid:
                orders[row["epoch"]] = row["order"]
    return orders


def test_killed_and_resumed_epoch_has_each_sample_once_in_order(tmp_path: Path) -> None:
    """SIGKILL of the job after a mid-epoch checkpoint (and batches past it), then --resume:
    the epoch's manifest is its lane, in order, each sample once; the coverage ledger counts
    each sample once per epoch whose lane holds it."""
    _dataset(tmp_path / "data", 400)
    (tmp_path / "resume_trainer.py").write_text(TRAINER)
    (tmp_path / "logs").mkdir()
    config = _config(tmp_path)
    run = _start([sys.executable, "-m", "epochcache", "run", str(config)], tmp_path,
                 cli_env({"DIE_AT": "1:12"}, pythonpath=tmp_path))
    _wait_to_die(run, 1)
    checkpoint = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert checkpoint["resume"]["epoch"] == 1 and 0 < checkpoint["resume"]["batches"] <= 12
    result = cli("run", str(config), "--resume", cwd=tmp_path, env=cli_env(pythonpath=tmp_path))
    assert result.returncode == 0, result

    orders = _orders(tmp_path / "logs" / "rank0.jsonl")
    assert sorted(orders) == [0, 1, 2]
    for epoch, order in orders.items():
        printed = cli("manifest", "run", "--epoch", str(epoch), cwd=tmp_path)
        assert printed.returncode == 0, printed
        keys = printed.stdout.splitlines()
        assert _ids(keys) == order, (epoch, len(keys), len(order))
    # The file of epoch 1 holds the killed attempt's records past its checkpoint too; they
    # are dropped on reading, not lost from disk.
    listed = cli("manifest", "run", cwd=tmp_path)
    assert listed.returncode == 0 and "epoch 1: " in listed.stdout, listed

    cache = Cache(tmp_path / "cache", readonly=True)
    try:
        (ledger,) = [Ledger.load(str(tmp_path / "cache" / "coverage" / f"{h.header['fingerprint']}.ledger"))
                     for h in ledgers(cache.path)]
    finally:
        cache.close()
    assert ledger is not None
    expected = np.zeros(400, dtype=np.uint8)
    for order in orders.values():
        expected[np.unique(order)] += 1  # listing index == sample id (keys sorted)
    assert ledger.counts.tolist() == expected.tolist()


def test_torn_record_is_ignored_and_cut_before_the_next(tmp_path: Path) -> None:
    """A job killed while appending leaves half a record: readers ignore it, and the next
    writer (a resumed epoch) cuts it off before appending."""
    cache = Cache(tmp_path / "cache", capacity="1MiB")
    try:
        put = cache.put_many([(f"k{i:03d}", b"x") for i in range(30)])
        seqs = np.array(put.seqs, dtype=np.uint64)
        writer = ManifestWriter(cache, tmp_path / "run", epoch=0, rank=0, lease="L")
        writer.write(seqs[:10], 10)
        path = manifest_path(tmp_path / "run", 0, 0)
        whole = path.stat().st_size
        writer.write(seqs[10:20], 20)
        with open(path, "r+b") as f:
            f.truncate(whole + 15)  # the second record torn
        assert epoch_keys(tmp_path / "run", 0) == [f"k{i:03d}" for i in range(10)]
        resumed = ManifestWriter(cache, tmp_path / "run", epoch=0, rank=0,
                                  lease="L", position=10)
        resumed.write(seqs[10:30], 30)
        assert epoch_keys(tmp_path / "run", 0) == [f"k{i:03d}" for i in range(30)]
    finally:
        cache.close()


def test_a_resume_on_another_number_of_ranks_keeps_what_each_lane_kept(tmp_path: Path) -> None:
    """Two ranks write records along their lanes; rank 1 dies after writing a record its
    checkpoint never covered; the job resumes on one rank, whose lane is the rest dealt anew
    (positions from 0 again), then on three. Each file keeps what its lane kept before the
    stop (rank 0's were dropped on 3c6d3cb: the new lane's first record "started at 0"), the
    uncovered record goes, and the epoch lists each sample once."""
    cache = Cache(tmp_path / "cache", capacity="1MiB")
    run = tmp_path / "run"
    try:
        seqs = np.array(cache.put_many([(f"k{i:03d}", b"x") for i in range(60)]).seqs,
                        dtype=np.uint64)
        keys = [f"k{i:03d}" for i in range(60)]

        def writer(rank: int, local_rank: int, size: int, split: Any,
                   position: int = 0) -> ManifestWriter:
            return ManifestWriter(cache, run, epoch=1, rank=rank, lease="L",
                                  position=position, lane={"local_rank": local_rank,
                                                           "local_world_size": size,
                                                           "split": split})

        lanes = [list(range(0, 60, 2)), list(range(1, 60, 2))]  # 30 samples each
        for rank in (0, 1):
            first = writer(rank, rank, 2, None)
            first.write(seqs[lanes[rank][:10]], 10)
        writer(1, 1, 2, None, 10).write(seqs[lanes[1][10:14]], 14)  # past the checkpoint
        split = {"local_world_size": 2, "lanes": [30, 30], "positions": [10, 10],
                 "resumed": None}
        rest = lanes[0][10:] + lanes[1][10:]
        one = writer(0, 0, 1, split)
        one.write(seqs[rest[:16]], 16)  # checkpointed after 16 of the new lane's 40
        assert sorted(epoch_keys(run, 1)) == sorted(keys[i] for i in
                                                     lanes[0][:10] + lanes[1][:10] + rest[:16])
        assert epoch_keys(run, 1, 1) == [keys[i] for i in lanes[1][:10]]
        # Interrupted again, resumed on three ranks: the rest of the one lane dealt anew.
        again = {"local_world_size": 1, "lanes": [40], "positions": [16], "resumed": split}
        tail = rest[16:]
        for rank in range(3):
            writer(rank, rank, 3, again).write(seqs[tail[rank::3]], len(tail[rank::3]))
        every = epoch_keys(run, 1)
        assert sorted(every) == keys, (len(every), len(set(every)))
        assert epoch_keys(run, 1, 0) == ([keys[i] for i in lanes[0][:10] + rest[:16]]
                                          + [keys[i] for i in tail[0::3]])
    finally:
        cache.close()


# -- round trips: a manifest fed back as source.manifest ----------------------------------------


def _daemon_config(path: Path, cache_dir: Path, sources: list[dict[str, Any]] | None = None,
                   source: dict[str, Any] | None = None) -> Path:
    config: dict[str, Any] = {
        "cache": {"dir": str(cache_dir), "capacity": "64MiB"},
        "sampler": {"processes": 2, "concurrency": 8, "batch_size": 16},
    }
    if sources is not None:
        config["sources"] = sources
    else:
        config["source"] = source
    path.write_text(yaml.safe_dump(config))
    return path


def _cached_keys(cache_dir: Path) -> list[str]:
    cache = Cache(cache_dir, readonly=True)
    try:
        with cache.env.read() as txn:
            return [read_info(v).key for _k, v in txn.cursor(db=cache.env.dbs[DB_SAMPLES])]
    finally:
        cache.close()


def _train_one_epoch(cache_dir: Path, run_dir: Path, sources: list[str]) -> list[str]:
    """An epoch through cache.epochs(), recorded batch by batch as ``run`` does."""
    cache = Cache(cache_dir)
    try:
        for epoch, loader in cache.epochs(1, batch_size=16, min_samples=1, decode=None,
                                          collate_fn=len, samples_per_epoch=50):
            writer = ManifestWriter(cache, run_dir, epoch=epoch, rank=0,
                                    lease=loader.state_dict()["lease"], sources=sources)
            for _batch in loader:
                pass
            writer.write(loader.seqs, loader.state_dict()["position"])
    finally:
        cache.close()
    return epoch_keys(run_dir, 0)


def _until_idle(daemon: Any, cache_dir: Path, processes: int = 2) -> None:
    def idle() -> bool:
        if not daemon.alive():
            raise AssertionError(daemon.logs()[-3000:])
        return all_samplers(cache_dir, processes, lambda h: h.get("idle") == "complete")

    wait_for(idle, 90, "the samplers to cache every key and go idle")


@pytest.mark.parametrize("layout", ["files", "tar"])
def test_manifest_refetches_exactly_its_samples(tmp_path: Path, start_daemon: Any,
                                                layout: str) -> None:
    url = (tmp_path / "remote").as_uri()
    upload(lambda _p: url, {}, "", 200, layout, samples_per_shard=40)
    pattern = "*.npy" if layout == "files" else "*.tar"
    first = _daemon_config(tmp_path / "a.yaml", tmp_path / "cache",
                           source={"url": url, "layout": layout, "pattern": pattern})
    daemon = start_daemon(first)
    wait_running(daemon, tmp_path / "cache")
    wait_cached(daemon, tmp_path / "cache", 200)
    daemon.terminate()
    keys = _train_one_epoch(tmp_path / "cache", tmp_path / "run", [])
    assert len(keys) == 50 and len(set(keys)) == 50
    (tmp_path / "epoch0.txt").write_text("\n".join(keys) + "\n")
    # relative: read from the daemon's working directory, as every relative path of a config
    # (it was read from under source.url, so the manifest a user had just written was not
    # found: issue 37, item 6)
    again = _daemon_config(tmp_path / "b.yaml", tmp_path / "again", source={
        "url": url, "layout": layout, "manifest": "epoch0.txt"})
    refetch = start_daemon(again)
    wait_running(refetch, tmp_path / "again")
    _until_idle(refetch, tmp_path / "again")
    assert sorted(_cached_keys(tmp_path / "again")) == sorted(keys)


def test_manifest_of_several_sources_refetches_each(tmp_path: Path, start_daemon: Any) -> None:
    """A cache fed by ``sources:`` keys samples ``<name>/<key>``: ``--source NAME`` prints a
    manifest for that source, and fed back each source refetches exactly its samples."""
    urls = {}
    for name, layout in (("imgs", "files"), ("shards", "tar")):
        urls[name] = (tmp_path / name).as_uri()
        upload(lambda _p, u=urls[name]: u, {}, "", 100, layout, samples_per_shard=25)
    entries = [
        {"name": "imgs", "weight": 1, "url": urls["imgs"], "pattern": "*.npy"},
        {"name": "shards", "weight": 1, "url": urls["shards"], "layout": "tar",
         "pattern": "*.tar"},
    ]
    daemon = start_daemon(_daemon_config(tmp_path / "a.yaml", tmp_path / "cache", sources=entries))
    wait_running(daemon, tmp_path / "cache")
    wait_cached(daemon, tmp_path / "cache", 200)
    daemon.terminate()
    keys = _train_one_epoch(tmp_path / "cache", tmp_path / "run", ["imgs", "shards"])
    per_source = {}
    for name in ("imgs", "shards"):
        out = tmp_path / f"{name}.txt"
        printed = cli("manifest", "run", "--epoch", "0", "--source", name, "-o", str(out),
                      cwd=tmp_path)
        assert printed.returncode == 0, printed
        per_source[name] = out.read_text().split()
        assert not any(key.startswith(name + "/") for key in per_source[name])
    assert sorted(f"{n}/{k}" for n, ks in per_source.items() for k in ks) == sorted(keys)
    back = [{**entry, "manifest": str(tmp_path / f"{entry['name']}.txt")} for entry in entries]
    for entry in back:
        entry.pop("pattern")
    refetch = start_daemon(_daemon_config(tmp_path / "b.yaml", tmp_path / "again", sources=back))
    wait_running(refetch, tmp_path / "again")
    _until_idle(refetch, tmp_path / "again")
    assert sorted(_cached_keys(tmp_path / "again")) == sorted(keys)


@pytest.mark.slow
def test_two_ranks_each_have_their_manifest_after_a_kill_and_resume(tmp_path: Path) -> None:
    """Under torchrun each rank's manifest is its own lane, in order, after a SIGKILL of the
    whole job and --resume; the epoch's manifest (every rank) holds each sample once."""
    _dataset(tmp_path / "data", 400)
    (tmp_path / "resume_trainer.py").write_text(TRAINER)
    (tmp_path / "logs").mkdir()
    config = _config(tmp_path)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2", "-m", "epochcache", "run", str(config)]
    job = _start(argv, tmp_path, cli_env({"DIE_AT": "1:6"}, pythonpath=tmp_path))
    _wait_to_die(job, 2)
    resumed = _start([*argv, "--resume"], tmp_path, cli_env(pythonpath=tmp_path))
    try:
        _out, err = resumed.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        os.killpg(resumed.pid, signal.SIGKILL)
        _out, err = resumed.communicate()
        raise AssertionError(f"the resumed job hung:\n{err[-4000:]}") from None
    assert resumed.returncode == 0, err[-4000:]
    for rank in (0, 1):
        order = _orders(tmp_path / "logs" / f"rank{rank}.jsonl")[1]
        assert _ids(epoch_keys(tmp_path / "run", 1, rank)) == order
    every = _ids(epoch_keys(tmp_path / "run", 1))
    assert len(every) == len(set(every))
