"""``epochcache run`` under a real Slurm (issue 33, item 1): the batch scripts of
docs/howto/multi-node.md, submitted as written to a one-node Slurm (tests/common/slurm.py),
preempted each way Slurm stops a job, then resumed; the interrupted epoch is trained exactly
once in all (none twice, none skipped), from the checkpoint written on SIGTERM (the run's
``checkpoint_every_s`` is an hour: no periodic checkpoint explains an exact resume).

The ways, and what each sends (tests/common/slurm.py has KillWait 5 s):

* ``scontrol requeue`` (a preemption that requeues): SIGTERM to every process of the job, the
  ranks twice under torchrun (Slurm's and torchrun's), SIGKILL after KillWait; the same job
  runs again, and ``train.resume: auto`` resumes it;
* ``scancel --signal=TERM`` (what ``#SBATCH --signal=TERM@N`` does before the time limit):
  SIGTERM to the job's steps; the run stops, exit 143;
* ``scancel`` (a cancel; the time limit itself and preemption alike): as a requeue, no rerun;
* the time limit with ``--signal=TERM@N``;
* ``scancel --signal=TERM --full`` of a batch script that is torchrun (``exec``): the batch
  script's process group only, that is torchrun, which passes it on.

The ranks' repeated SIGTERM used to end them before their stop's checkpoint (the resume then
trained the epoch's first batches twice): test_the_torchrun_script_cancelled_resumes_exactly
failed so on the code before the fix, as tests/test_stop_signals.py does without Slurm.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from common.jobs import wait_for
from common.preempt import COMMON, check_exactly_once, holding, metrics_epochs, write_config
from common.slurm import SlurmCluster
from test_docs import REPO, files

# One worker runs them all (scripts/test: --dist loadgroup): one cluster, one job at a time.
pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm"), pytest.mark.timeout(420)]

PAGE = REPO / "docs" / "howto" / "multi-node.md"
TORCHRUN = "train-torchrun.sbatch"
SRUN = "train-srun.sbatch"
JOB_S = 300.0  # a job's start to its end, generous: torch starts slowly on a busy machine
#: The plain batch script of the issue: torchrun as the batch script itself (exec), so that a
#: signal to the script's process group (``--full``, ``--signal=B:...``) reaches torchrun.
EXEC_TORCHRUN = """\
#!/bin/bash
exec torchrun --standalone --nproc-per-node 2 -m epochcache run "$@"
"""


def _env() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(COMMON), str(REPO),
                                                        os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1", "COLUMNS": "300", "NPROC_PER_NODE": "2"}


def _script(tmp: Path, name: str) -> Path:
    text = EXEC_TORCHRUN if name == "exec" else files(PAGE)[name]
    path = tmp / (name if name != "exec" else "exec-torchrun.sbatch")
    path.write_text(text)
    path.chmod(0o755)
    return path


def _submit(slurm: SlurmCluster, tmp: Path, script: Path, *args: str, options: tuple[str, ...] = (),
            ) -> str:
    done = slurm.command("sbatch", "--parsable", f"--chdir={tmp}", f"--output={tmp}/job-%j.out",
                         *options, str(script), *args, env=_env())
    return done.stdout.strip().split(";")[0]


def _output(tmp: Path, job: str) -> str:
    path = tmp / f"job-{job}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def _wait_holding(slurm: SlurmCluster, tmp: Path, job: str, ranks: int) -> None:
    """Until every rank holds mid-epoch (the trainer waits there for the stop)."""
    ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")

    def ready() -> bool:
        if holding(tmp / "logs", ranks):
            return True
        if slurm.job(job).get("JobState") in ended:
            raise AssertionError(f"job {job} ended before its stop point:\n"
                                 f"{_output(tmp, job)[-6000:]}")
        return False

    wait_for(ready, JOB_S, f"job {job}: every rank at its stop point", poll_s=0.2)


def _resume_and_check(slurm: SlurmCluster, tmp: Path, script: Path, config: Path, job: str,
                      ranks: int, options: tuple[str, ...]) -> str:
    """The stopped job's checkpoint, a second job with ``--resume``, and the exact check."""
    checkpoint = torch.load(tmp / "run" / "checkpoint.pt", weights_only=True)
    second = _submit(slurm, tmp, script, str(config), "--resume", options=options)
    info = slurm.wait_job(second, JOB_S)
    out = _output(tmp, second)
    assert info["JobState"] == "COMPLETED", f"{info}\n{out[-6000:]}"
    report = check_exactly_once(tmp, ranks, checkpoint)
    assert report.problems == [], (report.problems, _output(tmp, job)[-6000:])
    assert report.checkpoint_batches == 3
    assert metrics_epochs(tmp / "run") == [0, 1, 2]
    return _output(tmp, job)


def _stopped(out: str) -> None:
    """The first job's output: the stop's checkpoint written, and the run's stop."""
    assert "writing the checkpoint of epoch 1 after 3 batches" in out, out[-6000:]
    assert "after 3 batches written in" in out, out[-6000:]
    assert "terminated (SIGTERM): stopping" in out, out[-6000:]


# -- default: the page's torchrun script, requeued (the suite's time allows one job) ----------


def test_the_torchrun_script_requeued_resumes_by_itself_exactly(slurm: SlurmCluster,
                                                               tmp_path: Path) -> None:
    """The page's torchrun script, ``scontrol requeue``d mid-epoch: each rank gets SIGTERM from
    Slurm and from torchrun, checkpoints, stops; the job runs again under its id
    (``SLURM_RESTART_COUNT`` 1) and ``train.resume: auto`` continues the epoch exactly."""
    config = write_config(tmp_path, resume="auto")
    script = _script(tmp_path, TORCHRUN)
    job = _submit(slurm, tmp_path, script, str(config), options=("--cpus-per-task=2",))
    _wait_holding(slurm, tmp_path, job, 2)
    slurm.command("scontrol", "requeue", job)
    wait_for(lambda: slurm.job(job).get("Restarts") == "1", 60,
             f"job {job} requeued")
    info = slurm.wait_job(job, JOB_S)
    out = _output(tmp_path, job)
    assert info["JobState"] == "COMPLETED", f"{info}\n{out[-6000:]}"
    _stopped(out)
    assert "train.resume: auto: no checkpoint in " in out, out[-6000:]  # the first run
    assert f"train.resume: auto: resuming at epoch 1 (Slurm job {job}, restart 1)" in out, \
        out[-6000:]
    report = check_exactly_once(tmp_path, 2, None)
    assert report.problems == [], (report.problems, out[-6000:])
    assert metrics_epochs(tmp_path / "run") == [0, 1, 2]


# -- slow: the other ways, and the other launcher for each ------------------------------------


@pytest.mark.slow
def test_the_srun_script_signalled_resumes_exactly(slurm: SlurmCluster, tmp_path: Path) -> None:
    """The page's srun script (one task per rank, no torchrun), ``scancel --signal=TERM`` as
    ``#SBATCH --signal=TERM@N`` does it: each task checkpoints and exits 143 (the job fails
    with 143); a second job with ``--resume`` continues the epoch exactly."""
    config = write_config(tmp_path)
    script = _script(tmp_path, SRUN)
    options = ("--ntasks=2",)
    job = _submit(slurm, tmp_path, script, str(config), options=options)
    _wait_holding(slurm, tmp_path, job, 2)
    slurm.command("scancel", "--signal=TERM", job)
    info = slurm.wait_job(job, JOB_S)
    out = _output(tmp_path, job)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "143:0"), f"{info}\n{out[-6000:]}"
    assert "joined the slurm job: rank 1 of 2" in out, out[-6000:]
    _stopped(_resume_and_check(slurm, tmp_path, script, config, job, 2, options))


@pytest.mark.slow
@pytest.mark.parametrize("name", [TORCHRUN, SRUN])
def test_a_cancelled_job_resumes_exactly(slurm: SlurmCluster, tmp_path: Path, name: str) -> None:
    """``scancel``: SIGTERM to every process, SIGKILL after KillWait (5 s here). Under torchrun
    every rank gets SIGTERM twice: before the fix the second ended it before its checkpoint
    (exit -15) and the resume trained the epoch's first 3 batches again."""
    config = write_config(tmp_path)
    script = _script(tmp_path, name)
    options = ("--cpus-per-task=2",) if name == TORCHRUN else ("--ntasks=2",)
    job = _submit(slurm, tmp_path, script, str(config), options=options)
    _wait_holding(slurm, tmp_path, job, 2)
    slurm.command("scancel", job)
    info = slurm.wait_job(job, JOB_S)
    assert info["JobState"] == "CANCELLED", info
    _stopped(_resume_and_check(slurm, tmp_path, script, config, job, 2, options))


@pytest.mark.slow
def test_the_time_limit_with_signal_resumes_exactly(slurm: SlurmCluster, tmp_path: Path) -> None:
    """``--time=3 --signal=TERM@60`` (on the command line, over the script's ``@120``): Slurm
    sends SIGTERM to the steps when 60 s are left, or up to a minute earlier (its time limits
    are looked at every 30 s); the run checkpoints and exits 143 before the limit. (With
    ``--time=2 --signal=TERM@90`` the signal came 2 s after the start.)"""
    config = write_config(tmp_path, hold_s=240)
    script = _script(tmp_path, SRUN)
    options = ("--ntasks=2", "--time=3", "--signal=TERM@60")
    job = _submit(slurm, tmp_path, script, str(config), options=options)
    _wait_holding(slurm, tmp_path, job, 2)
    info = slurm.wait_job(job, JOB_S)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "143:0"), info
    _stopped(_resume_and_check(slurm, tmp_path, script, config, job, 2,
                               ("--ntasks=2",)))


@pytest.mark.slow
def test_full_signal_to_an_exec_torchrun_script_resumes_exactly(slurm: SlurmCluster,
                                                                tmp_path: Path) -> None:
    """``scancel --signal=TERM --full`` signals the batch script's process group: torchrun,
    when the script is torchrun (``exec``), which passes SIGTERM to its ranks (in sessions of
    their own, out of the group); they checkpoint and stop."""
    config = write_config(tmp_path)
    script = _script(tmp_path, "exec")
    options = ("--cpus-per-task=2",)
    job = _submit(slurm, tmp_path, script, str(config), options=options)
    _wait_holding(slurm, tmp_path, job, 2)
    slurm.command("scancel", "--signal=TERM", "--full", job)
    info = slurm.wait_job(job, JOB_S)
    assert info["JobState"] in ("FAILED", "COMPLETED"), info
    _stopped(_resume_and_check(slurm, tmp_path, script, config, job, 2, options))
