"""What one epoch of a run records, defined once: where a new per-epoch figure is added.

``epochcache run`` writes a row per epoch to ``metrics.jsonl``, logs a line, serves the last
finished epoch's figures as Prometheus gauges (``train.metrics_port``), and keeps its
turnover in the cache's history, where ``epochcache status`` reads it. All four derive from
`FIELDS`: a figure is one `Field` here (its help text, the gauge it is served as, whether the
cache's history keeps it for ``status``, and its words in the log line), and the run fills
its value in the row (``epochcache/run/job.py``). Adding a figure is a `Field` and the code
that measures it: in the run's loop (``run/job.py``), or, for a figure marked ``tally=True``,
where the reader does the work (``data/reader.py``: ``self.tallies.add(name, count)``), in the
training process or a DataLoader worker alike; the run adds an epoch's tallies to its row
(`epochcache.data.workers`). A row written before a figure existed shows "-" for it.

A base module: the store layer (``status``) and the run layer both read it; it imports no
layer and no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .units import format_count, format_duration, format_size

Row = Mapping[str, Any]


@dataclass(frozen=True)
class Field:
    """One per-epoch figure of a run.

    Attributes:
        name: its key in the row (``metrics.jsonl``).
        help: what it is: the gauge's help text, and the docs'.
        gauge: the Prometheus gauge that serves the last finished epoch's value (None: none).
        history: the cache's history keeps it, and ``status`` shows it (its turnover table,
            under ``label``).
        show: its words in the run's log line, from the row (None: not in the line; the
            coverage's close the line, `coverage_words`).
        label: its column in ``status``.
        tally: counted by the reader, in whichever process reads (DataLoader workers
            included), and added to the epoch's row by the run (`epochcache.data.workers`).
    """

    name: str
    help: str
    gauge: str | None = None
    history: bool = False
    show: Callable[[Row], str] | None = None
    label: str = ""
    tally: bool = False


def _percent(value: Any, digits: int = 0) -> str:
    return "n/a" if value is None else f"{100 * float(value):.{digits}f}%"


def _size(value: Any) -> str:
    return "n/a" if value is None else format_size(int(value))


def _count(value: Any) -> str:
    return "n/a" if value is None else f"{int(value):,}"


def _loss(row: Row) -> str:
    loss = row.get("loss")
    return f"loss {loss:.4f}" if isinstance(loss, float) else f"loss {loss}"


def coverage_words(coverage: Row | None) -> str:
    """The log's words for an epoch's coverage (see ``cache.coverage()``). On one node of
    several, of the node's share of the source: the time to see it all is the share's, and a
    node that has seen all of its share has seen half the source, not all of it."""
    if not coverage or not coverage.get("samples"):
        return "coverage: no origins recorded (a cache filled by an older version?)"
    samples, covered = int(coverage["samples"]), int(coverage["covered"])
    nodes = int(coverage.get("num_nodes") or 1)
    share = int(coverage.get("share") or samples) if nodes > 1 else samples
    about = "about " if coverage.get("estimated") else ""
    new = format_count(coverage.get("new") or 0, "sample")
    if nodes > 1:
        words = (f"coverage {covered:,} of this node's share of {about}{share:,} samples "
                 f"({_percent(min(1.0, covered / share), 1)}; the source holds "
                 f"{about}{samples:,} over {nodes} nodes), {new} new this epoch on this rank")
        whole = "this node's share"
    else:
        words = (f"coverage {covered:,} of {about}{format_count(samples, 'sample')} "
                 f"({_percent(covered / samples, 1)}), {new} new this epoch on this rank")
        whole = "every sample"
    eta = coverage.get("eta_s")
    if covered >= share:
        return f"{words}; {whole} seen"
    if eta is None:
        return f"{words}; {whole} seen in: not known yet (no ingest rate measured)"
    return f"{words}; {whole} seen in about {format_duration(max(1.0, float(eta)))}"


def _samples(row: Row) -> str:
    """``600 samples in 10 batches`` (the trainer's count, else the snapshot's), per rank
    under DDP, where the trainer's count is a mean over the ranks."""
    count = row.get("samples", row.get("snapshot_samples")) or 0
    per_rank = " per rank" if int(row.get("ranks") or 1) > 1 else ""
    return (f"{format_count(count, 'sample')} in {format_count(row['batches'], 'batch', 'batches')}"
            f"{per_rank}")


#: The figures of one epoch, in the order the log line gives them. (A trainer's own figures,
#: its loss and accuracy, are in the row as it returned them.)
FIELDS: tuple[Field, ...] = (
    Field("epoch", "the epoch", history=True, label="epoch"),
    Field("loss", "the trainer's loss, as its train_epoch returned it", show=_loss),
    Field("samples", "samples the epoch trained on (the trainer's count, else the snapshot's; "
                     "under DDP a rank's, the mean over the ranks)", show=_samples),
    Field("batches", "batches the epoch took (on each rank)"),
    Field("ranks", "the ranks of the job (1 without DDP)"),
    Field("epoch_s", "seconds the epoch took", show=lambda row: f"{row['epoch_s']:.1f}s"),
    Field("data_wait_fraction", "fraction of the epoch the training loop waited for batches",
          show=lambda row: f"data wait {_percent(row['data_wait_fraction'], 1)}"),
    Field("cache_samples", "samples in the cache at the epoch's end",
          show=lambda row: f"cache {format_size(row['cache_bytes'])} "
                           f"({format_count(row['cache_samples'], 'sample')})"),
    Field("cache_bytes", "bytes stored in the cache at the epoch's end"),
    Field("evicted", "samples evicted during the epoch",
          show=lambda row: f"evicted {_count(row['evicted'])}"),
    Field("snapshot_samples", "samples in the epoch's snapshot",
          gauge="epochcache_train_epoch_snapshot_samples", history=True, label="snapshot"),
    Field("new_samples", "samples of the epoch's snapshot the epoch before did not have",
          gauge="epochcache_train_epoch_new_samples", history=True, label="new samples",
          show=lambda row: f"new to the snapshot {_count(row['new_samples'])}"),
    Field("writer_wait_fraction",
          "fraction of the epoch the samplers waited on leases (0-1; null without samplers)",
          gauge="epochcache_train_epoch_writer_wait_ratio", history=True,
          label="writers waited",
          show=lambda row: f"writers waited {_percent(row['writer_wait_fraction'])}"),
    Field("coverage", "how much of each source training has seen (see cache.coverage())"),
    Field("requests", "what the epoch cost each source: GETs, LISTs, bytes, throttled, ..."),
    Field("remote_requests", "requests the epoch sent the remote (GETs and LISTs)"),
    Field("remote_bytes", "bytes the epoch received from the remote (egress)"),
    Field("decoded_bytes", "bytes of the samples the epoch's batches decoded (each sample's "
                           "payload as stored, uncompressed), DataLoader workers included; "
                           "under DDP this rank's",
          gauge="epochcache_train_epoch_decoded_bytes", history=True, label="decoded",
          show=lambda row: f"decoded {_size(row.get('decoded_bytes'))}", tally=True),
    Field("skipped", "samples the epoch's reads skipped as damaged or undecodable "
                     "(reader option on_error='skip'), DataLoader workers included",
          gauge="epochcache_train_epoch_skipped_samples", tally=True),
    Field("time", "when the epoch ended (Unix time)", history=True),
)

#: The fields the cache's history keeps (``status``'s turnover table).
HISTORY: tuple[Field, ...] = tuple(field for field in FIELDS if field.history)
#: The fields served as Prometheus gauges.
GAUGES: tuple[Field, ...] = tuple(field for field in FIELDS if field.gauge)
#: The names of the fields the reader counts (the columns of a `Tallies` block).
TALLIES: tuple[str, ...] = tuple(field.name for field in FIELDS if field.tally)


def history_row(row: Row) -> dict[str, Any]:
    """What the cache's history keeps of an epoch's row."""
    return {f.name: row.get(f.name) for f in HISTORY}


def is_epoch_row(row: Row) -> bool:
    """Whether a history row is an epoch's: one that names an epoch (the daemon's rows never
    do). Not every history field: a row written before a figure existed is an epoch's all the
    same, and ``status`` shows "-" for what it lacks."""
    return "epoch" in row


def log_line(row: Row) -> str:
    """The run's log line for an epoch: ``epoch N: loss ..., ...; coverage ...``."""
    words = [f.show(row) for f in FIELDS if f.show is not None]
    return f"epoch {row['epoch']}: " + ", ".join(words) + "; " + coverage_words(row.get("coverage"))


def epoch_history(row: Row) -> dict[str, Any]:
    """The history fields an epoch's row holds (``status``'s turnover, as ``--json`` gives it):
    a row written before a figure existed lacks it."""
    return {f.name: row[f.name] for f in HISTORY if f.name in row}


def status_cell(f: Field, row: Row) -> str:
    """A history field's value in ``status``'s turnover table ("-": the row is older than
    the figure)."""
    if f.name not in row:
        return "-"
    value = row[f.name]
    if f.name == "writer_wait_fraction":
        return _percent(value)
    if f.name == "epoch":
        return str(value)
    if f.name.endswith("_bytes"):
        return _size(value)
    return _count(value) if isinstance(value, int) else ("-" if value is None else str(value))
