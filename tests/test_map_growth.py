"""Map adoption while other threads read (issue 11, item 9).

When another process grows the LMDB map past this process's mapping, the next read transaction
here fails with ``MapResizedError`` and the process adopts the new size (``set_mapsize(0)``),
which replaces the memory map: every transaction the process has open is invalidated and every
buffer into the old map dangles. Readers in other threads of the same process must never be in
the middle of a read at that moment. A real reader process (2 threads holding buffers while
they read) runs while this process grows the map 10x; a segfault, an ``lmdb.Error`` or a wrong
byte fails it.

Internals: map adoption is the LMDB environment's (``cache.env``).
"""

from __future__ import annotations

from pathlib import Path

from common.cachecheck import content_for
from common.procs import spawn_script

from epochcache import Cache

SAMPLE = 64 * 1024

READER = """
import faulthandler, hashlib, sys, threading, time
faulthandler.enable()
from common.cachecheck import content_for
from epochcache import Cache
from epochcache.store.records import decode_payload
from epochcache.store.records import seq_key

path, n = sys.argv[1], int(sys.argv[2])
cache = Cache(path, max_map_size="4MiB")  # a small mapping: the writer outgrows it
expected = [hashlib.sha256(content_for(f"k{i}", 65536, compressible=False)).digest()
            for i in range(n)]
seqs = list(range(n))
stop = threading.Event()
errors, reads = [], [0, 0]

def hold_buffers(slot):
    # Read transactions that keep buffers into the map while they work on them.
    while not stop.is_set():
        try:
            with cache.env.read() as txn:
                db = cache.env.dbs[b"samples"]
                views = [txn.get(seq_key(s), db=db) for s in seqs[:8]]
                time.sleep(0.001)
                for s, view in zip(seqs, views):
                    if hashlib.sha256(decode_payload(view)).digest() != expected[s]:
                        errors.append(f"sample {s}: wrong bytes")
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            return
        reads[slot] += 1

def batches(slot):
    while not stop.is_set():
        try:
            values = cache.get_many(seqs)
            for s, v in zip(seqs, values):
                if hashlib.sha256(v).digest() != expected[s]:
                    errors.append(f"sample {s}: wrong bytes")
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            return
        reads[slot] += 1

threads = [threading.Thread(target=hold_buffers, args=(0,)),
           threading.Thread(target=batches, args=(1,))]
for t in threads:
    t.start()
print("READY", flush=True)
sys.stdin.readline()
stop.set()
for t in threads:
    t.join()
print("DONE", cache.env.map_size, reads[0], reads[1], "|".join(errors[:3]) or "ok", flush=True)
"""


def _put(cache: Cache, prefix: str, count: int) -> None:
    cache.put_many([(f"{prefix}{i}", content_for(f"{prefix}{i}", SAMPLE, compressible=False))
                    for i in range(count)])


def test_threads_read_on_while_another_process_grows_the_map(tmp_path: Path) -> None:
    path = str(tmp_path / "cache")
    with Cache(path, "256MiB", max_map_size="4MiB", sync=False) as first:
        _put(first, "k", 16)
    reader = spawn_script(tmp_path, "reader", READER, path, "16")
    try:
        reader.wait_line("READY", 60)
        # The map grows 4 MiB at a time, 12 times: the reader adopts each new size while its
        # other thread reads.
        for step in range(2, 14):
            with Cache(path, max_map_size=f"{4 * step}MiB", sync=False) as writer:
                _put(writer, f"n{step}-", 40)  # 2.5 MiB: past the reader's mapping
            crashed = reader.popen.poll()
            assert crashed is None, f"the reader died ({crashed}) as the map grew:\n{reader.stderr()}"
        reader.send("stop")
        done = reader.wait_line("DONE", 60).split()
        status = reader.wait(30)
    finally:
        try:
            reader.close()
        except BrokenPipeError:
            pass
    assert status == 0, reader.stderr()
    map_size, holding, batches, errors = int(done[1]), int(done[2]), int(done[3]), done[4]
    assert errors == "ok", " ".join(done[4:])
    assert map_size >= 32 * 1024 * 1024  # the reader did adopt the grown map, step by step
    assert holding > 0 and batches > 0
