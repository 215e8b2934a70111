"""The resume matrix (issue 26, item 6; docs/guide/resume.md "The resume matrix"): each way of
loading, stopped each way a job stops, with the cache static or turned over while the job is
down; the resumed epoch must be exactly the rest of the interrupted one.

A cell runs a small trainer (tests/common/matrix/) as a real job: it trains epoch 0, and in
epoch 1 checkpoints its position every few batches and reaches its stop point a few batches
after a checkpoint. The test stops the job there (or the trainer stops itself), waits until no
process of the job is left, turns the cache over if the cell says so (a writer inserts twice
the capacity, evicting everything no lease protects), then resumes the job from its last
checkpoint and lets it finish epoch 1 and train epoch 2. Every trainer logs the sample ids of
each batch; the checks, per rank:

* the resumed epoch yields exactly the samples after the checkpointed position, in the
  interrupted epoch's order (same snapshot, same order): none twice, none skipped -- except
  those the docs let go: a user loop's progressive release (epochs() releases each batch once
  the loop asks for the next one; stream() readers release each chunk once read, which may be
  ahead of the checkpoint), which a turnover may evict. Then exactly the samples of the rest
  of the epoch no longer cached at the resume are missing, they are among those the stop
  could have released, and the log line counting skipped samples says how many.
  ``epochcache run`` releases only what its checkpoints cover: for it nothing may be skipped;
* the lease the checkpoint names is still there while the job is down;
* the epoch after the resumed one is a normal full epoch: each sample of its snapshot once;
* no process of either job is left behind.

The interrupted epoch's order is the one the loader logs (``loader.seqs``: epochcache run and
epochs()); for stream() it is that of an uninterrupted StatefulDataLoader over the same cache
with the same seed and workers, iterated before the job starts (same seed, epoch and snapshot:
same order).

Six cells run in the default suite (``FAST``: each way of loading and each way of stopping at
least once); the rest are marked slow. ``pytest tests/test_resume_matrix.py -m ''`` runs all
72; with ``MATRIX_REPORT=FILE`` each cell appends its result (problems and notes) to FILE as a
JSON line.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.jobs import Job, describe, wait_for
from common.writer import npy_bytes, sample_array
from epochcache import Cache
from epochcache.errors import CacheFull

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # torchdata
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),  # torchdata
]

REPO = Path(__file__).resolve().parents[1]
TRAINERS = REPO / "tests" / "common" / "matrix"

SAMPLES = 300  # per epoch: 30 batches of 10 (15 per rank under torchrun)
BATCH = 10
CAPACITY = "150KiB"  # ~400 samples of ~380 B: the epoch, and room for a writer to churn
TURNOVER = 700  # the most samples the writer inserts while the job is down
WRITER_BASE = 100_000  # the writer's sample ids
STOP_EPOCH = 1
EPOCHS = 3
#: A stream reader reads (and releases) 32 samples at a time, and a DataLoader worker keeps
#: ``prefetch_factor`` (2) batches ready: how far past the trained batches a stream may have
#: released samples when it stops.
STREAM_CHUNK = 32

#: Deadlines (generous: a busy 2-core machine; Lightning and torchrun take seconds to start).
START_S = 300.0  # from the start to the stop point
STOP_S = 120.0  # from the stop to no process of the job left
RESUME_S = 400.0  # the resumed job, start to exit

STOPS = ("sigterm", "sigint", "kill_all", "kill_trainer", "exit_in_step",
         "exit_after_checkpoint")
CACHES = ("static", "turnover")


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
        script: the user script, with its arguments after the cache and run directories.
    """

    name: str
    ranks: int = 1
    workers: int = 0
    run: bool = False
    may_skip: bool = True
    readahead: int = 0
    script: tuple[str, ...] = ()


def _stream_readahead(workers: int) -> int:
    return max(workers, 1) * STREAM_CHUNK + workers * 2 * BATCH + BATCH


WAYS = {
    "run1": Way("run1", run=True, may_skip=False),
    "run2": Way("run2", ranks=2, run=True, may_skip=False),
    # epochs(): the batch trained when the job stops is released only when the loop asks for
    # the next one, so what was trained after the checkpoint may go, nothing further.
    "epochs": Way("epochs", workers=2, script=("epochs_loop.py",)),
    "stream0": Way("stream0", readahead=_stream_readahead(0), script=("stream_loop.py", "0")),
    "stream2": Way("stream2", workers=2, readahead=_stream_readahead(2),
                   script=("stream_loop.py", "2")),
    "lightning": Way("lightning", workers=2, readahead=_stream_readahead(2),
                     script=("lightning_fit.py",)),
}

#: The default suite's cells: every way of loading and every way of stopping at least once.
FAST = {
    ("run1", "sigterm", "turnover"),
    ("run2", "kill_all", "turnover"),
    ("epochs", "sigint", "turnover"),
    ("stream0", "exit_after_checkpoint", "turnover"),
    ("stream2", "kill_trainer", "turnover"),
    ("lightning", "exit_in_step", "static"),
}


def _cells() -> list[Any]:
    cells = []
    for way in WAYS:
        for stop in STOPS:
            for state in CACHES:
                marks = () if (way, stop, state) in FAST else (pytest.mark.slow,)
                cells.append(pytest.param(way, stop, state, marks=marks,
                                          id=f"{way}-{stop}-{state}"))
    return cells


def _key(way: Way, sample: int) -> str:
    """A sample's key in the cache: the source file's path for a run, else the test's."""
    return f"{sample:06d}.npy" if way.run else f"s/{sample:07d}.npy"


def _flat(batches: list[list[int]]) -> list[int]:
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
    _lap: float = 0.0

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
            if self.way.ranks > 1:
                argv[1:3] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             str(self.way.ranks), "-m", "epochcache"]
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

    def check_rank(self, rank: int, saved: Checkpoint, present: set[int], end: set[int],
                   refs: list[list[list[int]]] | None) -> tuple[int, list[int]]:
        """Check one rank's resumed epoch and the next; returns (samples evicted from the rest
        of the epoch, the next epoch's samples). ``present``: the samples cached at the
        resume; ``end``: when the resumed job ended."""
        epoch, where = saved.epoch, f"rank {rank}: "
        rows = self.rows(rank)
        first = [r for r in rows if r["phase"] == "first" and r.get("epoch") == epoch]
        later = [r for r in rows if r["phase"] == "resume"]
        before = [r["ids"] for r in first if "ids" in r]
        after = [r["ids"] for r in later if "ids" in r and r["epoch"] == epoch]
        lanes: list[list[int]] | None = None
        if refs is None:
            order = next(r["order"] for r in first if "order" in r)
        else:
            matches = [k for k, ref in enumerate(refs) if ref[: len(before)] == before]
            if not matches:
                self.problems.append(f"{where}epoch {epoch} of the interrupted job matches no "
                                     f"uninterrupted epoch of the same stream")
                return 0, []
            ref = refs[matches[0]]
            self.notes.append(f"the job's epoch {epoch} was the stream's epoch {matches[0]}")
            order = _flat(ref)
            workers = max(self.way.workers, 1)
            lanes = [_flat(ref[w::workers]) for w in range(workers)]
        kept = _flat(before[: saved.batches])
        if kept != order[: len(kept)]:
            self.problems.append(f"{where}the interrupted job did not train its epoch in order")
        rest = order[len(kept):]
        gone = [i for i in rest if i not in present]
        expected = [i for i in rest if i in present]
        got = _flat(after)
        if got != expected and not (lanes and gone and _same_lanes(got, expected, lanes)):
            self.problems.append(where + _diagnose(kept, got, expected, set(order)))
        if gone and not self.way.may_skip:
            self.problems.append(
                f"{where}{len(gone)} samples after the checkpoint were evicted while the job "
                f"was down (epochcache run releases only what its checkpoints cover)")
        elif gone:
            trained = len(_flat(before))
            allowed = set(order[len(kept): trained + self.way.readahead])
            beyond = [i for i in gone if i not in allowed]
            if beyond:
                self.problems.append(
                    f"{where}{len(beyond)} samples evicted that the stop could not have "
                    f"released (past sample {trained + self.way.readahead} of the epoch: the "
                    f"lease did not protect the rest of the epoch)")
        nxt = [r for r in later if "ids" in r and r["epoch"] == epoch + 1]
        ids = _flat([r["ids"] for r in nxt])
        if not ids:
            self.problems.append(f"{where}the resumed job did not train epoch {epoch + 1}")
        twice = [i for i, n in Counter(ids).items() if n > 1]
        if twice:
            self.problems.append(f"{where}epoch {epoch + 1} trained {len(twice)} samples more "
                                 f"than once (e.g. {twice[:5]})")
        planned = next((r["order"] for r in later if "order" in r
                        and r["epoch"] == epoch + 1), None)
        if planned is not None:
            if sorted(ids) != sorted(planned):
                self.problems.append(f"{where}epoch {epoch + 1} trained {len(ids)} samples, its "
                                     f"snapshot holds {len(planned)}")
        elif ids:
            # Without the snapshot's list (stream()): every sample cached from the resume to
            # the end of the job but the oldest that did not fit the capacity (samples are
            # inserted in the order of their ids), and only samples cached at the resume.
            left = end - set(ids)
            if (set(ids) - present or len(left) > self.headroom_samples
                    or left and max(left) > min(ids)):
                self.problems.append(
                    f"{where}epoch {epoch + 1} is not a full epoch: {len(left)} samples cached "
                    f"throughout were left out (e.g. {sorted(left)[-6:]}; the oldest "
                    f"{self.headroom_samples} may be), {len(set(ids) - present)} trained that "
                    f"were not cached")
        return len(gone), ids

    def lap(self, what: str) -> None:
        now = time.monotonic()
        self.laps.append(f"{what} {now - self._lap:.1f}s")
        self._lap = now

    def run(self) -> None:
        self._lap = time.monotonic()
        self.setup()
        refs = self.reference() if not self.way.run and self.way.name != "epochs" else None
        self.lap("set-up")
        first = self.start("first")
        try:
            self.stop_first(first)
        finally:
            first.close()
        self.lap("first job")
        saved = self.checkpoint()
        if saved.epoch != STOP_EPOCH:
            raise AssertionError(f"the last checkpoint is of epoch {saved.epoch}, not of the "
                                 f"interrupted epoch {STOP_EPOCH}")
        self.notes.append(f"checkpoint after {saved.batches} batches of epoch {saved.epoch}")
        if self.state == "turnover":
            self.turn_over()
        present, leases = self.cached()
        lost = saved.leases - leases
        if lost:
            self.problems.append(f"the lease the checkpoint names ({', '.join(sorted(lost))}) "
                                 f"was gone while the job was down")
        self.lap("turnover")
        stderr = self.resume()
        self.lap("resumed job")
        warnings = [line.strip() for line in stderr.splitlines()
                    if "lease" in line and ("gone" in line or "afresh" in line)]
        self.notes.extend(warnings[:4])
        end, _leases = self.cached()
        evicted, nexts = 0, []
        for rank in range(self.way.ranks):
            gone, ids = self.check_rank(rank, saved, present, end, refs)
            evicted += gone
            nexts.extend(ids)
        if self.way.ranks > 1 and len(set(nexts)) != len(nexts):
            self.problems.append(f"epoch {saved.epoch + 1}: the ranks trained "
                                 f"{len(nexts) - len(set(nexts))} samples on more than one rank")
        counted = sum(int(n) for n in SKIPPED.findall(stderr))
        if counted != evicted:
            self.problems.append(f"the resumed job's log counts {counted} skipped samples; "
                                 f"{evicted} of the rest of the epoch were evicted")
        elif evicted:
            self.notes.append(f"{evicted} samples released after the checkpoint were evicted, "
                              f"skipped and counted")

    def report(self, seconds: float) -> None:
        path = os.environ.get("MATRIX_REPORT")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"cell": f"{self.way.name}-{self.stop}-{self.state}",
                                    "ok": not self.problems, "seconds": round(seconds, 1),
                                    "problems": self.problems, "notes": self.notes,
                                    "laps": self.laps}) + "\n")


#: The resume's log lines that count skipped samples (epochs() and runs: one per rank;
#: stream(): one per reader).
SKIPPED = re.compile(r"(\d+) samples of the interrupted epoch were evicted before the resume")


def _put(path: Path, samples: list[tuple[str, int]]) -> None:
    cache = Cache(str(path), CAPACITY, sync=False)
    try:
        for start in range(0, len(samples), 50):
            cache.put_many([(key, npy_bytes(sample_array(i)))
                            for key, i in samples[start : start + 50]], timeout_s=60)
    finally:
        cache.close()


def _same_lanes(got: list[int], expected: list[int], lanes: list[list[int]]) -> bool:
    """Several readers and skipped samples: the batches mix the readers' lanes anew; each
    lane must still continue in its order."""
    if sorted(got) != sorted(expected):
        return False
    for lane in lanes:
        members = set(lane)
        if [i for i in got if i in members] != [i for i in expected if i in members]:
            return False
    return True


def _diagnose(kept: list[int], got: list[int], expected: list[int], order: set[int]) -> str:
    """What the resumed epoch did wrong, in samples."""
    parts = []
    again = [i for i in got if i in set(kept)]
    if again:
        parts.append(f"repeated {len(again)} samples the checkpoint covered")
    twice = [i for i, n in Counter(got).items() if n > 1]
    if twice:
        parts.append(f"yielded {len(twice)} samples twice")
    missing = [i for i in expected if i not in set(got)]
    if missing:
        parts.append(f"skipped {len(missing)} samples that were still cached "
                     f"(e.g. {missing[:5]})")
    foreign = [i for i in got if i not in order]
    if foreign:
        parts.append(f"yielded {len(foreign)} samples from outside the interrupted epoch")
    if not parts:
        first = next(k for k, (a, b) in enumerate(zip(got, expected)) if a != b)
        parts.append(f"same samples in another order (from position {first})")
    return (f"the resumed epoch is not the rest of the interrupted one: {len(got)} samples, "
            f"{len(expected)} expected; " + "; ".join(parts))


@pytest.mark.parametrize(("way", "stop", "state"), _cells())
def test_resume_matrix(tmp_path: Path, way: str, stop: str, state: str) -> None:
    cell = Cell(WAYS[way], stop, state, tmp_path)
    started = time.monotonic()
    try:
        cell.run()
    except Exception as exc:  # the harness's own failures are the cell's too
        cell.problems.append(str(exc) if isinstance(exc, AssertionError)
                             else f"{type(exc).__name__}: {exc}")
    finally:
        left = set().union(*(job.close() for job in cell.jobs)) if cell.jobs else set()
        if left:
            cell.problems.append(f"processes left at the end: {describe(left)}")
        cell.report(time.monotonic() - started)
    assert not cell.problems, "\n".join([*cell.problems, "notes:", *cell.notes])
