"""The resume matrix's accounting checks (tests/test_resume_matrix.py): what the cache and the
run directory record of the epochs a cell's jobs trained, against what the trainers logged.

``epochcache run`` records each epoch's samples once the model keeps them (a checkpoint, or the
epoch's end): its manifests (per epoch and rank, in order) and the cache's coverage ledger (per
listed sample, the epochs it was trained in). Through any stop and resume, on any shape:

* the manifest of each epoch and rank lists the samples the rank kept, in order: in the
  interrupted epoch those before the checkpoint, then those the resumed job trained;
* the coverage ledger counts each listed sample once per epoch it was kept in (its histogram
  is the one the logs give), and the samples without an origin (the turnover writer's, put
  through the Python API) are counted as unattributed, once per epoch too.

A user loop (``epochs()``, ``stream()``, Lightning) records neither by itself: its cell checks
that nothing was counted and no manifest written.
"""

from __future__ import annotations

from collections import Counter

from common.resume_cell import EPOCHS, SAMPLES, WRITER_BASE, Cell, Checkpoint, flat
from epochcache import Cache
from epochcache.coverage.manifests import MANIFESTS_DIR, epoch_spans


def kept(cell: Cell, rank: int, epoch: int, saved: Checkpoint) -> list[int]:
    """The samples rank ``rank`` kept of ``epoch``, in order: the first job's up to its last
    checkpoint (in the interrupted epoch), then the resumed job's."""
    rows = cell.rows(rank)
    first = [r["ids"] for r in rows if r["phase"] == "first" and r.get("epoch") == epoch
             and "ids" in r]
    if epoch == saved.epoch:
        first = first[: saved.batches]
    elif epoch > saved.epoch:
        first = []
    resumed = [r["ids"] for r in rows if r["phase"] == "resume" and r.get("epoch") == epoch
               and "ids" in r]
    return flat(first) + flat(resumed)


def _sample_id(key: str) -> int:
    return int(key.rsplit("/", 1)[-1].split(".")[0])


def check_accounting(cell: Cell, saved: Checkpoint) -> None:
    """Compare the manifests and the coverage ledger with the logs (problems go to ``cell``)."""
    cache = Cache(str(cell.cache_dir), readonly=True)
    try:
        report = cache.coverage()
    finally:
        cache.close()
    if not cell.way.run:
        if report["sources"] or report["unattributed"]:
            cell.problems.append(f"a user loop's cell counted coverage by itself: {report}")
        if (cell.run_dir / MANIFESTS_DIR).exists():
            cell.problems.append("a user loop's cell has manifests it never wrote")
        return
    ranks = max(cell.way.ranks, cell.way.ranks_of("resume"))
    epochs: Counter[int] = Counter()
    for epoch in range(EPOCHS):
        records = epoch_spans(cell.run_dir, epoch)
        trained: set[int] = set()
        for rank in range(ranks):
            want = kept(cell, rank, epoch, saved)
            got = [_sample_id(key) for record in records.get(rank, []) for key in record.keys]
            trained.update(want)
            if got != want:
                extra = Counter(got) - Counter(want)
                cell.problems.append(
                    f"epoch {epoch}, rank {rank}: the manifest lists {len(got)} samples, the "
                    f"rank kept {len(want)}" + (f"; {sum(extra.values())} listed that it did "
                                                f"not keep (or twice)" if extra else "")
                    + ("" if sorted(got) != sorted(want) else " (another order)"))
        epochs.update(trained)
    listed = Counter(count for sample, count in epochs.items() if sample < WRITER_BASE)
    unattributed = sum(count for sample, count in epochs.items() if sample >= WRITER_BASE)
    sources = report["sources"]
    if len(sources) != 1:
        cell.problems.append(f"coverage: {len(sources)} sources, not the run's one")
        return
    histogram = sources[0]["histogram"]
    want = {str(k): listed.get(k, 0) for k in range(1, EPOCHS + 1)}
    want["0"] = SAMPLES - sum(want.values())
    got = {label: histogram.get(label, 0) for label in want}
    more = sum(n for label, n in histogram.items() if label not in want)
    if got != want or more:
        cell.problems.append(f"coverage: samples by epochs trained {got} (and {more} more "
                             f"often), the logs give {want}")
    if report["unattributed"] != unattributed:
        cell.problems.append(f"coverage: {report['unattributed']} unattributed samples counted, "
                             f"the logs give {unattributed} (the writer's, once per epoch)")
