"""cache.stream() under torch.distributed (gloo): plain DDP and accelerate's prepare.

Plain DDP: 2 ranks on one node (and, marked slow, 2 simulated nodes x 2 ranks with caches of
different sizes); every rank yields the same number of samples per epoch (the MIN collective),
and the ranks of a node yield disjoint parts of one snapshot. accelerate: 2 processes on one node, ``split_ranks=False`` (accelerate
splits the batches itself), in its default dispatch mode and with ``dispatch_batches=False``.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from common.procs import run_processes
from common.writer import fill
from conftest import free_port


def _env(rank: int, world: int, local_rank: int, local_world: int, node: int,
         port: int) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_world),
                       "GROUP_RANK": str(node), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})


def _run(target: Any, args_of: list[tuple[Any, ...]], timeout_s: float = 150) -> None:
    run_processes(target, args_of, timeout_s)


# -- plain DDP ------------------------------------------------------------------------------

def _ddp_rank(rank: int, nodes: int, local: int, port: int, dirs: list[str], out: str) -> None:
    node, local_rank = divmod(rank, local)
    _env(rank, nodes * local, local_rank, local, node, port)
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from epochcache import Cache

    dist.init_process_group("gloo", rank=rank, world_size=nodes * local)
    try:
        cache = Cache(dirs[node], sync=False)
        stream = cache.stream(seed=4)
        result: dict[str, Any] = {"epochs": []}
        for epoch in range(3):
            if epoch == 2:  # prepared in the main process, read by two workers per rank
                stream.set_epoch(2)
                loader = DataLoader(stream, batch_size=8, num_workers=2)
            else:  # no set_epoch, no workers: iter() prepares it in the main process
                loader = DataLoader(stream, batch_size=8)
            ids = [int(v) for batch in loader for v in batch[:, 0]]
            dist.all_reduce(torch.ones(1))  # a gradient all_reduce in between, as DDP does
            lease = [x for x in cache.leases() if x.label.endswith(f"epoch {epoch}")]
            result["epochs"].append((stream.epoch, ids, [(x.lo, x.hi, x.count) for x in lease]))
            if nodes == 2 and node == 0 and local_rank == 0:
                fill(dirs[0], 5000 + 10 * epoch, 10)  # the big node grows between epochs
            dist.barrier()
        batches = iter(DataLoader(stream, batch_size=8, num_workers=2))
        try:  # workers alone cannot agree on an epoch across ranks: a clear error
            list(batches)
        except RuntimeError as exc:
            result["error"] = str(exc)
        del batches  # shuts the other worker down before this process exits
        gc.collect()
        stream.close()
        dist.barrier()  # every rank closed: the leader released the last epoch's lease
        result["leases"] = len(cache.leases())
        torch.save(result, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("nodes", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_ddp_ranks_yield_equal_counts_and_disjoint_parts_of_one_snapshot(
        tmp_path: Path, nodes: int) -> None:
    local = 2
    dirs = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    fill(dirs[0], 0, 200)
    fill(dirs[1], 1000, 91)  # the smaller node decides the count: 45 per rank (91 // 2)
    if nodes == 1:
        dirs.reverse()  # one node, 91 samples: its two ranks split them 46 + 45, and yield 45
    port = free_port()
    _run(_ddp_rank, [(r, nodes, local, port, dirs, str(tmp_path)) for r in range(nodes * local)])
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(nodes * local)]
    small = nodes - 1  # the node whose cache holds 91 samples
    for epoch in range(3):
        per_rank = [r["epochs"][epoch] for r in results]
        assert {p[0] for p in per_rank} == {epoch}
        assert {len(p[1]) for p in per_rank} == {45}  # equal on every rank (MIN)
        for node in range(nodes):
            a, b = per_rank[node * local], per_rank[node * local + 1]
            assert not set(a[1]) & set(b[1]) and len(set(a[1])) == 45  # disjoint, once
            assert len(a[2]) == 1  # one lease, held by the node's leader while it read
        ids = per_rank[small * local][1] + per_rank[small * local + 1][1]
        assert len(set(ids) & set(range(1000, 1091))) == 90  # all but the odd one out
    if nodes == 2:  # the big node grew between epochs, and later epochs saw it
        big = [set(results[0]["epochs"][e][1] + results[1]["epochs"][e][1]) for e in range(3)]
        assert any(i >= 5000 for i in big[1] | big[2])
    for r in results:
        assert "set_epoch" in r["error"]
        assert r["leases"] == 0


def _dropped_iterator_rank(rank: int, port: int, path: str, out: str) -> None:
    _env(rank, 2, rank, 2, 0, port)
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from epochcache import Cache

    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        cache = Cache(path, sync=False)
        stream = cache.stream(seed=2)
        epochs = []
        for epoch in range(2):
            stream.set_epoch(epoch)  # a DataModule's hook does this every epoch
            loader = DataLoader(stream, batch_size=8, num_workers=2)
            first = iter(loader)  # Lightning 2.6 creates an iterator and drops it ...
            next(first)  # ... after its workers started reading
            del first
            gc.collect()
            epochs.append([int(v) for batch in loader for v in batch[:, 0]])  # ... then iterates
            dist.barrier()
        stream.close()
        torch.save(epochs, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_a_dropped_iterator_does_not_use_up_the_epoch_the_ranks_agreed_on(
        tmp_path: Path) -> None:
    """Lightning's DDP with workers died at epoch 1: "the ranks must agree on each epoch ..."
    although set_epoch was called, because an iterator created and dropped had claimed the
    prepared epoch (issue 26, item 5)."""
    path = str(tmp_path / "c")
    fill(path, 0, 96)
    port = free_port()
    _run(_dropped_iterator_rank, [(r, port, path, str(tmp_path)) for r in range(2)])
    a, b = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    for epoch in range(2):
        assert len(a[epoch]) == len(b[epoch]) == 48  # equal counts, the whole epoch
        assert sorted(a[epoch] + b[epoch]) == list(range(96))  # disjoint, each sample once


# -- accelerate ------------------------------------------------------------------------------

def _accelerate_rank(rank: int, port: int, path: str, out: str, dispatch: bool | None,
                     workers: int) -> None:
    _env(rank, 2, rank, 2, 0, port)
    from accelerate import Accelerator, DataLoaderConfiguration
    from torch.utils.data import DataLoader

    from epochcache import Cache

    config = DataLoaderConfiguration(dispatch_batches=dispatch)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    cache = Cache(path, sync=False)
    stream = cache.stream(seed=1, split_ranks=False)  # accelerate splits the batches
    loader = accelerator.prepare(DataLoader(stream, batch_size=4, num_workers=workers))
    result = []
    for epoch in range(2):
        ids = [int(v) for batch in loader for v in batch[:, 0]]  # prepare() calls set_epoch
        result.append((stream.epoch, ids))
        accelerator.wait_for_everyone()
        if rank == 0:
            fill(path, 1000 + 16 * epoch, 16)  # the cache grows between epochs
        accelerator.wait_for_everyone()
    torch.save(result, f"{out}/rank{rank}.pt")
    stream.close()
    accelerator.end_training()


@pytest.mark.parametrize("dispatch,workers", [
    (None, 0), (False, 0), pytest.param(False, 2, marks=pytest.mark.slow)])
def test_accelerate_prepare_gives_two_processes_disjoint_equal_shards(
        tmp_path: Path, dispatch: bool | None, workers: int) -> None:
    path = str(tmp_path / "c")
    fill(path, 0, 64)  # a multiple of batch_size x processes: accelerate pads nothing
    port = free_port()
    _run(_accelerate_rank, [(r, port, path, str(tmp_path), dispatch, workers) for r in range(2)])
    a, b = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    expected = [list(range(64)), list(range(64)) + list(range(1000, 1016))]
    for epoch in range(2):
        ids_a, ids_b = a[epoch][1], b[epoch][1]
        assert len(ids_a) == len(ids_b) == len(expected[epoch]) // 2  # equal-sized shards
        assert not set(ids_a) & set(ids_b)  # disjoint
        assert sorted(ids_a + ids_b) == expected[epoch]  # the whole snapshot, grown
