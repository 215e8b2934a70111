"""One cell of the resume matrix (tests/test_resume_matrix.py): its jobs, their logs and
checkpoints, and the cache between them. The trainers it runs are in tests/common/matrix/."""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from common.jobs import Job, describe, wait_for
from common.writer import npy_bytes, sample_array
from epochcache import Cache
from epochcache.errors import CacheFull

REPO = Path(__file__).resolve().parents[2]
TRAINERS = REPO / "tests" / "common" / "matrix"

SAMPLES = 300  # per epoch: 30 batches of 10 (15 per rank under torchrun)
BATCH = 10
CAPACITY = "150KiB"  # ~400 samples of ~380 B: the epoch, and room for a writer to churn
TURNOVER = 700  # the most samples the writer inserts while the job is down
WRITER_BASE = 100_000  # the writer's sample ids
STOP_EPOCH = 1
EPOCHS = 3
#: Deadlines (generous: a busy 2-core machine; Lightning and torchrun take seconds to start).
START_S = 300.0  # from the start to the stop point
STOP_S = 120.0  # from the stop to no process of the job left
RESUME_S = 400.0  # the resumed job, start to exit
#: A stream reader reads (and releases) 32 samples at a time, and a DataLoader worker keeps
#: ``prefetch_factor`` (2) batches ready: how far past the trained batches a stream may have
#: released samples when it stops.
STREAM_CHUNK = 32


@dataclass(frozen=True)
class Way:
    """A way of loading: how its job starts and resumes, and what may be skipped.

    Attributes:
        name: the matrix's name for it.
        ranks: processes that train (torchrun's ranks).
        workers: DataLoader workers (of the stream, for its reference order).
        run: an ``epochcache run`` job (else a user script over a cache the test fills).
        may_skip: the docs let samples released after the checkpoint be evicted.
        readahead: samples past those trained that may be released at a stop.
        logs_order: the trainer logs each epoch's order (``loader.seqs``); else the order is
            that of an uninterrupted loader (:meth:`Cell.reference`).
        script: the user script, with its arguments after the cache and run directories.
        resume_ranks: the ranks of the resumed job, where it comes back in another shape
            (elastic); its rest of the epoch is dealt anew.
        resume_workers: the DataLoader workers of the resumed stream, where they differ
            (the script's last argument).
    """

    name: str
    ranks: int = 1
    workers: int = 0
    run: bool = False
    may_skip: bool = True
    readahead: int = 0
    logs_order: bool = False
    script: tuple[str, ...] = ()
    resume_ranks: int | None = None
    resume_workers: int | None = None

    @property
    def elastic(self) -> bool:
        return self.resume_ranks is not None or self.resume_workers is not None

    def ranks_of(self, phase: str) -> int:
        """The ranks of the job of ``phase``."""
        return self.resume_ranks or self.ranks if phase == "resume" else self.ranks


def stream_readahead(workers: int) -> int:
    """How many samples past those trained a stream with ``workers`` may have released."""
    return max(workers, 1) * STREAM_CHUNK + workers * 2 * BATCH + BATCH


def _key(way: Way, sample: int) -> str:
    """A sample's key in the cache: the source file's path for a run, else the test's."""
    return f"{sample:06d}.npy" if way.run else f"s/{sample:07d}.npy"


def flat(batches: list[list[int]]) -> list[int]:
    """The samples of ``batches``, in order."""
    return [i for batch in batches for i in batch]


def _leases_in(obj: Any) -> set[str]:
    """The leases named by the loader states anywhere in a checkpoint."""
    found: set[str] = set()
    if isinstance(obj, dict):
        if str(obj.get("kind", "")).startswith("epochcache.") and obj.get("lease"):
            found.add(str(obj["lease"]))
        for value in obj.values():
            found |= _leases_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            found |= _leases_in(value)
    return found


@dataclass
class Checkpoint:
    """Where the last checkpoint of the interrupted job stands."""

    epoch: int
    batches: int  # of each rank's part of the epoch, trained before it
    leases: set[str]


@dataclass
class Cell:
    """One cell of the matrix, run in ``tmp``; ``problems`` fail it, ``notes`` explain."""

    way: Way
    stop: str
    state: str
    tmp: Path
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    jobs: list[Job] = field(default_factory=list)
    laps: list[str] = field(default_factory=list)
    headroom_samples: int = 0
    _lap: float = field(default_factory=time.monotonic)

    @property
    def cache_dir(self) -> Path:
        return self.tmp / "cache"

    @property
    def run_dir(self) -> Path:
        return self.tmp / "run"

    # -- set-up -----------------------------------------------------------------------------

    def setup(self) -> None:
        self.run_dir.mkdir()
        if self.way.run:
            data = self.tmp / "data"
            data.mkdir()
            for i in range(SAMPLES):
                (data / f"{i:06d}.npy").write_bytes(npy_bytes(sample_array(i)))
            config = {
                "source": {"url": data.as_uri(), "pattern": "*.npy"},
                "cache": {"dir": str(self.cache_dir), "capacity": CAPACITY},
                "sampler": {"processes": 1, "concurrency": 4},
                "loader": {"batch_size": BATCH, "num_workers": 0},
                "train": {"epochs": EPOCHS, "min_samples": SAMPLES,
                          "entrypoint": "run_trainer:train_epoch", "run_dir": str(self.run_dir),
                          "checkpoint_every_s": 0.2, "options": {"log": str(self.run_dir)}},
            }
            (self.tmp / "cfg.yaml").write_text(yaml.safe_dump(config))
        else:
            _put(self.cache_dir, [(_key(self.way, i), i) for i in range(SAMPLES)])

    def reference(self) -> list[list[list[int]]]:
        """The batches of epochs 0..2 of an uninterrupted StatefulDataLoader over the stream
        (the same seed and workers as the trainer's)."""
        from torchdata.stateful_dataloader import StatefulDataLoader

        cache = Cache(str(self.cache_dir), sync=False)
        stream = cache.stream(seed=3)
        loader = StatefulDataLoader(stream, batch_size=BATCH, num_workers=self.way.workers)
        epochs = [[[int(v) for v in batch[:, 0]] for batch in loader] for _ in range(EPOCHS)]
        stream.close()
        cache.close()
        return epochs

    # -- the jobs ---------------------------------------------------------------------------

    def start(self, phase: str) -> Job:
        env = dict(os.environ)
        env.update(
            PYTHONPATH=os.pathsep.join(filter(None, [
                str(TRAINERS), str(TRAINERS / "no_plots") if self.way.run else "",
                str(REPO / "tests"), str(REPO), env.get("PYTHONPATH")])),
            PYTHONUNBUFFERED="1", COLUMNS="1000", MATRIX_PHASE=phase,
            MATRIX_STOP=self.stop if phase == "first" else "none",
            MATRIX_GO=str(self.tmp / "go"))
        if self.way.run:
            argv = [sys.executable, "-m", "epochcache", "run", str(self.tmp / "cfg.yaml")]
            ranks = self.way.ranks_of(phase)
            if ranks > 1:
                argv[1:3] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             str(ranks), "-m", "epochcache"]
            if phase == "resume":
                argv.append("--resume")
        else:
            script, *args = self.way.script
            argv = [sys.executable, str(TRAINERS / script), str(self.cache_dir),
                    str(self.run_dir), *args]
        job = Job(argv, cwd=self.tmp, env=env, name=phase, logdir=self.tmp)
        self.jobs.append(job)
        return job

    def rows(self, rank: int) -> list[dict[str, Any]]:
        path = self.run_dir / f"rank{rank}.jsonl"
        if not path.exists():
            return []
        # A row is one write; a job killed mid-write leaves at most a torn last line.
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
        return rows

    def _marks(self, kind: str) -> dict[int, dict[str, Any]]:
        """Each rank's first row of ``kind`` (``stop``, ``exit``) in the first job."""
        found = {}
        for rank in range(self.way.ranks):
            mine = [r for r in self.rows(rank) if r.get(kind) and r["phase"] == "first"]
            if mine:
                found[rank] = mine[0]
        return found

    def stop_first(self, job: Job) -> None:
        """Wait for the stop point, stop the job the cell's way, and wait until no process
        of it is left."""
        kind = "exit" if self.stop == "exit_after_checkpoint" else "stop"

        def reached() -> bool:
            # Every rank at its stop point; or, where the trainers stop themselves, the job
            # ended (a rank's peers may be ended by torchrun before they log theirs).
            marks = self._marks(kind)
            return len(marks) == self.way.ranks or job.returncode() is not None

        wait_for(reached, START_S, f"{self.way.name}: the stop point")
        marks = self._marks(kind)
        if 0 not in marks:
            raise AssertionError(f"{self.way.name}: the job exited ({job.returncode()}) before "
                                 f"its stop point:\n{job.stderr()[-4000:]}")
        if self.stop == "sigterm":
            job.signal_group(signal.SIGTERM)
        elif self.stop == "sigint":
            job.signal_group(signal.SIGINT)
        elif self.stop == "kill_all":
            self.notes.append(f"killed {len(job.kill_all())} processes")
        elif self.stop == "kill_trainer":
            job.kill(marks[0]["pid"])  # rank 0's process
        (self.tmp / "go").touch()  # a trainer still waiting at its stop point goes on
        code = job.wait_exit(STOP_S)
        left = job.wait_gone(STOP_S)
        self.notes.append(f"the stopped job exited {code}")
        if left:
            self.problems.append(f"processes of the stopped job still running {STOP_S:.0f} s "
                                 f"after the stop: {describe(left)}")
            job.kill_all()

    def resume(self) -> str:
        job = self.start("resume")
        code = job.wait_exit(RESUME_S)
        if code is None:
            self.problems.append(f"the resumed job still runs after {RESUME_S:.0f} s:\n"
                                 f"{job.stderr()[-3000:]}")
            job.kill_all()
        elif code != 0:
            self.problems.append(f"the resumed job exited {code}:\n{job.stderr()[-3000:]}")
        left = job.wait_gone(STOP_S)
        if left:
            self.problems.append(f"processes of the resumed job still running after it "
                                 f"exited: {describe(left)}")
            job.kill_all()
        return job.stderr()

    # -- what the checkpoint says, what the cache holds -------------------------------------

    def checkpoint(self) -> Checkpoint:
        if self.way.run:
            import torch

            saved = torch.load(self.run_dir / "checkpoint.pt", weights_only=True)
            mid = saved.get("resume")
            if not mid:
                raise AssertionError(f"the last checkpoint (of epoch {saved.get('epoch')}) has no "
                                     f"mid-epoch position: the job went on past its stop point")
            return Checkpoint(int(mid["epoch"]), int(mid["batches"]), _leases_in(mid))
        if self.way.name == "lightning":
            import torch

            saved = torch.load(self.run_dir / "last.ckpt", weights_only=False)
            mine = saved["matrix"]
        else:
            saved = mine = pickle.loads((self.run_dir / "checkpoint.pkl").read_bytes())
        if "loader" not in mine and "matrix" not in saved:
            raise AssertionError(f"the last checkpoint is not one in the middle of an epoch "
                                 f"({sorted(mine)}): the job went on past its stop point")
        return Checkpoint(int(mine["epoch"]), int(mine["batches"]), _leases_in(saved))

    def turn_over(self) -> None:
        """Insert new samples until the writer would have to wait: every sample no lease
        protects is evicted by then (eviction never takes one newer than every snapshot, so
        a writer then waits for the next epoch's snapshot; here none comes)."""
        cache = Cache(str(self.cache_dir), sync=False)
        inserted, before = 0, cache.counters().evicted
        try:
            for start in range(WRITER_BASE, WRITER_BASE + TURNOVER, 10):
                cache.put_many([(f"t/{i:07d}.npy", npy_bytes(sample_array(i)))
                                for i in range(start, start + 10)], wait=False)
                inserted += 10
        except CacheFull as exc:
            inserted += len(getattr(exc.result, "seqs", ()))
        finally:
            evicted = cache.counters().evicted - before
            cache.close()
        self.notes.append(f"the writer inserted {inserted} samples, evicting {evicted}")

    def cached(self) -> tuple[set[int], set[str]]:
        """The sample ids cached now, and the leases held."""
        cache = Cache(str(self.cache_dir), readonly=True)
        try:
            ids = [*range(SAMPLES), *range(WRITER_BASE, WRITER_BASE + TURNOVER)]
            keys = [_key(self.way, i) if i < WRITER_BASE else f"t/{i:07d}.npy" for i in ids]
            present = {i for i, there in zip(ids, cache.contains_many(keys)) if there}
            leases = {lease.lease_id for lease in cache.leases()}
            stats = cache.stats()
            # A snapshot takes the newest samples that fit the capacity: a cache filled into
            # its headroom leaves this many of its oldest out.
            self.headroom_samples = -(-stats["headroom"] * stats["samples"] // stats["bytes"])
        finally:
            cache.close()
        return present, leases

    # -- the checks -------------------------------------------------------------------------

    def lap(self, what: str) -> None:
        """Note how long the phase ending now (``what``) took."""
        now = time.monotonic()
        self.laps.append(f"{what} {now - self._lap:.1f}s")
        self._lap = now

    def report(self, seconds: float) -> None:
        """Append the cell's result to ``$MATRIX_REPORT`` (a JSON line), if set."""
        path = os.environ.get("MATRIX_REPORT")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"cell": f"{self.way.name}-{self.stop}-{self.state}",
                                    "ok": not self.problems, "seconds": round(seconds, 1),
                                    "problems": self.problems, "notes": self.notes,
                                    "laps": self.laps}) + "\n")


def _put(path: Path, samples: list[tuple[str, int]]) -> None:
    cache = Cache(str(path), CAPACITY, sync=False)
    try:
        for start in range(0, len(samples), 50):
            cache.put_many([(key, npy_bytes(sample_array(i)))
                            for key, i in samples[start : start + 50]], timeout_s=60)
    finally:
        cache.close()
