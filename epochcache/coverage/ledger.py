"""The coverage ledger: how many epochs each listed sample of a source was trained in.

**What is counted.** When an epoch ends (or a mid-epoch checkpoint covers part of it), the
trainer hands the sequence numbers it trained on to `record_trained`. Their origin rows
(`origins`) say which listing and which index each came from; the ledger of that source
adds one to a saturating ``uint8`` per listed sample (255 means "255 or more"), once per
sample per call however often it occurs in it. What an *interrupted* epoch trained on is what
a checkpoint covers: ``epochcache run`` records the part of an epoch each mid-epoch checkpoint
covers, once that checkpoint is written (`epochcache.coverage.staged`), so an epoch killed and
resumed counts each of its samples once, whenever the kill came, and a job killed without a
checkpoint counts nothing of its last epoch (its model never kept it either). Each ledger
remembers the staged updates it counted (``applied``, per run), so a retried one counts once.

**Bounded.** One file per source fingerprint, ``<cache>/coverage/<fingerprint>.ledger``: a JSON
header (the listing it indexes, a summary, the last `MAX_UPDATES` updates) and the counts,
one byte per listed sample: 10 MB at ten million keys, read and rewritten whole (atomically,
under ``coverage/ledger.lock``) at each update, so an update costs milliseconds and a killed
process leaves the old ledger or the new one. ``status`` and the metrics read the header only.

**Tar layout.** A ``tar`` listing lists shards; how many samples a shard holds is learnt when it
is fetched (origin rows carry the sample's ordinal in its shard and the shard's count). The
ledger gives each shard a run of slots the first time one of its samples is trained, so counts
stay one byte a *sample*; the total of a source whose shards were not all trained yet is
estimated from the mean of those that were (``estimated`` in the report).

**Listings that change.** A re-list keeps every index (new keys are appended, missing ones
marked gone), so the ledger grows with it. A new *generation* of a listing (a large bucket's
listing finishing, a listing made afresh) orders the keys anew: the sampler that takes it in
while it still holds the old one maps the counts by key (`remap`), and rewrites the
origin rows of the old generation. A ledger found on a generation nobody can map from (the
samplers restarted in between) starts afresh, and keeps the old totals in ``previous``.

**Unattributed.** Samples without an origin (cached by an older version, or put through the
Python API) are counted in ``unattributed``, never an error.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import lmdb
import numpy as np

from ..paths import atomic_write
from ..store.datafile import coverage_dir, ledger_lock
from ..store.origins import UNKNOWN, _Row, read_origins, unique
from ..store.origins import listings as registered_listings
from ..store.plumbing import source_stats
from ..store.records import DB_ORIGINS, seq_key

if TYPE_CHECKING:
    from ..store.sample_store import SampleStore

log = logging.getLogger("epochcache.cache")

UNATTRIBUTED_FILE = "unattributed.json"
LEDGER_VERSION = 1
_MAGIC = b"EPOCHCACHE-COVERAGE\n"
#: Updates kept in a ledger's header (the growth rate and the plot read them).
MAX_UPDATES = 2000
#: The highest count: "trained in this many epochs or more".
SATURATED = 255


def ledger_path(cache_path: str, fingerprint: str) -> str:
    return os.path.join(coverage_dir(cache_path), f"{fingerprint}.ledger")


@dataclass
class Ledger:
    """One source's counts (see the module docstring). ``header`` holds the JSON fields."""

    header: dict[str, Any]
    counts: np.ndarray
    base: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    size: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint32))

    @classmethod
    def new(cls, info: dict[str, Any]) -> Ledger:
        header = {name: info.get(name) for name in ("source", "fingerprint", "generation", "url",
                                                   "unit", "listed", "gone", "node_rank",
                                                   "num_nodes")}
        header.update(version=LEDGER_VERSION, created=time.time(), updates=[], previous=[])
        listed = int(info.get("listed") or 0)
        if info.get("unit") == "shard":
            return cls(header, np.zeros(0, dtype=np.uint8), np.full(listed, -1, dtype=np.int64),
                       np.zeros(listed, dtype=np.uint32))
        return cls(header, np.zeros(listed, dtype=np.uint8))

    @property
    def tar(self) -> bool:
        return self.header.get("unit") == "shard"

    # -- the file ---------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str, header_only: bool = False) -> Ledger | None:
        """The ledger at ``path``; None when there is none (or it is unreadable: logged)."""
        try:
            with open(path, "rb") as f:
                if f.read(len(_MAGIC)) != _MAGIC:
                    raise ValueError("not a coverage ledger")
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
                if header_only:
                    return cls(header, np.empty(0, dtype=np.uint8))
                slots, shards = int(header["slots"]), int(header["shards"])
                counts = np.fromfile(f, dtype=np.uint8, count=slots)
                base = np.fromfile(f, dtype="<i8", count=shards).astype(np.int64)
                sizes = np.fromfile(f, dtype="<u4", count=shards).astype(np.uint32)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("%s: unreadable coverage ledger (%s); it starts afresh", path, exc)
            return None
        if len(counts) != slots or len(base) != shards or len(sizes) != shards:
            log.warning("%s: truncated coverage ledger; it starts afresh", path)
            return None
        return cls(header, counts, base, sizes)

    def save(self, path: str) -> None:
        self.header["slots"], self.header["shards"] = len(self.counts), len(self.base)
        self.header["summary"] = self.summary()
        head = json.dumps(self.header, separators=(",", ":")).encode()
        with atomic_write(path, prefix=".ledger-", suffix=".tmp") as f:
            f.write(_MAGIC + len(head).to_bytes(8, "little") + head)
            f.write(self.counts.tobytes())
            f.write(self.base.astype("<i8").tobytes())
            f.write(self.size.astype("<u4").tobytes())

    # -- counting ---------------------------------------------------------------------------

    def _grow(self, slots: int) -> None:
        if slots > len(self.counts):
            self.counts = np.concatenate([self.counts,
                                          np.zeros(slots - len(self.counts), np.uint8)])

    def _grow_shards(self, shards: int) -> None:
        if shards > len(self.base):
            extra = shards - len(self.base)
            self.base = np.concatenate([self.base, np.full(extra, -1, dtype=np.int64)])
            self.size = np.concatenate([self.size, np.zeros(extra, dtype=np.uint32)])

    def slots_of(self, index: np.ndarray, member: np.ndarray, members: np.ndarray) -> np.ndarray:
        """The count slots of samples (a files sample: its listing index; a tar sample: a slot
        in its shard's run, allocated on first use)."""
        index = index.astype(np.int64)
        if not self.tar:
            if len(index):
                self._grow(int(index.max()) + 1)
            return index
        if not len(index):
            return index
        self._grow_shards(int(index.max()) + 1)
        member = member.astype(np.int64)
        need = np.maximum(members.astype(np.int64), member + 1)
        shards = np.unique(index)
        # A shard's run must hold its largest member ordinal (a shard rewritten larger gets a
        # new run: its old counts go with it).
        most = np.zeros(len(shards), dtype=np.int64)
        np.maximum.at(most, np.searchsorted(shards, index), need)
        for shard, want in zip(shards.tolist(), most.tolist()):
            if self.base[shard] < 0 or self.size[shard] < want:
                old_base, old_size = int(self.base[shard]), int(self.size[shard])
                self.base[shard], self.size[shard] = len(self.counts), want
                self._grow(len(self.counts) + want)
                if old_base >= 0:
                    self.counts[self.base[shard]: self.base[shard] + old_size] = (
                        self.counts[old_base: old_base + old_size])
                    self.counts[old_base: old_base + old_size] = 0
        slots: np.ndarray = self.base[index] + member
        return slots

    def add(self, slots: np.ndarray) -> tuple[int, int]:
        """One more epoch for each of ``slots`` (once each); returns ``(distinct samples,
        samples trained for the first time)``."""
        slots = unique(slots)
        if not len(slots):
            return 0, 0
        before = self.counts[slots]
        self.counts[slots] = np.minimum(before.astype(np.uint16) + 1, SATURATED).astype(np.uint8)
        return len(slots), int(np.count_nonzero(before == 0))

    def remap(self, mapping: np.ndarray, info: dict[str, Any]) -> None:
        """Re-index by ``mapping`` (old index -> new index, -1: not in the new listing) and
        take the new listing's ``info``."""
        length = max(int(info.get("listed") or 0), int(mapping.max(initial=-1)) + 1)

        def moved(old: np.ndarray, fill: int) -> np.ndarray:
            new = np.full(length, fill, dtype=old.dtype)
            keep = np.flatnonzero(mapping[: len(old)] >= 0)
            new[mapping[keep]] = old[keep]
            return new

        if self.tar:
            self.base, self.size = moved(self.base, -1), moved(self.size, 0)
        else:
            self.counts = moved(self.counts, 0)
        self.take_info(info)

    def take_info(self, info: dict[str, Any]) -> None:
        for name in ("source", "generation", "url", "listed", "gone", "node_rank", "num_nodes"):
            if name in info:
                self.header[name] = info[name]
        grow = self._grow_shards if self.tar else self._grow
        grow(int(self.header.get("listed") or 0))

    def restart(self, info: dict[str, Any]) -> None:
        """Start afresh on another listing; the old totals are kept in ``previous``."""
        summary = self.summary()
        self.header.setdefault("previous", []).append({
            "generation": self.header.get("generation"), "until": time.time(),
            "covered": summary["covered"], "samples": summary["samples"]})
        fresh = Ledger.new(info)
        self.counts, self.base, self.size = fresh.counts, fresh.base, fresh.size
        self.take_info(info)

    # -- reporting --------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """``samples`` (listed; estimated for tar until every shard was trained), ``covered``
        (trained at least once) and ``histogram`` (``histogram[k]``: samples trained in ``k``
        epochs, 255 meaning 255 or more; ``histogram[0]`` counts the never-trained)."""
        histogram = np.bincount(self.counts, minlength=SATURATED + 1).astype(np.int64)
        listed = int(self.header.get("listed") or 0)
        estimated = False
        if self.tar:
            known = self.base >= 0
            shards_known = int(np.count_nonzero(known))
            known_samples = int(self.size[known].sum()) if shards_known else 0
            unknown_shards = max(0, max(listed, len(self.base)) - shards_known)
            mean = known_samples / shards_known if shards_known else 0.0
            unseen = round(unknown_shards * mean)
            estimated = unknown_shards > 0
            # Slots left behind by a shard that moved to a larger run are not samples.
            allocated = int(len(self.counts))
            histogram[0] -= allocated - known_samples
            histogram[0] += unseen
            samples = known_samples + unseen
        else:
            samples = max(listed, len(self.counts))
            histogram[0] += samples - len(self.counts)
        covered = int(histogram[1:].sum())
        return {"samples": int(samples), "covered": covered, "estimated": estimated,
                "histogram": histogram.tolist()}

    def note(self, row: dict[str, Any]) -> None:
        updates = self.header.setdefault("updates", [])
        updates.append(row)
        del updates[:-MAX_UPDATES]


# -- recording ----------------------------------------------------------------------------------


def _newest_per_fingerprint(registry: dict[int, dict[str, Any]]) -> dict[str, int]:
    newest: dict[str, int] = {}
    for lid, info in registry.items():
        fp = str(info.get("fingerprint"))
        if fp not in newest or registry[newest[fp]].get("registered", 0) <= info.get(
                "registered", 0):
            newest[fp] = lid
    return newest


def _ingested(cache: SampleStore, source: str) -> int:
    if source:
        return int(source_stats(cache).get(source, {}).get("inserted", 0))
    return cache.counters().inserted


#: Per run, the staged tokens last counted (`epochcache.coverage.staged`), and how many runs are
#: remembered (the least recently counted go first).
APPLIED_PER_RUN = 32
APPLIED_RUNS = 64


def applied(header: dict[str, Any], token: str | None) -> bool:
    """Whether the update named ``token`` was counted in the file ``header`` heads."""
    if token is None:
        return False
    run = (header.get("applied") or {}).get(token.split(".", 1)[0]) or {}
    return token in (run.get("tokens") or [])


def note_applied(header: dict[str, Any], token: str | None) -> None:
    """Remember that the update named ``token`` was counted (a retry then counts nothing)."""
    if token is None:
        return
    runs = header.setdefault("applied", {})
    run = runs.setdefault(token.split(".", 1)[0], {"tokens": []})
    run["time"] = time.time()
    run["tokens"] = [*run["tokens"], token][-APPLIED_PER_RUN:]
    for name in sorted(runs, key=lambda name: runs[name].get("time", 0))[:-APPLIED_RUNS]:
        del runs[name]


def record_trained(cache: SampleStore, seqs: np.ndarray, *, epoch: int | None = None,
                   job: str = "", token: str | None = None,
                   commit: bool = True) -> dict[str, Any]:
    """Count one epoch (or the part of one a checkpoint covers) of ``seqs`` in the ledgers of
    their sources; returns ``{"trained", "new", "unattributed"}`` of this call.

    ``token`` names the update: a ledger that counted it once does not count it again (see
    `epochcache.coverage.staged`). ``commit=False`` counts nothing: it returns what the update
    would count, with ``"summaries"``, each ledger's summary after it by fingerprint.
    """
    seqs = np.asarray(seqs, dtype=np.uint64)
    with cache.env.read() as txn:
        rows = read_origins(txn, cache.env.dbs, unique(seqs))
    known = rows.found & (rows.lid != UNKNOWN)
    result: dict[str, Any] = {"trained": 0, "new": 0, "unattributed": 0}
    summaries: dict[str, Any] = {}
    with ledger_lock(cache.path):
        # Under the lock: a sampler registers a listing's new generation and maps the ledger
        # onto it under it too, so a ledger is never found between the two.
        registry = registered_listings(cache.env)
        newest = _newest_per_fingerprint(registry)
        unattributed = int(np.count_nonzero(~known))
        for lid in np.unique(rows.lid[known]).tolist():
            info = registry.get(int(lid))
            mine = known & (rows.lid == lid)
            if info is None:
                unattributed += int(np.count_nonzero(mine))
                continue
            fp = str(info["fingerprint"])
            path = ledger_path(cache.path, fp)
            ledger = Ledger.load(path)
            current = registry[newest[fp]]
            restarted = False
            if ledger is None:
                ledger = Ledger.new(current)
            elif ledger.header.get("generation") != current.get("generation"):
                restarted = True
                log.warning("%s: the coverage of %s restarts: its listing changed (generation %s "
                            "-> %s) while no sampler could map one onto the other", cache.path,
                            info.get("url"), ledger.header.get("generation"),
                            current.get("generation"))
                ledger.restart(current)
            else:
                ledger.take_info(current)
            if info.get("generation") != ledger.header.get("generation"):
                unattributed += int(np.count_nonzero(mine))  # an older listing's indices
                if restarted and commit:
                    ledger.save(path)
                continue
            if applied(ledger.header, token):
                continue  # a retry of an update this ledger counted (staged.commit)
            slots = ledger.slots_of(rows.index[mine], rows.member[mine], rows.members[mine])
            trained, new = ledger.add(slots)
            summary = ledger.summary()
            summaries[fp] = summary
            result["trained"] += trained
            result["new"] += new
            if not commit:
                continue
            ledger.note({"time": round(time.time(), 6), "epoch": epoch, "job": job,
                         "trained": trained, "new": new, "covered": summary["covered"],
                         "samples": summary["samples"],
                         "ingested": _ingested(cache, str(info.get("source") or ""))})
            note_applied(ledger.header, token)
            ledger.save(path)
        if unattributed and commit:
            _add_unattributed(cache.path, unattributed, token)
        result["unattributed"] = unattributed
    if not commit:
        result["summaries"] = summaries
    return result


def _read_unattributed(cache_path: str) -> dict[str, Any]:
    try:
        with open(os.path.join(coverage_dir(cache_path), UNATTRIBUTED_FILE), "rb") as f:
            found = json.loads(f.read())
        return found if isinstance(found, dict) else {}
    except (OSError, ValueError):
        return {}


def _add_unattributed(cache_path: str, count: int, token: str | None) -> None:
    path = os.path.join(coverage_dir(cache_path), UNATTRIBUTED_FILE)
    found = _read_unattributed(cache_path)
    if applied(found, token):
        return
    found["samples"] = read_unattributed(cache_path) + count
    note_applied(found, token)
    with atomic_write(path, prefix=".unattributed-", suffix=".tmp") as f:
        f.write(json.dumps(found).encode())


def read_unattributed(cache_path: str) -> int:
    try:
        return int(_read_unattributed(cache_path).get("samples", 0))
    except (TypeError, ValueError):
        return 0


# -- a listing's new generation -----------------------------------------------------------------


def remap(cache: SampleStore, old: dict[str, Any], new: dict[str, Any], old_lid: int,
          mapping: np.ndarray) -> int:
    """A sampler took in a new generation of a listing while holding the old one: register
    the new one, re-index the ledger (if it is on the old generation) and the origin rows of
    the old generation, by ``mapping`` (old index -> new index, -1 for keys the new listing
    lacks); return the new listing's id."""
    from ..store.origins import register_listing

    fp = str(new["fingerprint"])
    path = ledger_path(cache.path, fp)
    with ledger_lock(cache.path):
        new_lid = register_listing(cache.env, new)
        ledger = Ledger.load(path)
        if ledger is not None and ledger.header.get("generation") == old.get("generation"):
            ledger.remap(mapping, new)
            ledger.save(path)
            log.info("%s: the coverage of %s follows its new listing (%d keys mapped)",
                     cache.path, new.get("url"), int(np.count_nonzero(mapping >= 0)))
    retag_origins(cache, old_lid, new_lid, mapping)
    return new_lid


def retag_origins(cache: SampleStore, old_lid: int, new_lid: int, mapping: np.ndarray) -> int:
    """Rewrite the origin rows naming listing ``old_lid`` to name ``new_lid`` at the mapped
    indices (in short write transactions); return the samples retagged."""
    db = cache.env.dbs.get(DB_ORIGINS)
    if db is None:
        return 0
    changed = 0
    position = 0
    while True:
        def run(txn: lmdb.Transaction) -> tuple[int, int | None]:
            done = 0
            cursor = txn.cursor(db=db)
            if not cursor.set_range(seq_key(position)):  # noqa: B023 - run at once, per round
                return 0, None
            for rows_seen, (key, value) in enumerate(cursor.iternext()):
                if rows_seen >= 256:  # short transactions: samplers commit meanwhile
                    return done, int.from_bytes(bytes(key), "big")
                raw = bytearray(bytes(value))
                row = _Row(0, bytes(raw))
                hit = np.flatnonzero(row.lid == old_lid)
                if not len(hit):
                    continue
                lid = row.lid.copy()
                index = row.index.copy()
                old_index = index[hit].astype(np.int64)
                inside = old_index < len(mapping)
                target = np.full(len(hit), -1, dtype=np.int64)
                target[inside] = mapping[old_index[inside]]
                lid[hit] = np.where(target >= 0, new_lid, UNKNOWN)
                index[hit] = np.where(target >= 0, target, 0).astype(np.uint64)
                at = 8  # after the row head: lids, then indices
                raw[at: at + 2 * row.n] = lid.astype("<u2").tobytes()
                raw[at + 2 * row.n: at + 10 * row.n] = index.astype("<u8").tobytes()
                txn.put(bytes(key), bytes(raw), db=db)
                done += len(hit)
            return done, None

        count, position_next = cache.env.write(run)
        changed += count
        if position_next is None:
            return changed
        position = position_next


def ledgers(cache_path: str, header_only: bool = True) -> list[Ledger]:
    """Every ledger of the cache (headers only by default: what reports need)."""
    directory = coverage_dir(cache_path)
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    out = []
    for name in names:
        if name.endswith(".ledger"):
            ledger = Ledger.load(os.path.join(directory, name), header_only=header_only)
            if ledger is not None:
                out.append(ledger)
    return out

