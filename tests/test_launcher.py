"""Node layout from the launcher's environment (torchrun, Slurm), never guessed."""

from __future__ import annotations

import pytest

from epochcache.config import parse_config
from epochcache.errors import ConfigError, NodeLayoutError
from epochcache.placement import Placement, read_placement, tasks_on_node

MINIMAL = {"source": {"url": "s3://bucket/train/"}, "cache": {"dir": "/tmp/c", "capacity": "1GiB"}}


def test_outside_a_distributed_launch_there_is_one_node() -> None:
    assert read_placement({}) == Placement()
    assert read_placement({"RANK": "0", "WORLD_SIZE": "1"}) == Placement()


def test_torchrun_variables() -> None:
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "GROUP_RANK": "1"}
    assert read_placement(env) == Placement(5, 8, 1, 4, 1, 2, "torchrun")
    assert read_placement({**env, "GROUP_WORLD_SIZE": "3"}).num_nodes == 3
    # torch.distributed's rank and size win over the variables
    assert read_placement(env, rank=6, world_size=8).rank == 6


def test_slurm_variables() -> None:
    env = {"RANK": "4", "WORLD_SIZE": "6", "SLURM_PROCID": "4", "SLURM_NTASKS": "6",
           "SLURM_NODEID": "1", "SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "4,2",
           "SLURM_NNODES": "2"}
    assert read_placement(env) == Placement(4, 6, 0, 2, 1, 2, "slurm")
    assert tasks_on_node("4(x2),2", 2) == 2 and tasks_on_node("4(x2),2", 1) == 4
    assert tasks_on_node("garbage", 0) is None
    no_spec = {k: v for k, v in env.items() if k != "SLURM_TASKS_PER_NODE"}
    assert read_placement({**no_spec, "SLURM_NTASKS_PER_NODE": "2"}).local_world_size == 2


@pytest.mark.parametrize("env", [
    {"RANK": "1", "WORLD_SIZE": "2"},  # a launcher that says nothing about nodes
    {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"},  # torchrun's, incomplete
    # srun started one task per node (torchrun agents, say): its tasks are not these ranks
    {"RANK": "3", "WORLD_SIZE": "4", "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
     "SLURM_NODEID": "1", "SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "1(x2)"},
])
def test_an_unknown_layout_raises_naming_the_variables(env: dict[str, str]) -> None:
    with pytest.raises(NodeLayoutError, match="LOCAL_WORLD_SIZE") as info:
        read_placement(env)
    assert "GROUP_RANK" in str(info.value) and f"rank {env['RANK']} of" in str(info.value)


def test_contradicting_variables_raise() -> None:
    with pytest.raises(NodeLayoutError, match="inconsistent torchrun"):
        read_placement({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "2",
                        "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"})
    with pytest.raises(NodeLayoutError, match="LOCAL_RANK='x' is not an integer"):
        read_placement({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "x"})


def test_samplers_never_guess_their_node() -> None:
    config = parse_config(MINIMAL)
    # A distributed launch that does not say which node this is: every node would sample the
    # same partition.
    with pytest.raises(ConfigError, match="sampler.node_rank") as info:
        config.sampler.node({"RANK": "3", "WORLD_SIZE": "4"})
    assert "GROUP_RANK" in str(info.value)
    with pytest.raises(ConfigError, match="GROUP_WORLD_SIZE"):
        config.sampler.node({"GROUP_RANK": "1"})
    slurm = {"RANK": "3", "WORLD_SIZE": "4", "SLURM_PROCID": "3", "SLURM_NTASKS": "4",
             "SLURM_NODEID": "1", "SLURM_LOCALID": "1", "SLURM_TASKS_PER_NODE": "2(x2)",
             "SLURM_NNODES": "2"}
    assert config.sampler.node(slurm) == (1, 2)
    # A daemon on its own is one node unless told otherwise (config, EPOCHCACHE_*, GROUP_*).
    assert config.sampler.node({"SLURM_NODEID": "1", "SLURM_NNODES": "2"}) == (0, 1)
    assert config.sampler.node({"EPOCHCACHE_NODE_RANK": "1", "EPOCHCACHE_NUM_NODES": "2"}) == (1, 2)


def test_an_srun_task_is_a_rank_without_rank_or_world_size() -> None:
    """srun with one task per rank sets no RANK or WORLD_SIZE: a task of a step of several
    tasks is rank SLURM_PROCID of SLURM_STEP_NUM_TASKS (the batch script, with its
    SLURM_PROCID 0 of the job's SLURM_NTASKS but no step, is not a rank of anything)."""
    task = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4",
            "SLURM_STEP_NUM_TASKS": "4", "SLURM_NODEID": "1", "SLURM_LOCALID": "1",
            "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NNODES": "2", "SLURM_STEP_NUM_NODES": "2"}
    assert read_placement(task) == Placement(3, 4, 1, 2, 1, 2, "slurm")
    batch = {k: v for k, v in task.items() if not k.startswith("SLURM_STEP")}
    assert read_placement({**batch, "SLURM_PROCID": "0"}) == Placement()
    assert read_placement({**task, "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1"}) == Placement()
    # torchrun's workers under srun (one agent task per node) take torchrun's variables
    agent = {**task, "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2",
             "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_LOCALID": "0"}
    worker = {**agent, "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
              "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
    assert read_placement(worker) == Placement(3, 4, 1, 2, 1, 2, "torchrun")
