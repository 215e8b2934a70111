"""Measure concurrent whole-object reads from a moto S3 server: which fetch strategy is faster?

Compares, at the same concurrency, for small and large objects:

* ``cat-batch``: s3fs's own async batch, ``fs.cat(paths, batch_size=concurrency, on_error="return")``;
* ``threads``: a ThreadPoolExecutor of ``fs.cat_file`` (sync calls, each a round trip to the loop);
* ``fetch_many``: ``epochcache.remote.fetch_many`` (async gather + semaphore + per-object timeout).

The moto server runs in its own process (``moto_server``) on 127.0.0.1 and a free port, so the
server does not share this process's GIL. Usage::

    .venv/bin/python scripts/measure_fetch_many.py [--small 2000] [--large 200] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start_moto() -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    exe = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or "moto_server"
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).read()
            return proc, endpoint
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto_server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--small", type=int, default=2000, help="number of 16 KiB objects")
    parser.add_argument("--large", type=int, default=200, help="number of 1 MiB objects")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    import s3fs

    from epochcache.remote import fetch_many, open_fs

    proc, endpoint = _start_moto()
    try:
        options: dict[str, Any] = {
            "key": "k",
            "secret": "s",
            "endpoint_url": endpoint,
            "client_kwargs": {"region_name": "us-west-2"},
        }
        fs, _ = open_fs("s3://bench", options)
        fs.mkdir("bench")
        results = []
        for label, size, count in (
            ("16KiB", 16 * 1024, args.small),
            ("1MiB", 1024 * 1024, args.large),
        ):
            payload = os.urandom(size)
            paths = [f"bench/{label}/obj-{i:06d}" for i in range(count)]
            for start in range(0, count, 256):
                fs.pipe({p: payload for p in paths[start : start + 256]})
            c = args.concurrency

            def cat_batch(paths: list[str] = paths, c: int = c) -> None:
                out = fs.cat(paths, batch_size=c, on_error="return")
                assert all(isinstance(v, bytes) for v in out.values())

            def threads(paths: list[str] = paths, c: int = c, size: int = size) -> None:
                with ThreadPoolExecutor(c) as pool:
                    out = list(pool.map(fs.cat_file, paths))
                assert all(len(v) == size for v in out)

            def ours(paths: list[str] = paths, c: int = c) -> None:
                out = fetch_many(fs, paths, concurrency=c, timeout_s=60)
                assert all(isinstance(v, bytes) for _, v in out)

            methods = [("cat-batch", cat_batch), ("threads", threads), ("fetch_many", ours)]
            for _, fn in methods:
                fn()  # warm connections
            times: dict[str, list[float]] = {name: [] for name, _ in methods}
            cpu: dict[str, list[float]] = {name: [] for name, _ in methods}
            for r in range(args.repeat):
                # Interleave and rotate the methods so that drift in the server's speed (moto is
                # the bottleneck on two cores) does not favour whichever ran first.
                for name, fn in methods[r % 3 :] + methods[: r % 3]:
                    t0, c0 = time.perf_counter(), time.process_time()
                    fn()
                    times[name].append(time.perf_counter() - t0)
                    cpu[name].append(time.process_time() - c0)
            for name, _ in methods:
                median = statistics.median(times[name])
                row = {
                    "size": label,
                    "method": name,
                    "objects": count,
                    "concurrency": c,
                    "objects_per_s": round(count / median, 1),
                    "MB_per_s": round(count * size / median / 1e6, 1),
                    "client_cpu_ms_per_object": round(
                        statistics.median(cpu[name]) / count * 1e3, 3
                    ),
                    "seconds": [round(t, 3) for t in times[name]],
                }
                results.append(row)
                print(
                    f"{label:6} {name:11} {row['objects_per_s']:9.1f} obj/s {row['MB_per_s']:8.1f} MB/s"
                    f" {row['client_cpu_ms_per_object']:7.3f} client CPU ms/object (median)",
                    flush=True,
                )
        s3fs.S3FileSystem.clear_instance_cache()
        print(json.dumps(results))
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
