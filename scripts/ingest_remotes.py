"""The pieces of scripts/bench_ingest.py: remotes, baselines and the daemon's fill.

* remotes in their own processes on 127.0.0.1: moto's S3 server, and a static HTTP file server
  (scripts/http_files.py, aiohttp with sendfile); ``file://`` needs none;
* baselines: a bare concurrent fetch of the same objects with the same fsspec client in one
  process (HTTP, S3), and for ``file://`` a raw LMDB write of the same bytes: ``putmulti`` in
  batches of the daemon's commit size, one transaction each, with the cache's sync settings
  (and the same reading each batch's files first, for context);
  and the disk's sustained write rate, for context;
* :func:`daemon_fill`: ``epochcache daemon`` filling an empty cache from the remote: its
  running rate, from the moment a tenth of the objects is cached until all are (start-up,
  listing and first connections are not ingest; the time from the first sampler's start is
  reported too). At that moment the daemon is paused while memory is warmed, so that it
  writes into warm memory as the baselines do (see :func:`warm_memory`).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_moto() -> tuple[subprocess.Popen[bytes], str]:
    """moto's S3 server in its own process; returns it and its endpoint URL."""
    port = _free_port()
    exe = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or "moto_server"
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1) as response:
                response.read()
            return proc, endpoint
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("moto_server did not start")


def start_http(root: Path) -> tuple[subprocess.Popen[bytes], str]:
    """The static file server over ``root`` in its own process; returns it and its base URL."""
    proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "http_files.py"), str(root)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if not line.startswith("PORT "):
        proc.kill()
        raise RuntimeError(f"the HTTP file server did not start ({line!r})")
    return proc, f"http://127.0.0.1:{int(line.split()[1])}"


#: Batches read at once ahead of the raw writer from local files: the daemon's default
#: sampler processes (each reads a batch in one thread).
FETCH_LANES = 2

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: Sequence[int] = (), session: int | None = None) -> float:
    """CPU seconds (user + system) used so far by ``pids`` and by every live process of
    ``session``, read from /proc."""
    total = 0.0
    candidates = [int(e.name) for e in os.scandir("/proc") if e.name.isdigit()] if session \
        else list(pids)
    for pid in candidates:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone
        if pid in pids or (session is not None and int(fields[3]) == session):
            total += (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    return total


def bare_fetch(fs: Any, paths: list[str], concurrency: int,
               server_pid: int | None = None) -> tuple[float, float]:
    """Seconds to fetch every path once: ``asyncio.gather`` over ``fs._cat_file`` with at most
    ``concurrency`` in flight, nothing else done with the bytes (the second of two passes: the
    first warms the connection pool); and the CPU seconds it took, the server's included."""
    from fsspec.asyn import sync

    sync(fs.loop, _fetch_all, fs, paths, concurrency, len)
    server = [server_pid] if server_pid else []
    cpu = time.process_time() + cpu_seconds(server)
    start = time.perf_counter()
    sync(fs.loop, _fetch_all, fs, paths, concurrency, len)
    seconds = time.perf_counter() - start
    return seconds, time.process_time() + cpu_seconds(server) - cpu


def warm_memory(nbytes: int) -> None:
    """Write ``nbytes`` of memory and free it, so that the next run's page cache and heap
    come from memory the hypervisor has backed.

    Virtual machines with free page reporting (this one is a Firecracker VM: "Free page
    reporting enabled" at boot) hand freed guest memory back to the host about two seconds
    after it is freed; the next process to touch it pays a host fault per page. A run that
    started after a pause wrote 5-10x slower than one that started right after a free (a raw
    LMDB write of 2 GB: 11k-19k samples/s after a 6 s pause, 57k-61k right after this), so
    each run of the benchmark starts with the same warm memory.
    """
    import numpy as np

    with open("/proc/meminfo") as meminfo:
        available = next(int(line.split()[1]) * 1024 for line in meminfo
                         if line.startswith("MemAvailable:"))
    block = np.ones(min(nbytes, available // 2), dtype=np.uint8)  # ones: every page written
    del block


def disk_write(workdir: Path, total: int = 1 << 30) -> float:
    """MB/s of a sequential 1 GiB write in 8 MiB chunks, fdatasync'ed, in ``workdir``."""
    path = workdir / "disk-probe"
    chunk = os.urandom(8 << 20)
    os.sync()
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as out:
        out.writelines(chunk for _ in range(total // len(chunk)))
        os.fdatasync(out.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return total / seconds / 1e6


def raw_lmdb_write(payloads: Sequence[Any], batch_size: int, sync: bool, workdir: Path,
                   fetch: Callable[[list[Any]], list[bytes]] | None = None,
                   lanes: int = FETCH_LANES) -> tuple[float, float]:
    """Seconds to write ``payloads`` into a fresh LMDB environment with ``putmulti``, one
    transaction per ``batch_size`` samples, opened as the cache opens its own (sync or not,
    metasync as sync, no readahead, no meminit); and the CPU seconds it took (this process's).

    Given ``fetch``, ``payloads`` are what it takes (paths, URLs) and each batch is fetched
    with it, ``lanes`` batches at a time in threads ahead of the writer: the least any cache
    fed from that remote must do (get the bytes, write them), pipelined as the daemon's
    samplers are, without checks, framing or bookkeeping. A server's CPU is not counted here;
    the caller adds it.
    """
    import lmdb

    path = workdir / "raw-lmdb"
    shutil.rmtree(path, ignore_errors=True)
    batches = [list(payloads[i:i + batch_size]) for i in range(0, len(payloads), batch_size)]
    # The map only reserves address space (no writemap): room for any run of this benchmark.
    env = lmdb.open(str(path), map_size=1 << 38, sync=sync, metasync=sync, readahead=False,
                    meminit=False)
    pool = ThreadPoolExecutor(lanes)  # starts no thread until given a fetch
    try:
        cpu = time.process_time()
        start = time.perf_counter()
        ahead: deque[Future[list[bytes]]] = deque()
        for number, batch in enumerate(batches):
            if fetch is not None:
                while len(ahead) < lanes and number + len(ahead) < len(batches):
                    ahead.append(pool.submit(fetch, batches[number + len(ahead)]))
                batch = ahead.popleft().result()
            items = [(number.to_bytes(8, "big") + i.to_bytes(4, "big"), value)
                     for i, value in enumerate(batch)]
            with env.begin(write=True) as txn:
                txn.cursor().putmulti(items)
        return time.perf_counter() - start, time.process_time() - cpu
    finally:
        pool.shutdown(cancel_futures=True)
        env.close()
        shutil.rmtree(path, ignore_errors=True)


def read_batch(paths: list[Path]) -> list[bytes]:
    """A batch of local files, read one after the other as a sampler reads them."""
    from epochcache.ingest.localfiles import read_file

    return [read_file(str(p)) for p in paths]


async def _fetch_all(fs: Any, paths: list[str], concurrency: int,
                     keep: Callable[[bytes], Any]) -> list[Any]:
    """``keep`` of each object's bytes, fetched with ``_cat_file``, ``concurrency`` at a time."""
    semaphore = asyncio.Semaphore(concurrency)

    async def one(path: str) -> Any:
        async with semaphore:
            return keep(await fs._cat_file(path))

    return list(await asyncio.gather(*(one(p) for p in paths)))


def fetch_batch(fs: Any, concurrency: int, paths: list[str]) -> list[bytes]:
    """A batch of objects through the fsspec client, ``concurrency`` at a time."""
    from fsspec.asyn import sync

    return list(sync(fs.loop, _fetch_all, fs, paths, concurrency, bytes))


def fill_time(count: int, tenth: int, tenth_at: tuple[float, float],
              done_at: tuple[float, float], started_at: tuple[float, float]
              ) -> tuple[float, float, bool]:
    """Seconds and CPU seconds of a fill of ``count`` samples at its running rate: from the
    poll that saw ``tenth`` samples (its time and CPU) to the one that saw all, scaled to
    ``count``. When one poll saw both (the fill ended between two polls: too short to time
    a running rate), the whole fill from ``started_at`` instead, and True."""
    (tenth_time, tenth_cpu), (done_time, done_cpu) = tenth_at, done_at
    if done_time > tenth_time and count > tenth:
        scale = count / (count - tenth)
        return (done_time - tenth_time) * scale, (done_cpu - tenth_cpu) * scale, False
    start_time, start_cpu = started_at
    return max(done_time - start_time, 1e-6), done_cpu - start_cpu, True


def daemon_fill(source: dict[str, Any], count: int, workdir: Path, *, processes: int,
                concurrency: int | str, batch_size: int, sync: bool, capacity: int,
                timeout_s: float = 300, server_pid: int | None = None,
                warm_bytes: int = 0) -> dict[str, Any]:
    """Run ``epochcache daemon`` on an empty cache until ``count`` samples are cached.

    Returns ``seconds`` (all ``count`` samples at the running rate, see the module doc),
    ``cpu_seconds`` (the daemon's and its samplers', and the server's, over the same stretch,
    scaled the same way), ``from_start_seconds`` and the samplers' fetched and error counts.

    With ``warm_bytes``, the daemon and its samplers are stopped (SIGSTOP) once a tenth is
    cached, that much memory is warmed, and they are continued: the running rate is timed
    from there. Without the pause the daemon would write into memory handed back to the host
    while it started up (2-3 s after the warming before each run), and a baseline that starts
    at once does not: a raw LMDB write of 1.5 GB ran 3.5-3.8 GB/s right after warm_memory
    and 1.3-2.0 GB/s 3-6 s after it.
    """
    server = [server_pid] if server_pid else []
    import lmdb
    import yaml

    from epochcache import Cache
    from epochcache.errors import CacheError

    cache_dir = workdir / "cache"
    shutil.rmtree(cache_dir, ignore_errors=True)
    config = {
        "source": source,
        "cache": {"dir": str(cache_dir), "capacity": capacity, "sync": sync},
        "sampler": {"processes": processes, "concurrency": concurrency, "batch_size": batch_size},
    }
    config_path = workdir / "bench.yaml"
    config_path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log = open(workdir / "daemon.log", "wb")  # noqa: SIM115 - closed below
    started_at, started_cpu = time.time(), cpu_seconds(server)
    proc = subprocess.Popen([sys.executable, "-m", "epochcache", "daemon", str(config_path)],
                            stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    watcher = None  # opened once the daemon has created the cache (reopening costs ~0.4 ms)
    try:
        deadline = time.monotonic() + timeout_s
        done_at = tenth_at = None
        first = max(1, count // 10)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"daemon exited {proc.returncode}; see {log.name}")
            try:
                if watcher is None:  # not `watcher or ...`: an empty cache is falsy
                    watcher = Cache(cache_dir, readonly=True)
                cached = len(watcher)
                now = time.time()
                if tenth_at is None and cached >= first:
                    if warm_bytes:
                        os.killpg(proc.pid, signal.SIGSTOP)
                        try:
                            warm_memory(warm_bytes)
                            cached, now = len(watcher), time.time()
                        finally:
                            os.killpg(proc.pid, signal.SIGCONT)
                    tenth_at, tenth = now, cached
                    tenth_cpu = cpu_seconds(server, session=proc.pid)
                if cached >= count:
                    done_at = now
                    done_cpu = cpu_seconds(server, session=proc.pid)
                    break
            except (CacheError, lmdb.Error):
                pass  # not created yet
            time.sleep(0.01)
        if done_at is None or watcher is None:
            raise RuntimeError(f"daemon did not cache {count} samples in {timeout_s}s")
        watcher.close()
        watcher = None
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        with Cache(cache_dir, readonly=True) as cache:
            healths = cache.tables.states("sampler/")
        assert tenth_at is not None
        seconds, cpu, whole = fill_time(count, tenth, (tenth_at, tenth_cpu),
                                        (done_at, done_cpu), (started_at, started_cpu))
        return {
            # the rate once running: the samples after the first tenth over their time, as
            # seconds for all of them (start-up, listing and connecting are not ingest)
            "seconds": seconds,
            "cpu_seconds": cpu,
            "whole_fill": whole,  # the fill ended between two polls: timed from the start
            "from_start_seconds": done_at - min(h["started"] for h in healths.values()),
            "fetched": sum(h["fetched"] for h in healths.values()),
            "errors": sum(h["errors"] for h in healths.values()),
            # requests in flight each sampler allowed at the end (concurrency: auto moves it)
            "concurrency": [int(r.get("concurrency", 0)) for h in healths.values()
                            for r in (h.get("requests") or {}).values()],
        }
    finally:
        if watcher is not None:
            watcher.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        shutil.rmtree(cache_dir, ignore_errors=True)
