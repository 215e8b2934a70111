"""``epochcache verify``: a chunked scan that never pins a live cache's map, and repairs that say
what they did and exit 0 once the cache is consistent."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import lmdb
from common.cachecheck import assert_consistent, content_for, full_check

from epochcache import Cache
from epochcache.store.records import pack_u64, seq_key, unpack_u64


def _verify(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "epochcache", "verify", str(path), *args],
                          capture_output=True, text=True, timeout=120)


def _fill(path: Path, count: int, size: int = 100, capacity: str = "64MiB") -> None:
    with Cache(path, capacity, sync=False) as cache:
        for start in range(0, count, 1000):
            cache.put_many([(f"s{i:07d}", content_for(f"s{i}", size, compressible=False))
                            for i in range(start, min(count, start + 1000))], wait=False)


@contextlib.contextmanager
def _raw(path: Path) -> Iterator[lmdb.Environment]:
    """The cache's LMDB environment opened directly, to damage it as a bug or a bad disk would."""
    env = lmdb.open(str(path), max_dbs=16)
    try:
        yield env
    finally:
        env.close()


def _readers_of(env: lmdb.Environment, pid: int) -> set[int]:
    """The snapshot (txn ids) of the read transactions ``pid`` has open right now."""
    found = set()
    for line in env.readers().splitlines()[1:]:
        parts = line.split()
        if len(parts) == 3 and parts[0] == str(pid) and parts[2] != "-":
            found.add(int(parts[2]))
    return found


def test_verify_reads_in_short_transactions_while_a_writer_turns_the_cache_over(
    tmp_path: Path,
) -> None:
    """One read transaction over the whole cache pins every page freed while it lasts (a live
    daemon fills the map): verify must move to new snapshots as it goes, and its counter check
    must stay exact while samples are inserted and evicted."""
    path = tmp_path / "cache"
    _fill(path, 30_000, capacity="4MiB")
    cache = Cache(path, sync=False)
    stop = threading.Event()
    written = [0]

    def write() -> None:
        b = 0
        while not stop.is_set():
            cache.put_many([(f"w{b}-{i}", content_for(f"w{b}-{i}", 100, compressible=False))
                            for i in range(200)], wait=False)
            written[0] += 200
            b += 1
            time.sleep(0.002)

    writer = threading.Thread(target=write)
    writer.start()
    proc = subprocess.Popen([sys.executable, "-m", "epochcache", "verify", "--json", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    snapshots: set[int] = set()
    try:
        while proc.poll() is None:
            snapshots |= _readers_of(cache.env.lmdb_env, proc.pid)
            time.sleep(0.002)
        out, err = proc.communicate(timeout=60)
    finally:
        stop.set()
        writer.join()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out + err
    report = json.loads(out)
    assert report["ok"] and report["checked"] >= 30_000 * 0.5, report
    assert written[0] > 2_000 and cache.counters().evicted > 0  # the cache turned over meanwhile
    assert len(snapshots) >= 3, f"verify read {report['checked']} samples from snapshots {snapshots}"
    assert report["transactions"] >= report["checked"] // 1024
    assert_consistent(cache)
    cache.close()


def _damage_counters(env: lmdb.Environment) -> int:
    with env.begin(write=True) as txn:
        meta = env.open_db(b"meta", txn=txn)
        stored = unpack_u64(txn.get(b"bytes", db=meta))
        txn.put(b"bytes", pack_u64(stored + 12345), db=meta)
    return stored


def test_repair_of_the_counters_alone_reports_it_and_exits_0(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    _fill(path, 300)
    with _raw(path) as env:
        actual = _damage_counters(env)
    found = _verify(path)
    assert found.returncode == 1, found.stdout + found.stderr
    assert f"counter bytes: stored {actual + 12345}, records say {actual}" in found.stdout
    assert "--repair" in found.stdout
    repaired = _verify(path, "--repair")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert "repaired: 1 counters rewritten" in repaired.stdout, repaired.stdout
    assert "consistent after the repair" in repaired.stdout
    again = _verify(path)
    assert again.returncode == 0 and again.stdout.rstrip().endswith("clean"), again.stdout
    state = full_check(str(path))
    assert state.bytes == actual and len(state.seqs) == 300


def test_repair_of_the_key_index_fixes_missing_entries_and_orphans(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    _fill(path, 300)
    with _raw(path) as env, env.begin(write=True) as txn:
        keys = env.open_db(b"keys", txn=txn)
        txn.delete(b"s0000007", db=keys)  # a sample the index lost
        txn.put(b"no-such-sample", seq_key(10**9), db=keys)  # an entry of no sample
    found = _verify(path, "--json")
    assert found.returncode == 1
    problems = json.loads(found.stdout)["index_problems"]
    assert any("'s0000007'" in p and "missing" in p for p in problems), problems
    repaired = _verify(path, "--repair", "--json")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    report = json.loads(repaired.stdout)
    assert report["ok"] and report["repairs"]["index_entries_fixed"] == 1, report
    assert report["repairs"]["index_orphans_removed"] == 1 and report["repaired"] == 2
    assert _verify(path).returncode == 0
    with Cache(path) as cache:
        assert cache.seq_of("s0000007") is not None and cache.seq_of("no-such-sample") is None
        assert len(assert_consistent(cache).seqs) == 300


def test_repair_removes_a_corrupt_sample_and_keeps_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    _fill(path, 300)
    with _raw(path) as env, env.begin(write=True) as txn:
        samples = env.open_db(b"samples", txn=txn)
        record = bytearray(txn.get(seq_key(42), db=samples))
        record[-1] ^= 0xFF  # a flipped bit on disk
        txn.put(seq_key(42), bytes(record), db=samples)
    found = _verify(path)
    assert found.returncode == 1 and re.search(r"corrupt sample 42 \('s0000042'\)", found.stdout)
    repaired = _verify(path, "--repair")
    assert repaired.returncode == 0, repaired.stdout
    assert "1 corrupt removed" in repaired.stdout and "counters rewritten" not in repaired.stdout
    assert _verify(path).returncode == 0
    with Cache(path) as cache:
        assert len(cache) == 299 and cache.seq_of("s0000042") is None
        assert cache.counters().evicted == 1  # counted as removed: inserted - evicted == samples
        assert cache.get(cache.seq_of("s0000043")) == content_for("s43", 100, compressible=False)


def test_verify_of_a_clean_cache_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "cache"
    _fill(path, 3000)
    before = os.stat(path / "data.mdb").st_mtime_ns
    done = _verify(path, "--repair")
    assert done.returncode == 0 and done.stdout.rstrip().endswith("clean"), done.stdout
    assert "repaired" not in done.stdout
    assert os.stat(path / "data.mdb").st_mtime_ns == before
