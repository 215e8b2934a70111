"""DDP failure paths: a rank that raises, or stops early, never leaves the job hanging.

Two real gloo ranks on one node (one process each, started with ``spawn``) with the collective
timeout set to 900 s: a job that only ends through that timeout fails these tests.
"""

from __future__ import annotations

import datetime
import os
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from common.writer import fill
from conftest import free_port

RANKS = 2
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=900)


def _join(env: dict[str, str], rank: int, port: int) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(RANKS), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(RANKS), "GROUP_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **env})
    dist.init_process_group("gloo", rank=rank, world_size=RANKS, timeout=COLLECTIVE_TIMEOUT)


def _raising_rank(rank: int, port: int, path: str, out: str, mode: str) -> None:
    _join({}, rank, port)
    import faulthandler, sys
    faulthandler.dump_traceback_later(45, file=sys.stderr)
    from epochcache import Cache

    try:
        cache = Cache(path, sync=False)
        gen = cache.epochs(3, batch_size=8)
        if mode != "close":
            gen = None  # as in a plain `for epoch, loader in cache.epochs(...)` loop
        for _epoch, loader in (cache.epochs(3, batch_size=8) if gen is None else gen):
            for i, _batch in enumerate(loader):
                if rank == 0 and i == 2:
                    if gen is not None:
                        gen.close()  # stops early, before the epoch's end
                        raise RuntimeError("rank 0 closed its epochs() early")
                    raise RuntimeError("boom on rank 0")
                if mode == "slow":
                    time.sleep(0.05)  # the next epoch's planners are not triggered yet
                dist.all_reduce(torch.ones(1))  # DDP's gradient all_reduce
    except BaseException as exc:
        print(f"rank {rank} raised at {time.time():.3f}", file=sys.stderr, flush=True)
        with open(f"{out}/rank{rank}.err", "w") as f:
            f.write(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()
        print(f"rank {rank} destroyed at {time.time():.3f}", file=sys.stderr, flush=True)


@pytest.mark.parametrize("mode", ["raise", "slow", "close"])
def test_an_exception_on_one_rank_ends_the_job_quickly(tmp_path: Path, mode: str) -> None:
    path = str(tmp_path / "c")
    fill(path, 0, 400)  # 200 samples per rank: 25 batches of 8
    port = free_port()
    ctx = tmp.get_context("spawn")
    procs = [ctx.Process(target=_raising_rank, args=(r, port, path, str(tmp_path), mode))
             for r in range(RANKS)]
    started = time.monotonic()
    for p in procs:
        p.start()
    deadline = started + 60
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)
    assert not hung, f"ranks {hung} still running 60 s after the start (waiting for a collective)"
    assert all(p.exitcode != 0 for p in procs)
    rank0 = (tmp_path / "rank0.err").read_text()
    assert ("boom on rank 0" if mode != "close" else "closed its epochs() early") in rank0, rank0
    # Rank 1 learns of it from its own collective, which fails once rank 0 is gone.
    assert (tmp_path / "rank1.err").exists()
    # Rank 0 held the node's lease: it was released on the way out, locally.
    from epochcache import Cache

    assert Cache(path).leases() == []
