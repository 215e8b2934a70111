"""epochs(resume=...) on another layout (issue 28, item 1), with real ranks (gloo) and nodes
simulated as the DDP tests do (a cache directory per node).

A job checkpoints every rank's state mid-epoch and stops; it comes back with another number of
ranks per node, or of nodes, each rank given every rank's state. Then, per node that came back,
what its ranks read before the checkpoint and after the resume is exactly the node's epoch, each
sample once; every rank reads the same number of batches; a new node starts its epoch on its
own cache; the rest left on a node that did not come back is counted in the report.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from common.procs import run_processes
from common.writer import fill
from conftest import free_port

BATCH, SAVED_AT, STOP_AT = 10, 3, 5


def _ids(cache: Any, seqs: Any) -> list[int]:
    return [int(cache.info(int(s)).key.split("/")[-1].split(".")[0]) for s in seqs]


def _rank(rank: int, nodes: int, local: int, port: int, dirs: list[str], out: str,
          phase: int) -> None:
    node, local_rank = divmod(rank, local)
    world = nodes * local
    if world > 1:
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world),
                           "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local),
                           "GROUP_RANK": str(node), "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(port)})
    import torch.distributed as dist

    from epochcache import Cache

    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    if rank == 0:  # what the resume says (global rank 0 says it once)
        handler = logging.FileHandler(f"{out}/phase{phase}.log")
        logging.getLogger("epochcache").addHandler(handler)
        logging.getLogger("epochcache").setLevel(logging.INFO)
    try:
        cache = Cache(dirs[node], sync=False)
        resume = torch.load(f"{out}/states.pt") if phase else None
        result: dict[str, Any] = {"node": node, "read": []}
        epochs = cache.epochs(1, batch_size=BATCH, seed=5, resume=resume)
        for _epoch, loader in epochs:
            loader.release_as_consumed = False  # released as checkpoints cover them (a run)
            result["lane"] = _ids(cache, loader.seqs)
            result["batches"] = len(loader)
            result["report"] = loader.resume_report
            for i, batch in enumerate(loader):
                result["read"].append([int(v) for v in batch[:, 0]])
                if not phase and i + 1 == SAVED_AT:
                    result["state"] = loader.state_dict()
                    loader.release(SAVED_AT)
                if not phase and i + 1 == STOP_AT:
                    break  # an orderly stop after the checkpoint: the lease is left for it
            break
        epochs.close()  # type: ignore[attr-defined]
        torch.save(result, f"{out}/phase{phase}-rank{rank}.pt")
    finally:
        if world > 1:
            dist.destroy_process_group()


def _phase(tmp_path: Path, dirs: list[str], phase: int, nodes: int,
           local: int) -> list[dict[str, Any]]:
    port = free_port()
    run_processes(_rank, [(r, nodes, local, port, dirs, str(tmp_path), phase)
                          for r in range(nodes * local)], timeout_s=150)
    return [torch.load(tmp_path / f"phase{phase}-rank{r}.pt") for r in range(nodes * local)]


@pytest.mark.parametrize(("before", "after"), [
    pytest.param((1, 2), (1, 1), marks=pytest.mark.slow),  # two ranks to one (test_run_elastic)
    ((1, 1), (1, 2)),  # one rank to two
    ((2, 1), (1, 1)),  # two nodes to one: node 1's disk is gone
    pytest.param((1, 2), (2, 2), marks=pytest.mark.slow),  # a new node joins
    pytest.param((1, 2), (1, 3), marks=pytest.mark.slow),  # an uneven deal
])
def test_the_rest_of_each_node_is_read_once_on_another_layout(
        tmp_path: Path, before: tuple[int, int], after: tuple[int, int]) -> None:
    dirs = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    fill(dirs[0], 0, 200)
    fill(dirs[1], 1000, 200)
    first = _phase(tmp_path, dirs, 0, *before)
    torch.save({str(r): one["state"] for r, one in enumerate(first)}, tmp_path / "states.pt")
    second = _phase(tmp_path, dirs, 1, *after)

    # Every rank of the resumed job reads the same number of batches, none empty.
    assert len({one["batches"] for one in second}) == 1
    assert all(len(one["read"]) == one["batches"] and all(one["read"]) for one in second)
    report = second[0]["report"]
    assert all(one["report"] == report for one in second)  # the same on every rank
    for node in range(after[0]):
        was = [one for one in first if one["node"] == node]
        now = [one for one in second if one["node"] == node]
        ids = [i for one in now for batch in one["read"] for i in batch]
        if not was:  # a new node: its own epoch on its own cache
            assert len(ids) == len(set(ids)) and all(1000 <= i < 1200 for i in ids)
            continue
        epoch = sorted(i for one in was for i in one["lane"])  # the node's whole epoch
        kept = [i for one in was for batch in one["read"][:SAVED_AT] for i in batch]
        assert sorted(kept + ids) == epoch  # each sample once: none twice, none skipped
    departed = [one for one in first if one["node"] >= after[0]]
    assert report["resume_departed_nodes"] == len({one["node"] for one in departed})
    assert report["resume_departed"] == sum(len(one["lane"]) - SAVED_AT * BATCH
                                            for one in departed)
    said = (tmp_path / "phase1.log").read_text()
    from epochcache.units import format_count

    assert (f"{format_count(report['resume_continued'], 'sample')} of the interrupted epoch "
            "continue") in said  # continue(s)
    if departed:
        assert (f"{report['resume_departed']} samples of the interrupted epoch were left on "
                f"{format_count(report['resume_departed_nodes'], 'node')} that did not come "
                "back") in said
    assert report["resume_fresh_ranks"] == max(0, after[0] - before[0]) * after[1]
    assert report["resume_evicted"] == report["resume_left_out"] == 0
    from epochcache import Cache

    for node in range(after[0]):  # each epoch read to its end: its lease released
        cache = Cache(dirs[node], sync=False)
        assert cache.leases() == [], node
        cache.close()
