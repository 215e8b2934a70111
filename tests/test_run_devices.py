"""Where a rank of ``epochcache run`` computes, and the run's own collectives (issue 20, item 4).

The device and backend are decided from the launcher and the machine by a pure function, tested
here on a CPU-only machine. On a GPU node the run's bookkeeping (metrics averaged over ranks,
the start-up barrier, the checkpoint agreed at ``--resume``) reduced CPU tensors on the NCCL
default group, which has no CPU backend: every rank failed at the end of epoch 0 with "No
backend type associated with device type cpu". That failure is reproduced on CPU with a
stand-in for NCCL -- a backend registered for CUDA devices only, gloo underneath -- around real
ranks; tests marked ``gpu`` (test_gpu.py) run NCCL itself.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from common.procs import run_processes
from conftest import free_port
from test_run import demo_config, read_metrics

from epochcache.errors import NodeLayoutError
from epochcache.placement import Placement
from epochcache.run.process_group import CPU, RunDevice, choose_device, joins_job

# -- the decision ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("local_rank", "local_world_size", "cuda_devices", "nccl", "expected"),
    [
        (0, 1, 0, False, CPU),  # a CPU-only node: gloo, as before
        (3, 4, 0, True, CPU),
        (0, 1, 1, True, RunDevice("cuda", 0, "nccl")),
        (2, 4, 4, True, RunDevice("cuda", 2, "nccl")),  # each rank its own GPU
        (3, 4, 8, True, RunDevice("cuda", 3, "nccl")),
        (3, 4, 1, True, RunDevice("cuda", 0, "nccl")),  # the launcher showed each rank one GPU
        (1, 2, 2, False, RunDevice("cuda", 1, "gloo")),  # torch built without NCCL
    ],
)
def test_each_rank_gets_its_device_and_backend(local_rank: int, local_world_size: int,
                                               cuda_devices: int, nccl: bool,
                                               expected: RunDevice) -> None:
    world = Placement(rank=local_rank, world_size=local_world_size, local_rank=local_rank,
                  local_world_size=local_world_size)
    assert choose_device(world, cuda_devices=cuda_devices, nccl_available=nccl) == expected


def test_a_rank_without_a_gpu_of_its_own_is_refused_with_the_fix() -> None:
    world = Placement(rank=5, world_size=8, local_rank=3, local_world_size=4, node_rank=1)
    with pytest.raises(NodeLayoutError) as info:
        choose_device(world, cuda_devices=2, nccl_available=True, visible="0,1")
    message = str(info.value)
    for words in ("local rank 3 of 4", "node 1", "2 CUDA devices", "CUDA_VISIBLE_DEVICES '0,1'",
                  "--nproc-per-node 2", 'CUDA_VISIBLE_DEVICES=""'):
        assert words in message, message


def test_device_names_are_what_torch_takes() -> None:
    assert torch.device(CPU.name).type == "cpu" and not CPU.is_cuda
    cuda = RunDevice("cuda", 1, "nccl")
    assert cuda.name == "cuda:1" and cuda.is_cuda
    assert torch.device(cuda.name).index == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_this_cpu_only_machine_trains_on_the_cpu_with_gloo() -> None:
    from epochcache.run.process_group import select_device

    assert select_device(Placement(local_rank=1, local_world_size=2, world_size=2, rank=1)) == CPU


def test_a_job_is_joined_when_the_launcher_says_there_is_one() -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "0", "WORLD_SIZE": "1"}
    assert joins_job(Placement(world_size=2), {})  # more than one rank
    assert joins_job(Placement(), env)  # torchrun --nproc-per-node 1
    assert not joins_job(Placement(), {})  # a plain `epochcache run`
    for name in env:
        assert not joins_job(Placement(), {k: v for k, v in env.items() if k != name}), name


def test_batches_are_pinned_for_a_gpu_unless_the_config_says_otherwise(tmp_path: Path) -> None:
    from epochcache.config import parse_config
    from epochcache.run.job import _loader_options
    from epochcache.run.signals import quiet_worker

    def _loader_kwargs(config: Any, device: RunDevice = CPU) -> dict[str, object]:
        options = _loader_options(config, device)  # what the run's DataLoaders are given
        return {**options.dataloader, "worker_init_fn": options.worker_init_fn}

    base = {"source": {"url": "file:///nowhere"}, "cache": {"dir": str(tmp_path), "capacity": "1GiB"},
            "train": {"min_samples": 0}}
    cuda = RunDevice("cuda", 0, "nccl")
    default = parse_config(base)
    assert _loader_kwargs(default)["pin_memory"] is False  # the CPU: a copy for nothing
    assert _loader_kwargs(default, cuda)["pin_memory"] is True
    for written in (False, True):
        config = parse_config({**base, "loader": {"pin_memory": written}})
        assert _loader_kwargs(config, cuda)["pin_memory"] is written
        assert _loader_kwargs(config, CPU)["pin_memory"] is written
    assert _loader_kwargs(default)["worker_init_fn"] is quiet_worker


# -- the run's collectives under a default group without a CPU backend -------------------------


def _cuda_only_backend() -> None:
    """Register "cudaonly": gloo underneath, declared for CUDA devices only, as NCCL is."""
    import torch.distributed as dist

    def make(store: Any, rank: int, size: int, timeout: Any) -> Any:
        return dist.ProcessGroupGloo(store, rank, size, timeout)

    dist.Backend.register_backend("cudaonly", make, devices=["cuda"])


def _join_cuda_only(rank: int, port: int) -> None:
    import torch.distributed as dist

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    _cuda_only_backend()
    dist.init_process_group("cudaonly")
    try:  # the stand-in behaves as NCCL does with CPU tensors
        dist.all_reduce(torch.zeros(1))
    except RuntimeError as exc:
        assert "No backend type associated with device type cpu" in str(exc), exc
    else:
        raise AssertionError("the cudaonly backend reduced a CPU tensor")


def _bookkeeping(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from epochcache.placement import detect_placement
    from epochcache.run import process_group
    from epochcache.run.checkpoint import resume_checkpoint

    _join_cuda_only(rank, port)
    try:
        process_group.init_run_distributed(detect_placement())
        mean = process_group.mean_across_ranks({"loss": float(rank), "samples": 10 * rank,
                                                "name": "mlp"})
        process_group.barrier()
        run_dir = Path(out, f"run{rank}")  # only rank 0's holds a checkpoint
        checkpoint = resume_checkpoint(run_dir, node_rank=0)
        Path(out, f"rank{rank}.ok").write_text(json.dumps([mean, checkpoint]))
    except Exception as exc:
        Path(out, f"rank{rank}.err").write_text(f"{type(exc).__name__}: {exc}")
    finally:
        process_group.close_run_distributed(False)
        dist.destroy_process_group()


def _run_ranks(target: Any, *args: Any, timeout_s: float) -> None:
    run_processes(target, [(rank, *args) for rank in range(2)], timeout_s)


def test_the_runs_bookkeeping_reduces_on_gloo_under_a_cuda_only_default_group(
        tmp_path: Path) -> None:
    from epochcache.run.checkpoint import save_checkpoint

    (tmp_path / "run0").mkdir()
    (tmp_path / "run1").mkdir()
    save_checkpoint(tmp_path / "run0", {"epoch": 4, "metrics": {}, "state": {}})
    _run_ranks(_bookkeeping, free_port(), str(tmp_path), timeout_s=120)
    for rank in range(2):
        err = tmp_path / f"rank{rank}.err"
        assert not err.exists(), err.read_text()
        mean, checkpoint = json.loads((tmp_path / f"rank{rank}.ok").read_text())
        assert mean == {"loss": 0.5, "samples": 5.0, "name": "mlp"}
        assert checkpoint["epoch"] == 4  # rank 1 received rank 0's


SUM_TRAINER = '''\
"""Counts batches; its loss is the rank plus the epoch, so the mean over ranks is known."""
import torch.distributed as dist


def train_epoch(run, epoch, loader):
    samples = sum(len(batch["cls"]) for batch in loader)
    return {"loss": float(dist.get_rank() + epoch), "samples": samples}
'''


def _train(rank: int, port: int, workdir: str, config: dict[str, Any], out: str) -> None:
    import torch.distributed as dist

    from epochcache.config import parse_config
    from epochcache.run import run_training

    os.chdir(workdir)
    sys.path.insert(0, workdir)
    _join_cuda_only(rank, port)
    try:
        first = run_training(parse_config(config))
        config["train"]["epochs"] += 1
        resumed = run_training(parse_config(config), resume=True)
        Path(out, f"rank{rank}.status").write_text(f"{first} {resumed}")
    except Exception as exc:
        Path(out, f"rank{rank}.status").write_text(f"{type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group()


def test_a_run_on_a_cuda_only_default_group_trains_and_resumes(tmp_path: Path) -> None:
    """Two ranks of ``epochcache run`` whose default group cannot reduce CPU tensors (as under
    NCCL): the epochs' metrics are averaged, rank 0 checkpoints, ``--resume`` agrees."""
    (tmp_path / "sum_trainer.py").write_text(SUM_TRAINER)
    config = demo_config(tmp_path, train={"epochs": 1, "min_samples": 300,
                                          "entrypoint": "sum_trainer:train_epoch"})
    _run_ranks(_train, free_port(), str(tmp_path), config, str(tmp_path), timeout_s=240)
    for rank in range(2):
        assert (tmp_path / f"rank{rank}.status").read_text() == "0 0"
    rows = read_metrics(tmp_path / "runs" / "demo")
    assert [(row["epoch"], row["loss"]) for row in rows] == [(0, 0.5), (1, 1.5)], rows


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_torchrun_with_one_rank_joins_a_gloo_job_on_a_cpu_node(tmp_path: Path) -> None:
    """``torchrun --nproc-per-node 1`` is a job too (the path a 1-GPU node takes with NCCL)."""
    import subprocess

    from test_run import RUN_TIMEOUT_S, cli_env, write_yaml

    cfg = write_yaml(tmp_path / "cfg.yaml", demo_config(tmp_path, train={"epochs": 1}))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "1", "-m", "epochcache", "run", str(cfg)]
    proc = subprocess.run(argv, cwd=tmp_path, env=cli_env(), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, check=False)
    logs = proc.stdout + proc.stderr
    assert proc.returncode == 0, logs[-6000:]
    assert "rank 0 of 1 (node 0, local rank 0), backend gloo, device cpu" in logs, logs[-6000:]
    assert [row["epoch"] for row in read_metrics(tmp_path / "runs" / "demo")] == [0]
