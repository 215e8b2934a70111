"""The origins a sampler records with each commit: which listing, which index, which member.

The sampler knows where every sample it fetched comes from: the listing its feed samples and
the index of the ref it picked there (for a ``tar`` sample, the shard's index, and the sample's
ordinal among the samples the shard yielded). `OriginTagger` registers each listing
with the cache (`epochcache.store.listings`), hands the committer an
`Origin` per sample, and when a feed takes in a new generation
of its listing maps the coverage ledger and the old generation's origin rows onto it by key
(`index_map`, `epochcache.coverage.ledger.remap`). Cost per batch: a dict of the
batch's samples; per listing change: one write transaction (a new generation: a sort of both
listings' keys, as a re-list's merge does).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..coverage.ledger import remap
from ..store import SampleStore
from ..store.listings import register_listing
from ..store.origins import Origin
from .layouts import KeyTable, Piece, SampleRef, source_fingerprint
from .lineage import identity_key

if TYPE_CHECKING:
    from .feed import Feed

log = logging.getLogger(__name__)


def index_map(old: KeyTable, new: KeyTable) -> np.ndarray:
    """For each index of ``old``, the index of the same key in ``new`` (-1: not there)."""
    old_keys, new_keys = old.key_bytes(), new.key_bytes()
    width = max(1, max(map(len, old_keys), default=1), max(map(len, new_keys), default=1))
    # Fixed-width byte strings: numpy sorts and searches them in C (keys hold no NUL byte).
    old_arr = np.array(old_keys, dtype=f"S{width}")
    new_arr = np.array(new_keys, dtype=f"S{width}")
    del old_keys, new_keys
    if not len(new_arr):
        return np.full(len(old_arr), -1, dtype=np.int64)
    order = np.argsort(new_arr, kind="stable")
    sorted_new = new_arr[order]
    pos = np.minimum(np.searchsorted(sorted_new, old_arr), len(sorted_new) - 1)
    found = sorted_new[pos] == old_arr
    return np.where(found, order[pos], -1).astype(np.int64)


@dataclass
class _Seen:
    state: tuple[Any, ...]
    table: KeyTable
    lid: int
    info: dict[str, Any]


class OriginTagger:
    """Origins of a sampler's samples (see the module docstring).

    Args:
        cache: the sampler's store.
        node: ``(node_rank, num_nodes)`` of this daemon (its partition of each listing).
    """

    def __init__(self, cache: SampleStore, node: tuple[int, int]) -> None:
        self.cache = cache
        self.node_rank, self.num_nodes = node
        self._seen: dict[int, _Seen] = {}
        self._names: dict[int, tuple[str, str]] = {}

    def _info(self, feed: Feed) -> dict[str, Any]:
        known = self._names.get(id(feed))
        if known is None:
            spec = feed.source.spec
            known = self._names[id(feed)] = (source_fingerprint(spec), identity_key(spec))
        fingerprint, identity = known
        return {"source": feed.name, "fingerprint": fingerprint, "generation": feed.generation,
                "url": feed.source.url, "unit": feed.source.unit, "listed": len(feed.table),
                "gone": len(feed.gone), "complete": feed.complete, "node_rank": self.node_rank,
                "num_nodes": self.num_nodes, "identity": identity}

    def listing_id(self, feed: Feed) -> int:
        """The id of the listing ``feed`` samples now, registered (or brought up to date)."""
        state = (feed.generation, len(feed.table), len(feed.gone), feed.complete)
        seen = self._seen.get(id(feed))
        if seen is not None and seen.state == state:
            return seen.lid
        info = self._info(feed)
        if seen is not None and seen.info["generation"] != feed.generation:
            mapping = index_map(seen.table, feed.table)
            lid = remap(self.cache, seen.info, info, seen.lid, mapping)
        else:
            lid = register_listing(self.cache.env, info)
        self._seen[id(feed)] = _Seen(state, feed.table, lid, info)
        return lid

    def origins(self, feed: Feed, refs: Sequence[SampleRef], indices: Sequence[int],
                results: Sequence[tuple[SampleRef, Any]], generation: str) -> dict[str, Origin]:
        """The origin of each fetched sample, by cache key. ``refs`` were picked at
        ``indices`` of the listing of ``generation``; a batch picked from a listing the feed
        has left since gets none (its samples are unattributed)."""
        lid = self.listing_id(feed)
        if generation != feed.generation:
            return {}
        index_of = dict(zip((ref.key for ref in refs), indices))
        out: dict[str, Origin] = {}
        if feed.source.unit == "sample":
            for ref, payload in results:
                i = index_of.get(ref.key)
                if i is not None and not isinstance(payload, BaseException):
                    out[feed.cache_key(ref.key)] = Origin(lid, int(i))
            return out
        members: dict[str, int] = {}  # a shard's results hold every sample (STREAMED too)
        for ref, _payload in results:
            if ref.shard is not None:
                members[ref.shard] = members.get(ref.shard, 0) + 1
        ordinal: dict[str, int] = {}
        for ref, payload in results:
            shard = ref.shard
            if shard is None:
                continue
            member = ordinal.get(shard, 0)
            ordinal[shard] = member + 1
            i = index_of.get(shard)
            if i is not None and not isinstance(payload, BaseException):
                out[feed.cache_key(ref.key)] = Origin(lid, int(i), member, members[shard])
        return out

    def piece_origins(self, feed: Feed, index: int, generation: str, piece: Piece
                     ) -> dict[str, Origin]:
        """The origin of each sample of a streamed piece of the shard at ``index`` of the
        listing of ``generation`` (see `origins`). Before its last piece a shard's count
        is not known: its samples say the count so far, and the coverage ledger takes the
        largest it sees (`slots_of`)."""
        lid = self.listing_id(feed)
        if generation != feed.generation:
            return {}
        members = piece.members if piece.members is not None else piece.first + len(piece.results)
        return {feed.cache_key(ref.key): Origin(lid, int(index), piece.first + i, members)
                for i, (ref, payload) in enumerate(piece.results)
                if not isinstance(payload, BaseException)}
