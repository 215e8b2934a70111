"""DDP failure modes: a rank that fails never leaves the others hanging, and ranks never train
silently on different things.

Every test runs real ranks (spawned processes, gloo, one machine). The collective timeout is
set to 900 s, so a test that ends within a minute shows that nothing waited for it.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from common.procs import as_launched
from common.writer import fill
from conftest import free_port

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=900)


def _join_env(rank: int, world_size: int, port: int, local_world_size: int | None = None,
              node: int | None = None) -> None:
    local = world_size if local_world_size is None else local_world_size
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_RANK": str(rank % local), "LOCAL_WORLD_SIZE": str(local),
                       "GROUP_RANK": str(rank // local if node is None else node),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})


def _start_ranks(target: Any, world_size: int, *args: Any) -> list[Any]:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=as_launched, args=(target, rank, *args))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    return procs


def _wait_all(procs: list[Any], timeout_s: float) -> float:
    """Join every process within ``timeout_s`` (kill the rest); return the seconds taken."""
    started = time.monotonic()
    for p in procs:
        p.join(max(0.1, timeout_s - (time.monotonic() - started)))
    took = time.monotonic() - started
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
        p.join(5)
    assert not alive, f"ranks {[procs.index(p) for p in alive]} still running after {took:.0f} s"
    return took


# -- 1. an exception on one rank ends the job, it does not hang it ----------------------------

def _raise_at_batch_2(rank: int, port: int, path: str, out: str, num_workers: int) -> None:
    _join_env(rank, 2, port)
    from epochcache import Cache

    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=COLLECTIVE_TIMEOUT)
    cache = Cache(path, sync=False)
    try:
        for _epoch, loader in cache.epochs(3, batch_size=4, num_workers=num_workers):
            for i, _batch in enumerate(loader):
                if rank == 0 and i == 2:
                    raise RuntimeError("rank 0 fails in its training step")
                dist.all_reduce(torch.ones(1))  # a gradient all_reduce, as DDP does
    except BaseException as exc:
        Path(out, f"rank{rank}.err").write_text(f"{type(exc).__name__}: {exc}")
        raise


def _check_failure_ends_job(tmp_path: Path, num_workers: int) -> None:
    path = str(tmp_path / "cache")
    fill(path, 0, 400)  # 50 batches per rank and epoch: rank 0 fails early in epoch 0
    procs = _start_ranks(_raise_at_batch_2, 2, free_port(), path, str(tmp_path), num_workers)
    took = _wait_all(procs, 60)
    assert procs[0].exitcode != 0 and procs[1].exitcode != 0, [p.exitcode for p in procs]
    assert "rank 0 fails" in (tmp_path / "rank0.err").read_text()
    assert took < 60


def test_exception_on_one_rank_ends_the_job_in_process(tmp_path: Path) -> None:
    _check_failure_ends_job(tmp_path, num_workers=0)


def test_exception_on_one_rank_ends_the_job_with_workers(tmp_path: Path) -> None:
    _check_failure_ends_job(tmp_path, num_workers=1)


def _raise_with_planner_waiting(rank: int, port: int, path: str, out: str) -> None:
    _join_env(rank, 2, port)
    from epochcache import Cache

    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=COLLECTIVE_TIMEOUT)
    cache = Cache(path, sync=False)
    try:
        for _epoch, loader in cache.epochs(3, batch_size=4, num_workers=0):
            n = len(loader)
            for i, _batch in enumerate(loader):
                if rank == 1:
                    # Rank 1 waits in a collective (gradient accumulation: one sync per epoch,
                    # at its end) that rank 0 never reaches; its own preparer never starts.
                    dist.all_reduce(torch.ones(1))
                elif i == n - 2:
                    # Rank 0 is near its epoch's end: its preparer waits for rank 1's.
                    time.sleep(1.0)
                    raise RuntimeError("rank 0 fails before its gradient sync")
    except BaseException as exc:
        Path(out, f"rank{rank}.err").write_text(f"{type(exc).__name__}: {exc}")
        raise


def test_exception_while_the_next_epoch_is_being_agreed_ends_the_job(tmp_path: Path) -> None:
    path = str(tmp_path / "cache")
    fill(path, 0, 400)
    procs = _start_ranks(_raise_with_planner_waiting, 2, free_port(), path, str(tmp_path))
    took = _wait_all(procs, 60)
    assert procs[0].exitcode != 0 and procs[1].exitcode != 0, [p.exitcode for p in procs]
    assert "rank 0 fails" in (tmp_path / "rank0.err").read_text()
    assert took < 60


# -- 3. the node layout is read from the launcher, never guessed -----------------------------

def _read_epoch(rank: int, port: int, env: dict[str, str], path: str, out: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **env})
    from epochcache import Cache

    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=COLLECTIVE_TIMEOUT)
    try:
        cache = Cache(path, sync=False)
        ids = []
        for _epoch, loader in cache.epochs(1, batch_size=8):
            ids += [int(v) for batch in loader for v in batch[:, 0]]
        Path(out, f"rank{rank}.ids").write_text(" ".join(map(str, ids)))
    except Exception as exc:
        Path(out, f"rank{rank}.err").write_text(f"{type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group()


def _two_ranks(tmp_path: Path, envs: list[dict[str, str]], paths: list[str]) -> list[str]:
    """Run :func:`_read_epoch` on two ranks; each one's ids (as text) or error."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=as_launched,
                         args=(_read_epoch, r, port, envs[r], paths[r], str(tmp_path)))
             for r in range(2)]
    for p in procs:
        p.start()
    _wait_all(procs, 90)
    results = []
    for r in range(2):
        err = tmp_path / f"rank{r}.err"
        results.append(err.read_text() if err.exists() else
                       "ids " + (tmp_path / f"rank{r}.ids").read_text())
    return results


def _nodes_with_own_caches(tmp_path: Path) -> list[str]:
    paths = [str(tmp_path / "node0"), str(tmp_path / "node1")]
    fill(paths[0], 0, 40)
    fill(paths[1], 1000, 40)  # other samples under the same sequence numbers 0..39
    return paths


def test_a_launch_without_node_variables_is_refused_not_guessed(tmp_path: Path) -> None:
    """Two nodes started by a launcher that sets only RANK/WORLD_SIZE: taken for one node,
    rank 1 read its half of rank 0's snapshot out of its own cache -- other samples."""
    paths = _nodes_with_own_caches(tmp_path)
    envs = [{"RANK": str(r), "WORLD_SIZE": "2"} for r in range(2)]
    for result in _two_ranks(tmp_path, envs, paths):
        assert result.startswith("NodeLayoutError"), result
        for name in ("LOCAL_WORLD_SIZE", "GROUP_RANK", "SLURM_NODEID", "torchrun"):
            assert name in result, result


def test_slurm_variables_place_ranks_on_their_nodes(tmp_path: Path) -> None:
    paths = _nodes_with_own_caches(tmp_path)
    envs = [{"RANK": str(r), "WORLD_SIZE": "2", "SLURM_PROCID": str(r), "SLURM_NTASKS": "2",
             "SLURM_NODEID": str(r), "SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "1(x2)",
             "SLURM_NNODES": "2"} for r in range(2)]
    results = _two_ranks(tmp_path, envs, paths)
    ids = [sorted(map(int, result.removeprefix("ids ").split())) for result in results]
    assert ids == [list(range(40)), list(range(1000, 1040))], results  # each node, whole cache


def test_ranks_of_one_node_with_different_caches_are_refused(tmp_path: Path) -> None:
    """Ranks declared on one node (GROUP_RANK 0) that open different caches: rank 1 read the
    leader's snapshot out of another cache."""
    paths = _nodes_with_own_caches(tmp_path)
    envs = [{"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2",
             "GROUP_RANK": "0"} for r in range(2)]
    for result in _two_ranks(tmp_path, envs, paths):
        assert result.startswith("NodeLayoutError"), result
        assert "do not share one cache" in result and paths[0] in result and paths[1] in result


# -- 4. --resume: every rank resumes from rank 0's checkpoint -----------------------------------

def _resume(rank: int, port: int, run_dirs: list[str], out: str) -> None:
    _join_env(rank, 2, port, local_world_size=1)  # two nodes, each with its own run directory
    from epochcache.run.checkpoint import resume_checkpoint

    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=COLLECTIVE_TIMEOUT)
    try:
        checkpoint = resume_checkpoint(Path(run_dirs[rank]), node_rank=rank)
        torch.save(checkpoint, Path(out, f"rank{rank}.resumed"))
    except Exception as exc:
        Path(out, f"rank{rank}.err").write_text(f"{type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group()


def _resume_on_two_nodes(tmp_path: Path, files: list[bytes | None]) -> list[Any]:
    run_dirs = [tmp_path / "node0", tmp_path / "node1"]
    for run_dir, data in zip(run_dirs, files):
        run_dir.mkdir()
        if data is not None:
            (run_dir / "checkpoint.pt").write_bytes(data)
    procs = _start_ranks(_resume, 2, free_port(), [str(d) for d in run_dirs], str(tmp_path))
    _wait_all(procs, 60)
    results = []
    for rank in range(2):
        err = tmp_path / f"rank{rank}.err"
        results.append(err.read_text() if err.exists() else
                       torch.load(tmp_path / f"rank{rank}.resumed", weights_only=True))
    return results


def _checkpoint(epoch: int, value: float) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save({"epoch": epoch, "metrics": {}, "state": {"model": {"w": torch.full((3,), value)}}},
               buf)
    return buf.getvalue()


def test_resume_takes_rank_0s_checkpoint_on_every_rank(tmp_path: Path) -> None:
    """Node 1's run directory holds an older checkpoint: it resumed from that one (another epoch,
    other weights) while node 0 resumed from its own."""
    results = _resume_on_two_nodes(tmp_path, [_checkpoint(5, 1.0), _checkpoint(2, 9.0)])
    for result in results:
        assert isinstance(result, dict), result
        assert result["epoch"] == 5 and result["state"]["model"]["w"].tolist() == [1.0] * 3


def test_resume_starts_fresh_everywhere_when_rank_0_has_no_checkpoint(tmp_path: Path) -> None:
    assert _resume_on_two_nodes(tmp_path, [None, _checkpoint(2, 9.0)]) == [None, None]


def test_an_unreadable_checkpoint_on_rank_0_fails_every_rank(tmp_path: Path) -> None:
    results = _resume_on_two_nodes(tmp_path, [b"not a checkpoint", _checkpoint(2, 9.0)])
    for result in results:
        assert isinstance(result, str) and result.startswith("CheckpointError"), result
        assert str(tmp_path / "node0" / "checkpoint.pt") in result
