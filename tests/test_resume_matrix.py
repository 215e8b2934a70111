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
* what the cache and the run directory record of the epochs is exact: each epoch's manifest
  per rank lists the samples the rank kept, in order, and the coverage ledger counts each
  sample once per epoch it was kept in (a user loop records neither by itself, and nothing is
  found recorded; tests/common/resume_accounting.py);
* no process of either job is left behind.

The elastic ways come back in another shape: ``run2to1`` and ``run1to2`` resume an
``epochcache run`` on another number of ranks; ``stream2to3`` loads the state of a
StatefulDataLoader with 2 workers into the stream and reads it with 3. Their resumed epoch is
the rest of every earlier lane (after the checkpoint) dealt anew to the new ranks or readers:
new lane ``r`` of ``W`` is ``rest[r::W]``, in order.

The interrupted epoch's order is the one the loader logs (``loader.seqs``: epochcache run and
epochs()); for stream() it is that of an uninterrupted StatefulDataLoader over the same cache
with the same seed and workers, iterated before the job starts (same seed, epoch and snapshot:
same order).

Six cells run in the default suite (``FAST``: each way of stopping at least once, four of the
six ways of loading); the rest are marked slow, the elastic ways' among them (the default
suite resumes a run on another number of ranks in tests/test_run_elastic.py, and a stream
with another number of workers in tests/test_stream_elastic.py).
``pytest tests/test_resume_matrix.py -m ''`` runs all 108; with ``MATRIX_REPORT=FILE`` each
cell appends its result (problems and notes) to FILE as a JSON line.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from common.jobs import describe
from common.resume_accounting import check_accounting
from common.resume_cell import (
    BATCH,
    STOP_EPOCH,
    Cell,
    Checkpoint,
    Way,
    flat,
    stream_readahead,
)

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # torchdata
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),  # torchdata
]

STOPS = ("sigterm", "sigint", "kill_all", "kill_trainer", "exit_in_step",
         "exit_after_checkpoint")
CACHES = ("static", "turnover")

WAYS = {
    "run1": Way("run1", run=True, may_skip=False, logs_order=True),
    "run2": Way("run2", ranks=2, run=True, may_skip=False, logs_order=True),
    # epochs(): the batch trained when the job stops is released only when the loop asks for
    # the next one, so what was trained after the checkpoint may go, nothing further.
    "epochs": Way("epochs", workers=2, logs_order=True, script=("epochs_loop.py",)),
    "stream0": Way("stream0", readahead=stream_readahead(0), script=("stream_loop.py", "0")),
    "stream2": Way("stream2", workers=2, readahead=stream_readahead(2),
                   script=("stream_loop.py", "2")),
    "lightning": Way("lightning", workers=2, readahead=stream_readahead(2),
                     script=("lightning_fit.py",)),
    # Elastic: the job comes back in another shape (docs/guide/resume.md, "When the job comes
    # back in another shape").
    "run2to1": Way("run2to1", ranks=2, run=True, may_skip=False, logs_order=True,
                   resume_ranks=1),
    "run1to2": Way("run1to2", run=True, may_skip=False, logs_order=True, resume_ranks=2),
    "stream2to3": Way("stream2to3", workers=2, readahead=stream_readahead(2),
                      script=("stream_loop.py", "2", "3"), resume_workers=3),
}

#: The default suite's cells: every way of stopping at least once, with the cheaper ways. The
#: other two ways are resumed in the default suite elsewhere: two ranks of a run killed
#: whole (test_run_resume), a Lightning fit killed mid-epoch (test_stream_state); their cells,
#: a torchrun job and a Lightning job twice each, cost 14 and 13 CPU seconds.
FAST = {
    ("run1", "sigterm", "turnover"),
    ("epochs", "kill_all", "turnover"),
    ("epochs", "sigint", "turnover"),
    ("stream0", "exit_after_checkpoint", "turnover"),
    ("stream2", "kill_trainer", "turnover"),
    ("stream0", "exit_in_step", "static"),
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


#: The resume's log lines that count skipped samples (epochs() and runs: one per rank;
#: stream(): one per reader).
SKIPPED = re.compile(r"(\d+) samples of the interrupted epoch were evicted before the resume")


def _run(cell: Cell) -> None:
    """Run the cell's jobs, then check what they trained (problems go to ``cell``)."""
    cell.setup()
    refs = None if cell.way.logs_order else cell.reference()
    cell.lap("set-up")
    first = cell.start("first")
    try:
        cell.stop_first(first)
    finally:
        first.close()
    cell.lap("first job")
    saved = cell.checkpoint()
    if saved.epoch != STOP_EPOCH:
        raise AssertionError(f"the last checkpoint is of epoch {saved.epoch}, not of the "
                             f"interrupted epoch {STOP_EPOCH}")
    cell.notes.append(f"checkpoint after {saved.batches} batches of epoch {saved.epoch}")
    if cell.state == "turnover":
        cell.turn_over()
    present, leases = cell.cached()
    lost = saved.leases - leases
    if lost:
        cell.problems.append(f"the lease the checkpoint names ({', '.join(sorted(lost))}) "
                             f"was gone while the job was down")
    cell.lap("turnover")
    stderr = cell.resume()
    cell.lap("resumed job")
    cell.notes.extend([line.strip() for line in stderr.splitlines()
                       if "lease" in line and ("gone" in line or "afresh" in line)][:4])
    end, _leases = cell.cached()
    evicted, nexts = 0, []
    if cell.way.elastic:
        evicted = _check_regrouped(cell, saved, present, refs)
    for rank in range(cell.way.ranks_of("resume")):
        rows = cell.rows(rank)
        if not cell.way.elastic:
            evicted += _check_resumed(cell, rank, rows, saved, present, refs)
        nexts.extend(_check_next(cell, rank, rows, saved.epoch + 1, present, end))
    if len(set(nexts)) != len(nexts):
        cell.problems.append(f"epoch {saved.epoch + 1}: {len(nexts) - len(set(nexts))} "
                             f"samples trained more than once")
    counted = sum(int(n) for n in SKIPPED.findall(stderr))
    if counted != evicted:
        cell.problems.append(f"the resumed job's log counts {counted} skipped samples; "
                             f"{evicted} of the rest of the epoch were evicted")
    elif evicted:
        cell.notes.append(f"{evicted} samples released after the checkpoint were evicted, "
                          f"skipped and counted")
    cell.lap("checks")
    check_accounting(cell, saved)
    cell.lap("accounting")


def _check_resumed(cell: Cell, rank: int, rows: list[dict[str, Any]], saved: Checkpoint,
                   present: set[int], refs: list[list[list[int]]] | None) -> int:
    """Check one rank's resumed epoch (``present``: the samples cached at the resume);
    returns how many samples of the rest of the epoch were evicted."""
    epoch, where = saved.epoch, f"rank {rank}: "
    first = [r for r in rows if r["phase"] == "first" and r.get("epoch") == epoch]
    before = [r["ids"] for r in first if "ids" in r]
    got = flat([r["ids"] for r in rows
                if r["phase"] == "resume" and "ids" in r and r["epoch"] == epoch])
    lanes: list[list[int]] | None = None
    if refs is None:
        order = next(r["order"] for r in first if "order" in r)
    else:
        matches = [k for k, ref in enumerate(refs) if ref[: len(before)] == before]
        if not matches:
            cell.problems.append(f"{where}epoch {epoch} of the interrupted job matches no "
                                 f"uninterrupted epoch of the same stream")
            return 0
        ref = refs[matches[0]]
        cell.notes.append(f"the job's epoch {epoch} was the stream's epoch {matches[0]}")
        order = flat(ref)
        # Batch k of a fresh epoch comes from reader k % workers (StatefulDataLoader).
        workers = max(cell.way.workers, 1)
        lanes = [flat(ref[w::workers]) for w in range(workers)]
    kept = flat(before[: saved.batches])
    if kept != order[: len(kept)]:
        cell.problems.append(f"{where}the interrupted job did not train its epoch in order")
    rest = order[len(kept):]
    gone = [i for i in rest if i not in present]
    expected = [i for i in rest if i in present]
    if got != expected and not (lanes and gone and _same_lanes(got, expected, lanes)):
        cell.problems.append(where + _diagnose(kept, got, expected, set(order)))
    if gone and not cell.way.may_skip:
        cell.problems.append(
            f"{where}{len(gone)} samples after the checkpoint were evicted while the job "
            f"was down (epochcache run releases only what its checkpoints cover)")
    elif gone:
        reach = len(flat(before)) + cell.way.readahead
        beyond = [i for i in gone if i not in set(order[len(kept): reach])]
        if beyond:
            cell.problems.append(
                f"{where}{len(beyond)} samples evicted that the stop could not have released "
                f"(past sample {reach} of the epoch: the lease did not protect the rest of "
                f"the epoch)")
    return len(gone)


def _check_regrouped(cell: Cell, saved: Checkpoint, present: set[int],
                     refs: list[list[list[int]]] | None) -> int:
    """Check the resumed epoch of an elastic way: the rest of every lane of the interrupted
    epoch after the checkpoint, in lane order, dealt anew (new lane ``r`` of ``W``:
    ``rest[r::W]``); returns how many samples of the rest were evicted (skipped)."""
    epoch = saved.epoch

    def trained(rank: int, phase: str) -> list[list[int]]:
        return [r["ids"] for r in cell.rows(rank) if r["phase"] == phase
                and r.get("epoch") == epoch and "ids" in r]

    if refs is None:  # a run: each rank logs its lane
        lanes = [next(r["order"] for r in cell.rows(rank) if r["phase"] == "first"
                      and r.get("epoch") == epoch and "order" in r)
                 for rank in range(cell.way.ranks)]
        kept = [flat(trained(rank, "first")[: saved.batches]) for rank in range(cell.way.ranks)]
        trained_by_lane = [flat(trained(rank, "first")) for rank in range(cell.way.ranks)]
        new = cell.way.ranks_of("resume")
    else:  # a stream: batch k of the reference epoch came from reader k % workers
        before = trained(0, "first")
        ref = next((ref for ref in refs if ref[: len(before)] == before), None)
        if ref is None:
            cell.problems.append(f"epoch {epoch} of the interrupted job matches no "
                                 f"uninterrupted epoch of the same stream")
            return 0
        workers = cell.way.workers
        lanes = [flat(ref[w::workers]) for w in range(workers)]
        kept = [flat(before[: saved.batches][w::workers]) for w in range(workers)]
        trained_by_lane = [flat(before[w::workers]) for w in range(workers)]
        new = cell.way.resume_workers or workers
    rest: list[int] = []
    for lane, mine in zip(lanes, kept):
        if mine != lane[: len(mine)]:
            cell.problems.append("the interrupted job did not train its lanes in order")
        rest.extend(lane[len(mine):])
    dealt = [[i for i in rest[r::new] if i in present] for r in range(new)]
    gone = [i for i in rest if i not in present]
    # Each new rank reads its lane; a stream's loader reads its readers' lanes in turn.
    pairs = ([(f"rank {r}: ", flat(trained(r, "resume")), lane) for r, lane in enumerate(dealt)]
             if refs is None else [("", flat(trained(0, "resume")), _round_robin(dealt))])
    for where, got, expected in pairs:
        if got != expected:
            cell.problems.append(where + _diagnose(flat(kept), got, expected, set(rest)))
    if gone and not cell.way.may_skip:
        cell.problems.append(f"{len(gone)} samples after the checkpoint were evicted while "
                             f"the job was down (epochcache run releases only what its "
                             f"checkpoints cover)")
    elif gone:
        # What each reader read before the stop (its batches, past the checkpoint too) and
        # its read-ahead, along its lane (generous: the read-ahead is the whole stream's).
        reach = {i for lane, read in zip(lanes, trained_by_lane) for i in
                 lane[: len(read) + cell.way.readahead]}
        beyond = [i for i in gone if i not in reach]
        if beyond:
            cell.problems.append(f"{len(beyond)} samples evicted that the stop could not have "
                                 f"released (the lease did not protect the rest of the epoch)")
    cell.notes.append(f"the rest ({len(rest)} samples) dealt anew to {new}")
    return len(gone)


def _round_robin(lanes: list[list[int]]) -> list[int]:
    """What a DataLoader over readers with these lanes yields: a batch from each reader in
    turn, skipping those that are done."""
    chunks = [[lane[i : i + BATCH] for i in range(0, len(lane), BATCH)] for lane in lanes]
    out: list[int] = []
    while any(chunks):
        for mine in chunks:
            if mine:
                out.extend(mine.pop(0))
    return out


def _check_next(cell: Cell, rank: int, rows: list[dict[str, Any]], epoch: int,
                present: set[int], end: set[int]) -> list[int]:
    """Check that one rank's ``epoch`` after the resumed one is a normal full epoch
    (``present``, ``end``: the samples cached at the resume and at the end of the job);
    returns its samples."""
    where = f"rank {rank}: "
    later = [r for r in rows if r["phase"] == "resume" and r.get("epoch") == epoch]
    ids = flat([r["ids"] for r in later if "ids" in r])
    if not ids:
        cell.problems.append(f"{where}the resumed job did not train epoch {epoch}")
        return ids
    planned = next((r["order"] for r in later if "order" in r), None)
    if planned is not None:
        if sorted(ids) != sorted(planned):
            cell.problems.append(f"{where}epoch {epoch} trained {len(ids)} samples, "
                                 f"{len(set(ids))} distinct; its snapshot holds {len(planned)}")
        return ids
    # Without the snapshot's list (stream()): every sample cached from the resume to the end
    # of the job but the oldest that did not fit the capacity (a snapshot takes the newest
    # that do; samples are inserted in the order of their ids), and only samples cached at
    # the resume.
    left = end - set(ids)
    if set(ids) - present or len(left) > cell.headroom_samples or left and max(left) > min(ids):
        cell.problems.append(
            f"{where}epoch {epoch} is not a full epoch: {len(left)} samples cached throughout "
            f"were left out (e.g. {sorted(left)[-6:]}; the oldest {cell.headroom_samples} may "
            f"be), {len(set(ids) - present)} trained that were not cached")
    return ids


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
        first = next((k for k, (a, b) in enumerate(zip(got, expected)) if a != b),
                     min(len(got), len(expected)))
        parts.append(f"same samples in another order (from position {first})")
    return (f"the resumed epoch is not the rest of the interrupted one: {len(got)} samples, "
            f"{len(expected)} expected; " + "; ".join(parts))


@pytest.mark.parametrize(("way", "stop", "state"), _cells())
def test_resume_matrix(tmp_path: Path, way: str, stop: str, state: str) -> None:
    cell = Cell(WAYS[way], stop, state, tmp_path)
    started = time.monotonic()
    try:
        _run(cell)
    except Exception as exc:  # the harness's own failures are the cell's too
        cell.problems.append(str(exc) if isinstance(exc, AssertionError)
                             else f"{type(exc).__name__}: {exc}")
    finally:
        left = set().union(*(job.close() for job in cell.jobs)) if cell.jobs else set()
        if left:
            cell.problems.append(f"processes left at the end: {describe(left)}")
        cell.report(time.monotonic() - started)
    assert not cell.problems, "\n".join([*cell.problems, "notes:", *cell.notes])
