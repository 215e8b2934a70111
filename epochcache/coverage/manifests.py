"""Training manifests: the sample keys each epoch trained on, per rank, in order.

``epochcache run`` writes one file per epoch and rank, ``<run dir>/manifests/epoch-000012.rank-00000.ecm``,
through a [`ManifestWriter`][epochcache.coverage.manifests.ManifestWriter] (``epochs()`` and ``stream()`` can do the same: the writer
needs only the cache and, per part of an epoch, its sequence numbers). The keys come from the
cache's origin rows (`origins`), which outlive the samples' eviction as long as the
epoch's lease lives, so a manifest names every sample even under progressive release.

**Spans.** A file is a sequence of spans, each the keys of a run of batches:
``b"ECMF"``, ``u32`` header length, a JSON header (epoch, rank, the snapshot's lease, the lane
positions ``from`` and ``to`` the span covers, the key count), ``u32`` payload length, and the
keys NUL-separated (keys hold no NUL), zstd-compressed: a few bytes a sample. Spans are
appended and synced, a torn span at the end (a crash while writing) is cut off before the
next append, and readers ignore one.

**Interrupted epochs.** ``run`` appends a span when a checkpoint covers part of an epoch
(``train.checkpoint_every_s``) and when the epoch ends, so the spans name what the model
kept. Each span names its *lane* (the rank's place in the node, and the split of an earlier
resume it was dealt from, see `epochcache.data.resume`), and positions count along it. A
resumed epoch appends spans from the checkpoint's position on; a span that a later one on
its lane starts at or before (the job died after writing it, before its checkpoint) was
trained again and is dropped when reading, and so are the spans of an attempt that could
not be continued (another lease: the epoch started afresh). A resume on another number of
ranks deals the rest anew onto new lanes, whose spans carry the split: its positions say
how far each earlier lane was kept, so spans of the earlier lanes past them are dropped
(whichever rank's file holds them) and those before them stay. So
[`epoch_keys`][epochcache.coverage.manifests.epoch_keys] gives each sample trained once, in
order, however often and on whatever shapes the epoch was stopped and resumed.

Keys are cache keys: ``<name>/<key>`` for an entry of ``sources:``; for a ``tar`` sample
``<shard>/<sample>``. Fed back as ``source.manifest`` (per source: [`epoch_keys`][epochcache.coverage.manifests.epoch_keys] with
``source=``), they fetch exactly those samples again (see docs/howto/runs.md).

**What a run records** (`TrainedSpans`): the samples of an epoch, in two places once the
model has kept them: the epoch's manifest (the keys, in order) and the cache's coverage ledger
(`epochcache.coverage.ledger`: one more epoch for each sample). It does so when a mid-epoch
checkpoint covers part of the epoch (``train.checkpoint_every_s``) and when the epoch ends,
each time for the batches since the last time: before the checkpoint is written, the
manifest's span is appended and the coverage *staged*; once it is written, the staged
coverage is counted (`epochcache.coverage.staged`). So an epoch stopped and resumed from its
checkpoint records each of its samples once, whenever the job was killed (while it wrote the
checkpoint too), and an epoch a job dies in without a checkpoint records nothing (it is
trained again, from its start, on resume).
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lmdb
import numpy as np
import zstandard

from ..errors import CacheError
from ..store.origins import read_origins
from ..store.records import DB_SAMPLES, record_source_key, seq_key
from . import bucketed, coverage, staged
from .ledger import record_trained

if TYPE_CHECKING:
    from ..store.sample_store import SampleStore

MANIFESTS_DIR = "manifests"
_MAGIC = b"ECMF"
_U32 = struct.Struct("<I")
#: A span's header is small JSON; anything larger is damage.
_MAX_HEADER = 1 << 20
#: zstd level of the keys: a million numbered keys compress to 3.7 bytes each in 0.06 s at
#: level 1 (level 6: 3.9 bytes, 0.5 s; level 9: 3.5 bytes, 1.1 s).
LEVEL = 1


def manifest_path(run_dir: str | os.PathLike[str], epoch: int, rank: int) -> Path:
    return Path(run_dir) / MANIFESTS_DIR / f"epoch-{epoch:06d}.rank-{rank:05d}.ecm"


def keys_of(cache: SampleStore, seqs: np.ndarray) -> list[bytes | None]:
    """The source keys of ``seqs`` (UTF-8 bytes), from the origin rows, else from the samples
    themselves; None for a sample with neither (evicted, from a cache without origin rows)."""
    seqs = np.asarray(seqs, dtype=np.uint64)
    with cache.env.read() as txn:
        rows = read_origins(txn, cache.env.dbs, seqs, with_keys=True)
        keys = rows.keys
        missing = np.flatnonzero(~rows.found)
        if len(missing):
            db = cache.env.dbs[DB_SAMPLES]
            for i in missing.tolist():
                record = txn.get(seq_key(int(seqs[i])), db=db)
                keys[i] = None if record is None else record_source_key(record)
    return keys


@dataclass
class Span:
    """One span of a manifest file: its header and its keys."""

    header: dict[str, Any]
    keys: list[str]


class ManifestWriter:
    """Appends the keys one epoch trains on, on one rank, to its manifest file.

    Args:
        cache: the cache the epoch reads.
        run_dir: where ``manifests/`` goes.
        epoch: the epoch.
        rank: the global rank.
        lease: the epoch's lease (names the snapshot: a resumed epoch continues on it).
        position: where along the rank's lane the epoch starts (a resumed epoch's position).
        sources: the names of the ``sources:`` entries (kept in each span for readers).
        lane: the lane the positions count along: ``local_rank``, ``local_world_size`` and
            ``split`` (the ``"resumed"`` split of the loader's state, None for the epoch's own
            lanes); None for a writer that knows none (its spans supersede by file).
    """

    def __init__(self, cache: SampleStore, run_dir: str | os.PathLike[str], *, epoch: int,
                 rank: int, lease: str, position: int = 0, sources: Sequence[str] = (),
                 lane: dict[str, Any] | None = None) -> None:
        self.cache, self.epoch, self.rank, self.lease = cache, epoch, rank, lease
        self.path = manifest_path(run_dir, epoch, rank)
        self.position = position
        self.sources = list(sources)
        self.lane = lane
        self._checked = False

    def write(self, seqs: np.ndarray, to: int) -> int:
        """Append the keys of ``seqs`` (trained in this order) as covering the lane up to
        position ``to``; return the keys whose name is unknown (written as ``#`` comments)."""
        seqs = np.asarray(seqs, dtype=np.uint64)
        with self.cache.env.read() as txn:
            rows = read_origins(txn, self.cache.env.dbs, seqs, with_keys=True)
        unknown = 0
        if rows.found.all():
            raw = rows.joined(b"\0")  # the common case: no Python object per key
        else:
            lines = keys_of(self.cache, seqs)
            for i in [i for i, key in enumerate(lines) if key is None]:
                unknown += 1
                lines[i] = (f"# sample {int(seqs[i])}: key unknown (evicted, cached without an "
                            "origin)").encode()
            raw = b"\0".join(lines)  # type: ignore[arg-type]
        payload = zstandard.ZstdCompressor(level=LEVEL).compress(raw)
        header = json.dumps({"version": 1, "epoch": self.epoch, "rank": self.rank,
                             "lease": self.lease, "from": self.position, "to": int(to),
                             "keys": len(seqs), "unknown": unknown, "sources": self.sources,
                             "time": round(time.time(), 3),
                             **({} if self.lane is None else {"lane": self.lane})}).encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self._checked:
            cut_torn_tail(self.path)
            self._checked = True
        with open(self.path, "ab") as f:
            f.write(_MAGIC + _U32.pack(len(header)) + header + _U32.pack(len(payload)) + payload)
            f.flush()
            os.fsync(f.fileno())
        self.position = int(to)
        return unknown


def _spans(data: bytes) -> Iterator[tuple[int, dict[str, Any], bytes]]:
    """``(end offset, header, compressed keys)`` of each whole span of ``data``."""
    at = 0
    while at + 8 <= len(data) and data[at: at + 4] == _MAGIC:
        size = _U32.unpack_from(data, at + 4)[0]
        if size > _MAX_HEADER or at + 8 + size + 4 > len(data):
            return
        try:
            header = json.loads(data[at + 8: at + 8 + size])
        except ValueError:
            return
        length = _U32.unpack_from(data, at + 8 + size)[0]
        end = at + 8 + size + 4 + length
        if end > len(data):
            return
        yield end, header, data[at + 12 + size: end]
        at = end


def cut_torn_tail(path: Path) -> None:
    """Cut a span the last writer did not finish (it died writing) off the file's end."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    end = 0
    for end, _header, _payload in _spans(data):  # noqa: B007 - the last span's end
        pass
    if end != len(data):
        with open(path, "r+b") as f:
            f.truncate(end)


def read_spans(path: str | os.PathLike[str]) -> list[Span]:
    """Every whole span of a manifest file, in the order written."""
    data = Path(path).read_bytes()
    out = []
    dctx = zstandard.ZstdDecompressor()
    for _end, header, payload in _spans(data):
        raw = dctx.decompress(payload, max_output_size=max(1, 64 * len(payload) + (1 << 20)))
        text = raw.decode("utf-8", "surrogateescape")
        out.append(Span(header, text.split("\0") if text else []))
    return out


def _fingerprint(split: Any) -> str:
    return json.dumps(split, sort_keys=True, separators=(",", ":"))


def _lane_key(header: dict[str, Any], rank: int) -> tuple[Any, ...]:
    """The lane a span's positions count along (a span without one: its file's)."""
    lane = header.get("lane")
    if not isinstance(lane, dict):
        return (header.get("lease"), None, rank, None)
    return (header.get("lease"), _fingerprint(lane.get("split")), int(lane["local_rank"]),
            int(lane["local_world_size"]))


def _limits(spans: Sequence[tuple[int, Span]]) -> dict[tuple[Any, ...], int]:
    """How far each earlier lane was kept, as the splits of later resumes record it: a split
    (``"resumed"``) holds the layout it was dealt from, with each lane's position, and the
    split that layout was itself dealt from."""
    limits: dict[tuple[Any, ...], int] = {}
    for _rank, span in spans:  # oldest first: a later split's word is the last
        lane = span.header.get("lane")
        split = lane.get("split") if isinstance(lane, dict) else None
        while isinstance(split, dict):
            parent = split.get("resumed")
            size = int(split["local_world_size"])
            for r, position in enumerate(split["positions"]):
                key = (span.header.get("lease"), _fingerprint(parent), r, size)
                limits[key] = int(position)
            split = parent
    return limits


def epoch_spans_of(files: dict[int, list[Span]]) -> dict[int, list[Span]]:
    """Of one epoch's spans by rank (each file's in the order written), those whose samples
    the model kept, by rank, a span cut where a later resume says its lane was kept up to
    (see the module docstring)."""
    alive: dict[int, list[bool]] = {}
    ordered: list[tuple[float, int, int]] = []
    for rank, spans in files.items():
        flags = alive[rank] = [True] * len(spans)
        for i, span in enumerate(spans):
            lease = span.header.get("lease")
            for j in range(i):  # another lease in this file: the epoch started afresh
                if spans[j].header.get("lease") != lease:
                    flags[j] = False
            ordered.append((float(span.header.get("time") or 0.0), rank, i))
    ordered.sort()
    # A span drops the earlier spans of its lane that start at or after it (trained again).
    by_lane: dict[tuple[Any, ...], list[tuple[int, int]]] = {}
    for _time, rank, i in ordered:
        header = files[rank][i].header
        key, start = _lane_key(header, rank), int(header["from"])
        kept = by_lane.setdefault(key, [])
        for r, j in kept:
            if int(files[r][j].header["from"]) >= start:
                alive[r][j] = False
        kept[:] = [(r, j) for r, j in kept if alive[r][j]] + [(rank, i)]
    # Lanes of one split with another number of ranks than its latest spans: an attempt
    # that no checkpoint continued (none but a later split's limit keeps them).
    latest: dict[tuple[Any, ...], Any] = {}
    for _time, rank, i in ordered:
        key = _lane_key(files[rank][i].header, rank)
        latest[key[:2]] = key[3]
    limits = _limits([(rank, files[rank][i]) for _time, rank, i in ordered])
    out: dict[int, list[Span]] = {}
    for rank, spans in files.items():
        out[rank] = []
        for i, span in enumerate(spans):
            key = _lane_key(span.header, rank)
            limit = limits.get(key)
            if not alive[rank][i] or (limit is None and latest[key[:2]] != key[3]):
                continue
            start, end = int(span.header["from"]), int(span.header["to"])
            if limit is not None and end > limit:
                if start >= limit:
                    continue
                # Spans end at checkpoints, and so do limits: a span across one is not
                # written; cut by keys (a skipped sample would shift it) rather than lose it.
                span = Span(span.header, span.keys[: limit - start])
            out[rank].append(span)
    return out


def epoch_spans(run_dir: str | os.PathLike[str], epoch: int) -> dict[int, list[Span]]:
    """Every rank's spans of ``epoch`` in ``run_dir`` whose samples the model kept (see
    the module docstring), by rank."""
    ranks = manifests(run_dir).get(epoch, [])
    return epoch_spans_of({rank: read_spans(manifest_path(run_dir, epoch, rank))
                             for rank in ranks})


def manifests(run_dir: str | os.PathLike[str]) -> dict[int, list[int]]:
    """``{epoch: [ranks]}`` of the manifests in a run directory."""
    out: dict[int, list[int]] = {}
    directory = Path(run_dir) / MANIFESTS_DIR
    if not directory.is_dir():
        return out
    for path in sorted(directory.glob("epoch-*.rank-*.ecm")):
        try:
            epoch = int(path.name.split(".")[0].split("-")[1])
            rank = int(path.name.split(".")[1].split("-")[1])
        except (IndexError, ValueError):
            continue
        out.setdefault(epoch, []).append(rank)
    return out


def epoch_keys(run_dir: str | os.PathLike[str], epoch: int, rank: int | None = None,
               source: str | None = None) -> list[str]:
    """The keys epoch ``epoch`` trained on, in order: of one rank, or of every rank one after
    another (rank order); with ``source``, only that ``sources:`` entry's, without its
    ``<name>/`` prefix (a manifest to feed back as that source's ``source.manifest``).

    Raises:
        FileNotFoundError: no manifest of that epoch (and rank) in ``run_dir``.
    """
    ranks = manifests(run_dir).get(epoch, [])
    if rank is not None:
        ranks = [r for r in ranks if r == rank]
    if not ranks:
        which = f"epoch {epoch}" + ("" if rank is None else f", rank {rank}")
        raise FileNotFoundError(f"{run_dir}: no manifest of {which} (train.manifests writes "
                                f"them; `epochcache manifest {run_dir}` lists those there)")
    kept = epoch_spans(run_dir, epoch)
    keys: list[str] = []
    for r in ranks:
        for span in kept[r]:
            keys.extend(span.keys)
    if source is not None:
        prefix = source + "/"
        keys = [key[len(prefix):] for key in keys if key.startswith(prefix)]
    return keys


log = logging.getLogger(__name__)


class TrainedSpans:
    """Records the batches one epoch's loop has trained on, on this rank.

    Args:
        cache: the cache the epoch reads.
        loader: the epoch's [`EpochLoader`][epochcache.data.epoch_loader.EpochLoader].
        epoch: the epoch.
        batch_size: samples per batch (the loader's).
        run_dir: where the manifest goes; None writes none (``train.manifests: false``).
        rank: the global rank.
        job: what the coverage ledger names the job by.
        sources: the names of the config's ``sources:`` entries.
        run: the run's key for staged coverage (`staged.run_key` of its directory).
    """

    def __init__(self, cache: SampleStore, loader: Any, epoch: int, *, batch_size: int,
                 run_dir: Path | None, rank: int, job: str, sources: list[str],
                 run: str) -> None:
        self.cache, self.loader, self.epoch = cache, loader, epoch
        self.batch_size, self.job, self.run = batch_size, job, run
        self.done = 0  # batches recorded
        self.trained = self.new = 0
        #: Staged and not counted yet: token -> seqs (the next checkpoint covers them).
        self.staged: dict[str, np.ndarray] = {}
        state = self._state()
        self.manifest = None if run_dir is None or state is None else ManifestWriter(
            cache, run_dir, epoch=epoch, rank=rank, lease=str(state.get("lease") or ""),
            position=int(state.get("position", 0)), sources=sources, lane=_lane(state))

    def _state(self) -> dict[str, Any] | None:
        # Not state_dict(): a state taken keeps the epoch's lease for a resume, and only a
        # checkpoint may say the epoch can be resumed (without one, a stop releases it).
        state = getattr(self.loader, "position_state", None)
        return None if state is None else dict(state())

    def stage(self, batches: int) -> str | None:
        """The first ``batches`` batches are trained, and the checkpoint about to be written
        (mid-epoch, or at the epoch's end) keeps them: append those not recorded yet to the
        manifest and stage their coverage; returns its token, for the checkpoint to name
        (None: nothing staged). Failures are logged, never raised: an audit record must not
        stop training."""
        if batches <= self.done:
            return None
        seqs = np.asarray(self.loader.seqs)[self.done * self.batch_size:
                                            batches * self.batch_size]
        self.done = batches
        try:
            if self.manifest is not None:
                state = self._state() or {}
                self.manifest.write(seqs, int(state.get("position", self.manifest.position)))
            token = staged.stage(self.cache, seqs, run=self.run, epoch=self.epoch, job=self.job)
        except (OSError, ValueError, lmdb.Error, CacheError) as exc:
            log.warning("epoch %d: could not record what it trained on (manifest, coverage): "
                        "%s", self.epoch, exc)
            return None
        self.staged[token] = seqs
        return token

    def commit(self) -> None:
        """The checkpoint that names the staged coverage is written: count it."""
        for token in list(self.staged):
            try:
                counted = staged.commit(self.cache, token)
            except (OSError, ValueError, lmdb.Error, CacheError) as exc:
                log.warning("epoch %d: could not count what it trained on in the coverage "
                            "ledger (%s); tried again after the next checkpoint, or by "
                            "--resume", self.epoch, exc)
                return
            del self.staged[token]
            self.trained += counted["trained"]
            self.new += counted["new"]

    def preview(self) -> dict[str, Any]:
        """What counting the staged coverage will add (``trained``, ``new``,
        ``unattributed``) and each ledger's summary then (``summaries``, by fingerprint)."""
        nothing: dict[str, Any] = {"trained": 0, "new": 0, "unattributed": 0, "summaries": {}}
        if not self.staged:
            return nothing
        try:
            return record_trained(self.cache, np.concatenate(list(self.staged.values())),
                                  epoch=self.epoch, job=self.job, commit=False)
        except (OSError, ValueError, lmdb.Error, CacheError) as exc:
            log.warning("epoch %d: could not read the coverage ledger: %s", self.epoch, exc)
            return nothing


def _lane(state: dict[str, Any]) -> dict[str, Any] | None:
    """The lane a loader state's positions count along (see `epochcache.coverage.manifests`)."""
    if "local_rank" not in state:
        return None
    return {"local_rank": int(state["local_rank"]),
            "local_world_size": int(state["local_world_size"]),
            "split": state.get("resumed")}


def coverage_row(cache: SampleStore, spans: TrainedSpans) -> dict[str, Any]:
    """The epoch's line of ``metrics.jsonl`` on coverage: this rank's samples recorded
    (``trained``, ``new``: never trained before) and the cache's coverage after it, summed over
    sources (``covered`` of ``samples``, the epochs-per-sample ``histogram``, ``eta_s``). What
    is staged for the epoch's checkpoint counts as counted (it is, once that is written)."""
    pending = spans.preview()
    report = coverage(cache)
    by_ledger = {row.get("fingerprint"): row for row in report["sources"]}
    for fingerprint, summary in pending["summaries"].items():
        # (a ledger not written yet: one node's, as a new ledger's header says)
        row = by_ledger.setdefault(fingerprint, {"eta_s": None, "num_nodes": 1,
                                                 "estimated": bool(summary.get("estimated"))})
        row.update(samples=int(summary["samples"]), covered=int(summary["covered"]),
                   histogram=bucketed(list(summary["histogram"])))
        row["share"] = math.ceil(row["samples"] / max(1, int(row["num_nodes"])))
    sources = list(by_ledger.values())
    covered = sum(row["covered"] for row in sources)
    samples = sum(row["samples"] for row in sources)
    histogram: dict[str, int] = {}
    for row in sources:
        for label, count in row["histogram"].items():
            histogram[label] = histogram.get(label, 0) + count
    etas = [row["eta_s"] for row in sources]
    return {"trained": spans.trained + pending["trained"], "new": spans.new + pending["new"],
            "covered": covered,
            "samples": samples, "fraction": round(covered / samples, 6) if samples else 0.0,
            # this node's part of the sources, which eta_s is the time to see
            "share": sum(row["share"] for row in sources),
            "num_nodes": max((row["num_nodes"] for row in sources), default=1),
            "estimated": any(row["estimated"] for row in sources),
            "histogram": histogram,
            "eta_s": None if not etas or None in etas else max(etas),
            "unattributed": report["unattributed"] + pending["unattributed"]}
