"""DDP: 2 simulated nodes x 2 ranks (gloo), caches of different sizes, 3 epochs.

No rank hangs, all four agree on the batch count each epoch, and the two ranks of a node see
disjoint parts of the same snapshot.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from common.procs import platform_start_method
from common.writer import fill
from conftest import free_port

NODES, LOCAL = 2, 2


def _rank_main(local_rank: int, node: int, port: int, dirs: list[str], out: str) -> None:
    platform_start_method()
    rank = node * LOCAL + local_rank
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(NODES * LOCAL),
                       "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(LOCAL),
                       "GROUP_RANK": str(node), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    from epochcache import Cache

    dist.init_process_group("gloo", rank=rank, world_size=NODES * LOCAL)
    try:
        cache = Cache(dirs[node], sync=False)
        result: list[Any] = []
        for epoch, loader in cache.epochs(3, batch_size=8):
            ids = [int(v) for batch in loader for v in batch[:, 0]]
            # A gradient all_reduce on the default group, as DDP would do, in between.
            dist.all_reduce(torch.ones(1))
            result.append((epoch, len(loader), ids, loader.dataset.seqs.tolist()))
        torch.save(result, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _node_main(node: int, port: int, dirs: list[str], out: str) -> None:
    tmp.spawn(_rank_main, args=(node, port, dirs, out), nprocs=LOCAL, join=True)


def test_two_nodes_two_ranks_equal_batches_disjoint_samples(tmp_path: Path) -> None:
    dirs = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    fill(dirs[0], 0, 200)
    fill(dirs[1], 1000, 90)  # the smaller node decides the batch count
    port = free_port()
    ctx = tmp.get_context("spawn")
    nodes = [ctx.Process(target=_node_main, args=(n, port, dirs, str(tmp_path)))
             for n in range(NODES)]
    for p in nodes:
        p.start()
    for p in nodes:
        p.join(150)
    alive = [p for p in nodes if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung"
    assert [p.exitcode for p in nodes] == [0, 0]
    results = {r: torch.load(tmp_path / f"rank{r}.pt") for r in range(NODES * LOCAL)}
    for epoch in range(3):
        batches = {results[r][epoch][1] for r in results}
        assert len(batches) == 1  # every rank agrees
        n_batches = batches.pop()
        assert n_batches == -(-90 // LOCAL // 8)  # 45 samples per rank on the small node
        for node in range(NODES):
            a, b = (results[node * LOCAL + lr][epoch] for lr in range(LOCAL))
            assert a[3] == b[3]  # the same snapshot on both ranks of the node
            assert not set(a[2]) & set(b[2])  # disjoint samples
            assert len(a[2]) == len(b[2]) or abs(len(a[2]) - len(b[2])) <= 8
            base = 0 if node == 0 else 1000
            assert all(base <= i < base + 200 for i in a[2] + b[2])
        # the small node covers its whole snapshot
        small = results[2][epoch][2] + results[3][epoch][2]
        assert sorted(small) == list(range(1000, 1090))
