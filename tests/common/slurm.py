"""A real one-node Slurm for the scheduler tests (tests/test_slurm.py, the Slurm section of
docs/howto/multi-node.md): munged, slurmctld and slurmd started as root from Debian's
``slurm-wlm`` and ``munge`` (``scripts/setup-env`` installs them), everything in one temporary
directory: munge's key and socket, ``slurm.conf``, the state, spool and log directories; free
ports on 127.0.0.1.

The configuration is the one the tests need: this machine's CPUs and memory as one node in one
partition, ``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none`` (no cgroups
here), ``KillWait=5`` (a cancelled job gets SIGTERM, then SIGKILL 5 s later), the scheduler run
every second and a requeued job eligible again after ``cred_expire`` (5 s, not 120), and jobs
kept for ``scontrol show job`` 10 minutes after they end. Every daemon is a child of this
process, started with ``PR_SET_PDEATHSIG`` (it dies with the test session, whatever ends it);
`SlurmCluster.stop` cancels every job, then stops the daemons and kills whatever a job left.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from common.procs import SESSION_TAG, freeze_and_kill, job_procs, proc_stat

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scancel", "scontrol", "sinfo", "squeue", "srun")
KILL_WAIT_S = 5
START_S = 60.0


def unavailable() -> str | None:
    """Why this machine cannot run the cluster (None: it can). Only a machine where the packages
    cannot be installed (not root, no apt-get) skips; root with apt-get and no Slurm is a set-up
    that was not run."""
    missing = [name for name in (*DAEMONS, *CLIENTS) if shutil.which(name) is None
               and not Path(f"/usr/sbin/{name}").exists()]
    if not missing:
        return None if os.geteuid() == 0 else "needs root (slurmd starts jobs as their user)"
    if os.geteuid() != 0:
        return f"{', '.join(missing)} not installed, and not root (apt-get needs it)"
    if shutil.which("apt-get") is None:
        return f"{', '.join(missing)} not installed, and no apt-get to install slurm-wlm and munge"
    raise RuntimeError(f"{', '.join(missing)} not installed: run scripts/setup-env, which "
                       "installs slurm-wlm and munge with apt-get")


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    os.setsid()


def _node_resources() -> tuple[int, int]:
    """``(CPUs, RealMemory in MiB)`` as slurmd sees this machine (``slurmd -C``)."""
    out = subprocess.run([_binary("slurmd"), "-C"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    cpus = re.search(r"\bCPUs=(\d+)", out)
    memory = re.search(r"\bRealMemory=(\d+)", out)
    return (int(cpus.group(1)) if cpus else os.cpu_count() or 1,
            int(memory.group(1)) if memory else 1024)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class SlurmCluster:
    """One node (this machine, by its host name), one partition, started by `start`."""

    def __init__(self) -> None:
        # Not under pytest's tmp_path: munged wants its socket's directory open to everyone.
        self.root = Path(tempfile.mkdtemp(prefix="epochcache-slurm-"))
        self.root.chmod(0o755)
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.cpus, self.memory_mib = _node_resources()
        self.version = subprocess.run([_binary("sinfo"), "--version"], capture_output=True,
                                      text=True, check=False).stdout.strip()

    # -- set-up -----------------------------------------------------------------------------

    def _write_files(self) -> None:
        munge = self.root / "munge"
        munge.mkdir(mode=0o755)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        for name in ("state", "spool", "log"):
            (self.root / name).mkdir(mode=0o755)
        r = self.root
        self.conf.write_text(f"""\
ClusterName=epochcache-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge / 'munge.sock'},cred_expire=5
CredType=cred/munge
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'slurmd.pid'}
SlurmctldLogFile={r / 'log' / 'slurmctld.log'}
SlurmdLogFile={r / 'log' / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
KillWait={KILL_WAIT_S}
MinJobAge=600
ReturnToService=2
InactiveLimit=0
Waittime=0
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={self.memory_mib} State=UNKNOWN
PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
""")

    def _spawn(self, name: str, argv: list[str]) -> None:
        env = {k: v for k, v in os.environ.items() if k != SESSION_TAG and not k.startswith("SLURM")}
        env["SLURM_CONF"] = str(self.conf)
        out = open(self.root / "log" / f"{name}.out", "wb")  # noqa: SIM115 - the daemon's
        try:
            self.procs[name] = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL,
                                                preexec_fn=_die_with_parent)
        finally:
            out.close()

    def start(self) -> SlurmCluster:
        """Start the daemons and wait until the node is idle; AssertionError with the logs if
        it is not within a minute."""
        self._write_files()
        munge = self.root / "munge"
        self._spawn("munged", [_binary("munged"), "--foreground", "--force",
                               f"--key-file={munge / 'munge.key'}",
                               f"--socket={munge / 'munge.sock'}",
                               f"--pid-file={munge / 'munged.pid'}",
                               f"--seed-file={munge / 'munged.seed'}",
                               f"--log-file={self.root / 'log' / 'munged.log'}"])
        self._wait(lambda: (munge / "munge.sock").exists(), "munged's socket")
        self._spawn("slurmctld", [_binary("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._spawn("slurmd", [_binary("slurmd"), "-D", "-N", self.node, "-f", str(self.conf)])
        self._wait(lambda: self.node_state() == "idle", "the node idle (sinfo)")
        return self

    def _wait(self, condition: Any, what: str) -> None:
        deadline = time.monotonic() + START_S
        while not condition():
            dead = [name for name, proc in self.procs.items() if proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"one-node Slurm: no {what} within {START_S:.0f} s "
                                     f"(exited: {dead or 'none'})\n{self.logs()}")
            time.sleep(0.2)

    # -- commands ---------------------------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        """What a client command needs in its environment."""
        return {"SLURM_CONF": str(self.conf)}

    def command(self, *argv: str, check: bool = True,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command (``sbatch``, ``scancel``, ...) against this cluster."""
        full = {**os.environ, **(env or {}), **self.env}
        done = subprocess.run([_binary(argv[0]), *argv[1:]], env=full, capture_output=True,
                              text=True, timeout=60, check=False)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr}")
        return done

    def node_state(self) -> str:
        done = self.command("sinfo", "-h", "-n", self.node, "-o", "%t", check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (``JobState``, ``ExitCode``, ``Restarts``, ...);
        empty when Slurm no longer knows the job."""
        done = self.command("scontrol", "-o", "show", "job", job_id, check=False)
        if done.returncode != 0:
            return {}
        return dict(re.findall(r"(\w+)=(\S*)", done.stdout))

    def wait_job(self, job_id: str, timeout_s: float,
                 states: tuple[str, ...] = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                            "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY")) -> dict[str, str]:
        """Wait until the job is in one of ``states`` (by default: ended); its record."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id}: still {info.get('JobState')} after "
                                     f"{timeout_s:.0f} s (waiting for {states})")
            time.sleep(0.2)

    def active_jobs(self) -> list[str]:
        done = self.command("squeue", "-h", "-o", "%i", check=False)
        return done.stdout.split()

    def cancel_all(self, timeout_s: float = 60.0) -> None:
        """Cancel every job and wait until none is left (ended, their processes gone)."""
        jobs = self.active_jobs()
        if jobs:
            self.command("scancel", "--full", *jobs, check=False)
        deadline = time.monotonic() + timeout_s
        while self.active_jobs() and time.monotonic() < deadline:
            time.sleep(0.2)

    def logs(self) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            text = path.read_text(errors="replace")[-2000:]
            parts.append(f"--- {path.name} ---\n{text}")
        return "\n".join(parts)

    # -- tear-down --------------------------------------------------------------------------

    def stop(self) -> None:
        """Cancel every job, stop the daemons, kill whatever is left of them and their jobs,
        and remove the directory."""
        slurmd = self.procs.get("slurmd")
        try:
            if slurmd is not None and slurmd.poll() is None and "slurmctld" in self.procs:
                self.cancel_all()
        finally:
            left = {}
            for proc in self.procs.values():  # jobs' processes (slurmstepd's children) too
                stat = proc_stat(proc.pid)
                if stat is not None:
                    left.update({s.pid: s.start for s in job_procs({proc.pid: stat.start})})
            for name in ("slurmd", "slurmctld", "munged"):
                proc = self.procs.get(name)
                if proc is not None and proc.poll() is None:
                    proc.terminate()
            for proc in self.procs.values():
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(15)
            still = {pid: start for pid, start in left.items()
                     if (stat := proc_stat(pid)) is not None and stat.start == start and stat.alive}
            if still:
                freeze_and_kill(still)
            self.procs.clear()
            shutil.rmtree(self.root, ignore_errors=True)
