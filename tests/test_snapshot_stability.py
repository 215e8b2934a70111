"""Invariant 1 across processes: a reader process iterating its snapshots while a writer process
inserts five times the capacity reads every sample of every snapshot, unchanged.

The writer is the only writer and inserts keys ``k0, k1, ...`` in order, so sample ``seq`` must
hold ``content_for(f"k{seq}")``: the reader checks each value against that, independently of the
cache's own metadata. The first epoch is held until the writer has hit back-pressure (the
headroom is full and eviction has stopped at the reader's lease) and is then read again.
"""

from __future__ import annotations

import json
from pathlib import Path

from common.cachecheck import full_check
from common.procs import spawn_script

from epochcache import Cache

CAPACITY = 512 * 1024

WRITER = """
import sys
from epochcache import Cache, CacheFull
from common.cachecheck import content_for

path, target = sys.argv[1], int(sys.argv[2])
cache = Cache(path, sync=False)
n = 0

def put(keys, wait):
    global n
    result = cache.put_many([(k, content_for(k)) for k in keys], wait=wait, timeout_s=60)
    assert result.seqs == list(range(n, n + len(keys))), (result.seqs, n)
    n += len(keys)

# Phase 1: fill to about the capacity (nothing evicted yet).
while cache.counters().bytes < 0.85 * cache.capacity_bytes:
    put([f"k{i}" for i in range(n, n + 4)], True)
print("FILLED", n, flush=True)
assert sys.stdin.readline().strip() == "go"

# Phase 2: five capacities more, while the reader holds snapshots.
start = cache.counters()
start_total = start.bytes + start.evicted_bytes
reported = False
while True:
    c = cache.counters()
    if c.bytes + c.evicted_bytes - start_total >= target:
        break
    keys = [f"k{i}" for i in range(n, n + 8)]
    if not reported:
        try:
            put(keys, False)
        except CacheFull as exc:
            done = exc.result.inserted
            n += done
            print("BLOCKED", n, flush=True)
            reported = True
            put(keys[done:], True)
    else:
        put(keys, True)
c = cache.counters()
print("DONE", n, c.evicted, c.bytes, flush=True)
"""

READER = """
import hashlib, json, os, sys
from epochcache import Cache
from common.cachecheck import content_for, digest

path, stop_path = sys.argv[1], sys.argv[2]
cache = Cache(path)
report = {"epochs": 0, "read": 0, "bad": [], "overlapped": 0, "sizes": [], "first_seq": []}

def read_all(seqs):
    for i in range(0, len(seqs), 32):
        chunk = seqs[i : i + 32]
        for seq, value in zip(chunk, cache.get_many(chunk)):
            report["read"] += 1
            if digest(value) != digest(content_for(f"k{int(seq)}")):
                report["bad"].append(int(seq))

epoch = 0
while True:
    last = os.path.exists(stop_path)  # one more epoch after the writer finished
    snap = cache.snapshot(epoch)
    inserted_before = cache.counters().inserted
    if epoch == 0:
        print("SNAP", len(snap), int(snap.seqs[0]), int(snap.seqs[-1]), flush=True)
    read_all(snap.seqs)
    if epoch == 0:
        # Hold the first snapshot until the writer is blocked by it, then read it again.
        assert sys.stdin.readline().strip() == "blocked"
        read_all(snap.seqs)
    if cache.counters().inserted != inserted_before:
        report["overlapped"] += 1
    report["sizes"].append(len(snap))
    report["first_seq"].append(int(snap.seqs[0]))
    snap.release()
    epoch += 1
    report["epochs"] = epoch
    if last:
        break
print("RESULT", json.dumps(report), flush=True)
"""


def test_reader_process_sees_its_snapshots_unchanged_while_writer_inserts_5x(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "cache")
    Cache(path, CAPACITY, headroom=0.25, sync=False).close()
    stop = tmp_path / "writer-done"
    writer = spawn_script(tmp_path, "writer", WRITER, path, str(5 * CAPACITY))
    reader = None
    try:
        filled = int(writer.wait_line("FILLED", 60).split()[1])
        reader = spawn_script(tmp_path, "reader", READER, path, str(stop))
        _, count, lo, hi = reader.wait_line("SNAP", 60).split()
        assert int(count) == filled and (int(lo), int(hi)) == (0, filled - 1)
        writer.send("go")
        blocked_at = int(writer.wait_line("BLOCKED", 60).split()[1])
        assert blocked_at > filled  # the headroom was used before back-pressure
        # The writer is blocked on the reader's first lease: nothing of it was evicted.
        with Cache(path, readonly=True) as view:
            assert view.counters().evicted == 0
            assert len(view) == blocked_at
        reader.send("blocked")
        done = writer.wait_line("DONE", 120).split()
        writer.wait_ok(30)
        stop.touch()
        report = json.loads(reader.wait_line("RESULT", 120).split(" ", 1)[1])
        reader.wait_ok(30)
    finally:
        writer.close()
        if reader is not None:
            reader.close()

    total_written, evicted = int(done[1]), int(done[2])
    assert report["bad"] == [], f"snapshot samples changed under the reader: {report['bad'][:20]}"
    # Every sample of every snapshot was read (the first one twice).
    assert report["read"] == sum(report["sizes"]) + report["sizes"][0]
    assert report["epochs"] >= 5
    assert report["overlapped"] >= 2, "the writer never wrote while the reader held a snapshot"
    # The cache really turned over: the oldest snapshots' samples were evicted meanwhile.
    assert evicted > 4 * filled
    assert report["first_seq"][-1] > report["first_seq"][0] + 3 * filled
    state = full_check(path)
    assert state.seqs[-1] == total_written - 1
    assert state.bytes <= CAPACITY + CAPACITY // 4
