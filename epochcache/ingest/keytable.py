"""A listing held compactly: every key in one UTF-8 blob with offsets, sizes in a numpy array.

A bucket of ten million objects listed as one `SampleRef` per key costs ~250
bytes a key in every process that holds it (the object, its key string, the list slot), and
as much again while it is parsed. A `KeyTable` holds the same refs in a few arrays:

* ``blob``: the keys' UTF-8 bytes one after another, ``offsets`` (``n + 1``) where each starts
  (``uint32`` while the blob is under 4 GiB);
* ``sizes``: ``int32`` (``int64`` if an object is 2 GiB or more), ``-1`` where no size was
  listed;
* ``weights`` (``float64``, NaN for none) and ``checksums`` (a second blob with offsets) only
  when some ref has one (manifests).

So a key costs its length plus 8 bytes (plus 8 with weights). `SampleRef` objects are
made only for the keys a sampler picks (`KeyTable.ref`). Tables are built with a
`KeyTableBuilder` (listing pages, manifest rows), and sorted, merged and saved as arrays.
"""

from __future__ import annotations

import itertools
import math
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from .types import SampleRef

#: Offsets are 4 bytes while the blob is smaller than this.
_U32_LIMIT = 2**32 - 1


def _offsets(ends: Sequence[int] | np.ndarray, total: int) -> np.ndarray:
    dtype = np.uint32 if total <= _U32_LIMIT else np.uint64
    out = np.empty(len(ends) + 1, dtype=dtype)
    out[0] = 0
    out[1:] = np.asarray(ends, dtype=np.uint64)
    return out


def offsets_of(lengths: np.ndarray, total: int) -> np.ndarray:
    """Offsets (``n + 1``) of strings of ``lengths`` whose bytes add up to ``total``, summed
    straight into the smallest dtype (no 8-byte-a-key array on the way)."""
    dtype = np.uint32 if total <= _U32_LIMIT else np.uint64
    out = np.empty(len(lengths) + 1, dtype=dtype)
    out[0] = 0
    np.cumsum(lengths, dtype=dtype, out=out[1:])
    return out


def compact_sizes(sizes: np.ndarray) -> np.ndarray:
    """``sizes`` as ``int32`` when every size fits (-1: unknown), else ``int64``: 4 bytes a key
    less for the usual objects under 2 GiB."""
    if len(sizes) and int(sizes.max()) >= 2**31:
        return sizes.astype(np.int64, copy=False)
    return sizes.astype(np.int32, copy=False)


def _gather(blob: bytes, offsets: np.ndarray, idx: np.ndarray) -> tuple[bytes, np.ndarray]:
    """The byte strings at ``idx`` of a blob with offsets, as a new blob with offsets: copied
    in C a block at a time (no Python object per key, at most ~8 MiB of positions at once)."""
    starts = offsets[:-1][idx].astype(np.int64)
    lengths = offsets[1:][idx].astype(np.int64) - starts
    total = int(lengths.sum())
    new_offsets = offsets_of(lengths, total)
    out = np.empty(total, dtype=np.uint8)
    source = np.frombuffer(blob, dtype=np.uint8)
    ends = np.cumsum(lengths)
    lo = 0
    while lo < len(idx):
        # as many keys as hold about a MiB (at least one)
        hi = max(lo + 1, int(np.searchsorted(ends, int(ends[lo]) + (1 << 20), side="right")))
        begin = int(new_offsets[lo])
        size = int(new_offsets[hi]) - begin
        if size:
            shift = np.repeat(starts[lo:hi] - new_offsets[lo:hi].astype(np.int64),
                              lengths[lo:hi])
            out[begin : begin + size] = source[np.arange(begin, begin + size) + shift]
        lo = hi
    return out.tobytes(), new_offsets


def _same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return bool(np.array_equal(a, b, equal_nan=True))


@dataclass(frozen=True, eq=False)
class KeyTable:
    """Refs by index (see the module docstring). Indices are positions in the listing.

    Attributes:
        blob: every key's UTF-8 bytes, in index order.
        offsets: ``n + 1`` positions into ``blob``; key ``i`` is ``blob[offsets[i]:offsets[i+1]]``.
        sizes: listed size of each key, ``-1`` when unknown (``int32`` while all fit).
        weights: manifest weight of each key (NaN: none given), or None when no key has one.
        checksums: ``(blob, offsets)`` of the manifest checksums ("" for none), or None.
    """

    blob: bytes
    offsets: np.ndarray
    sizes: np.ndarray
    weights: np.ndarray | None = None
    checksums: tuple[bytes, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def nbytes(self) -> int:
        """Bytes the table holds (what a process pays for the listing)."""
        extra = 0 if self.weights is None else self.weights.nbytes
        if self.checksums is not None:
            extra += len(self.checksums[0]) + self.checksums[1].nbytes
        return len(self.blob) + self.offsets.nbytes + self.sizes.nbytes + extra

    # -- reading ----------------------------------------------------------------------------

    def key(self, i: int) -> str:
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.blob[start:end].decode("utf-8")

    def keys(self, lo: int = 0, hi: int | None = None) -> list[str]:
        """The keys of indices ``lo .. hi - 1`` (a Python string each: for a block, not all)."""
        hi = len(self) if hi is None else hi
        bounds = self.offsets[lo : hi + 1].tolist()
        blob = self.blob
        return [blob[a:b].decode("utf-8") for a, b in itertools.pairwise(bounds)]

    def keys_at(self, indices: Sequence[int] | np.ndarray) -> list[str]:
        """The keys of ``indices`` (a batch: their offsets are read in one numpy step)."""
        idx = np.asarray(indices, dtype=np.int64)
        starts, ends = self.offsets[idx].tolist(), self.offsets[idx + 1].tolist()
        blob = self.blob
        return [blob[a:b].decode("utf-8") for a, b in zip(starts, ends)]

    def key_bytes(self) -> list[bytes]:
        """Every key as bytes (transient: for sorting and merging)."""
        bounds = self.offsets.tolist()
        blob = self.blob
        return [blob[a:b] for a, b in itertools.pairwise(bounds)]

    def ref(self, i: int) -> SampleRef:
        """The `SampleRef` of index ``i`` (made on demand)."""
        size = int(self.sizes[i])
        weight = None
        if self.weights is not None:
            value = float(self.weights[i])
            weight = None if math.isnan(value) else value  # NaN: no weight given
        checksum = self.checksum_bytes(i).decode("ascii") or None
        return SampleRef(self.key(i), None if size < 0 else size, weight, checksum)

    def checksum_bytes(self, i: int) -> bytes:
        """The manifest checksum of index ``i`` (empty: none)."""
        if self.checksums is None:
            return b""
        blob, offsets = self.checksums
        return blob[int(offsets[i]) : int(offsets[i + 1])]

    def refs(self, indices: Iterable[int] | None = None) -> list[SampleRef]:
        """Refs of ``indices`` (default all: only for small tables and tests)."""
        return [self.ref(int(i)) for i in (range(len(self)) if indices is None else indices)]

    def known_sizes(self, limit: int = 1000) -> np.ndarray:
        """The listed sizes among the first ``limit`` keys (for size estimates)."""
        head = self.sizes[:limit]
        known: np.ndarray = head[head > 0]
        return known

    def weights_or_ones(self) -> np.ndarray:
        """One weight per key, 1.0 where none was given."""
        if self.weights is None:
            return np.ones(len(self), dtype=np.float64)
        return np.where(np.isnan(self.weights), 1.0, self.weights)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KeyTable):
            return NotImplemented
        mine, theirs = self.checksums, other.checksums
        return (len(self) == len(other) and self.blob == other.blob
                and bool(np.array_equal(self.offsets, other.offsets))
                and bool(np.array_equal(self.sizes, other.sizes))
                and _same(self.weights, other.weights)
                and (mine is None) == (theirs is None)
                and (mine is None or theirs is None
                     or (mine[0] == theirs[0] and bool(np.array_equal(mine[1], theirs[1])))))

    def __repr__(self) -> str:
        return f"KeyTable({len(self)} keys, {self.nbytes} bytes)"

    # -- reshaping ----------------------------------------------------------------------------

    def take(self, indices: np.ndarray | Sequence[int]) -> KeyTable:
        """A new table of the refs at ``indices``, in that order."""
        idx = np.asarray(indices, dtype=np.int64)
        blob, offsets = _gather(self.blob, self.offsets, idx)
        checksums = None
        if self.checksums is not None:
            checksums = _gather(self.checksums[0], self.checksums[1], idx)
        weights = None if self.weights is None else self.weights[idx]
        return KeyTable(blob, offsets, self.sizes[idx], weights, checksums)

    def sort_order(self) -> np.ndarray | None:
        """The permutation that sorts the keys (by UTF-8 bytes, i.e. by code point; stable),
        or None when they are sorted already (listings come sorted from S3).

        numpy sorts fixed-width byte strings in C, ~5x faster than ``sorted()`` on a list of
        keys, but a fixed width is the longest key's: one legal 1 KiB key among 300,000 short
        ones made 300 MiB of each array. So the keys up to `head_width` (about twice the
        mean) are sorted as fixed-width strings, and the few longer ones as Python bytes, then
        merged in: memory follows the keys' bytes, never their count times the longest.
        """
        n = len(self)
        if n < 2:
            return None
        lengths = self.lengths()
        width = head_width(lengths)
        short = np.flatnonzero(lengths <= width)
        heads = key_heads(self.blob, self.offsets, short, width)
        heads_order = np.argsort(heads, kind="stable")
        order = short[heads_order]
        if len(short) < n:
            long_keys = np.flatnonzero(lengths > width)
            bounds = self.offsets
            blob = self.blob
            long_keys = np.array(sorted(long_keys.tolist(), key=lambda i: (
                blob[int(bounds[i]):int(bounds[i + 1])], i)), dtype=np.int64)
            # A long key k sorts after a short key s exactly when k's head does (s holds at
            # most `width` bytes, so the comparison is decided within k's head; on a tie k is
            # the longer): "right" of the heads that equal it.
            at = np.searchsorted(heads, key_heads(self.blob, self.offsets, long_keys, width),
                                 side="right", sorter=heads_order)
            order = np.insert(order, at, long_keys)
        del heads, heads_order
        if bool((order == np.arange(n)).all()):
            return None
        return order

    def lengths(self) -> np.ndarray:
        """Each key's length in bytes."""
        lengths: np.ndarray = np.diff(self.offsets.astype(np.int64))
        return lengths

    def sorted(self) -> KeyTable:
        """This table sorted by key (itself when it is sorted already)."""
        order = self.sort_order()
        return self if order is None else self.take(order)

    @staticmethod
    def concat(tables: Sequence[KeyTable]) -> KeyTable:
        """The tables one after another."""
        if len(tables) == 1:
            return tables[0]
        if all(t.weights is None and t.checksums is None for t in tables):
            # keys and sizes only (listings): one copy of the blobs, arrays joined in C
            blob = b"".join(t.blob for t in tables)
            lengths = np.concatenate([t.lengths() for t in tables])
            sizes = compact_sizes(np.concatenate([t.sizes.astype(np.int64) for t in tables]))
            return KeyTable(blob, offsets_of(lengths, len(blob)), sizes)
        builder = KeyTableBuilder()
        for table in tables:
            builder.extend(table)
        return builder.build()

    @staticmethod
    def from_refs(refs: Iterable[SampleRef]) -> KeyTable:
        builder = KeyTableBuilder()
        for ref in refs:
            builder.add(ref.key, ref.size, ref.weight, ref.checksum)
        return builder.build()


def head_width(lengths: np.ndarray) -> int:
    """The width of the fixed-width heads keys are sorted and compared by: the longest of 99%
    of the keys, at most about twice the mean length, so that the heads never take more
    than twice the keys' bytes (plus 16 bytes a key). Keys longer are few, and handled one by
    one."""
    if not len(lengths):
        return 1
    # the longest of 99% of the keys, at most twice the mean (and 16 bytes)
    usual = int(np.percentile(lengths, 99, method="higher"))
    budget = 2 * int(lengths.sum()) // len(lengths) + 16
    return max(1, min(usual, budget))


def key_heads(blob: bytes, offsets: np.ndarray, indices: np.ndarray, width: int) -> np.ndarray:
    """The first ``width`` bytes of the keys at ``indices`` as a fixed-width ``S{width}`` array
    (a key up to ``width`` bytes is whole in it: keys hold no NUL byte), gathered from the blob
    in C, a block of keys at a time (no Python object per key)."""
    out = np.zeros(len(indices), dtype=f"S{width}")
    if not len(indices):
        return out
    grid = out.view(np.uint8).reshape(len(indices), width)
    source = np.frombuffer(blob, dtype=np.uint8)
    columns = np.arange(width, dtype=np.int64)
    step = max(1, (1 << 18) // width)  # ~2 MiB of positions at a time
    for lo in range(0, len(indices), step):
        part = indices[lo : lo + step]
        starts = offsets[part].astype(np.int64)
        lengths = np.minimum(offsets[part + 1].astype(np.int64) - starts, width)
        inside = columns < lengths[:, None]
        grid[lo : lo + step][inside] = source[(starts[:, None] + columns)[inside]]
    return out


def find_keys(table: KeyTable, wanted: KeyTable) -> np.ndarray:
    """For each key of ``wanted``, the lowest index in ``table`` of an equal key, -1 where
    there is none: a join in C on fixed-width heads (see `KeyTable.sort_order`), with
    the few keys longer than the heads looked up in a dict. Memory follows the keys' bytes
    (a dict of ten million keys would cost gigabytes)."""
    old_lengths, new_lengths = table.lengths(), wanted.lengths()
    width = head_width(np.concatenate([old_lengths, new_lengths]))
    found = np.full(len(wanted), -1, dtype=np.int64)
    old_short = np.flatnonzero(old_lengths <= width)
    new_short = np.flatnonzero(new_lengths <= width)
    if len(old_short) and len(new_short):
        old_heads = key_heads(table.blob, table.offsets, old_short, width)
        order = np.argsort(old_heads, kind="stable")  # equal keys: the lowest index first
        new_heads = key_heads(wanted.blob, wanted.offsets, new_short, width)
        at = order[np.minimum(np.searchsorted(old_heads, new_heads, sorter=order),
                              len(order) - 1)]
        del order
        step = max(1, (1 << 23) // width)  # compared a block at a time: no third array of heads
        for lo in range(0, len(at), step):
            # short keys: equal heads are equal keys
            hit = old_heads[at[lo : lo + step]] == new_heads[lo : lo + step]
            found[new_short[lo : lo + step][hit]] = old_short[at[lo : lo + step][hit]]
        del old_heads, new_heads
    old_long = np.flatnonzero(old_lengths > width)
    new_long = np.flatnonzero(new_lengths > width)
    if len(old_long) and len(new_long):
        index: dict[bytes, int] = {}
        for i in old_long.tolist():
            index.setdefault(table.blob[int(table.offsets[i]) : int(table.offsets[i + 1])], i)
        for j in new_long.tolist():
            key = wanted.blob[int(wanted.offsets[j]) : int(wanted.offsets[j + 1])]
            found[j] = index.get(key, -1)
    return found


class KeyTableBuilder:
    """Collects refs into a `KeyTable` without an object per key: bytes are appended
    to one ``bytearray`` and numbers to ``array`` buffers."""

    def __init__(self) -> None:
        self._blob = bytearray()
        self._ends = array("Q")
        self._sizes = array("q")
        self._weights: array[float] | None = None
        self._checksums: bytearray | None = None
        self._checksum_ends: array[int] | None = None

    def __len__(self) -> int:
        return len(self._ends)

    @property
    def nbytes(self) -> int:
        """Bytes the refs added so far take (keys, checksums, 16 bytes of numbers a ref)."""
        extra = 0 if self._checksums is None else len(self._checksums) + 8 * len(self._ends)
        return len(self._blob) + 16 * len(self._ends) + extra

    def add(self, key: str, size: int | None = None, weight: float | None = None,
            checksum: str | None = None) -> None:
        self.add_bytes(key.encode("utf-8"), -1 if size is None else size, weight,
                       checksum.encode("ascii") if checksum else b"")

    def add_bytes(self, key: bytes, size: int = -1, weight: float | None = None,
                  checksum: bytes = b"") -> None:
        """Add one ref: the key's UTF-8 bytes, its size (-1: unknown), weight and checksum."""
        self._blob += key
        self._ends.append(len(self._blob))
        self._sizes.append(size)
        if weight is not None and not math.isnan(weight) and self._weights is None:
            self._weights = array("d", [float("nan")]) * (len(self._ends) - 1)
        if self._weights is not None:
            self._weights.append(float("nan") if weight is None else weight)
        if checksum and self._checksums is None:
            self._checksums = bytearray()
            self._checksum_ends = array("Q", [0]) * (len(self._ends) - 1)
        if self._checksums is not None:
            assert self._checksum_ends is not None
            self._checksums += checksum
            self._checksum_ends.append(len(self._checksums))

    def extend(self, table: KeyTable) -> None:
        """Append every ref of ``table``."""
        if not (table.weights is None and table.checksums is None
                and self._weights is None and self._checksums is None):
            keys = table.key_bytes()
            for i in range(len(table)):
                self.add_bytes(keys[i], int(table.sizes[i]),
                               None if table.weights is None else float(table.weights[i]),
                               table.checksum_bytes(i))
            return
        base = len(self._blob)
        self._blob += table.blob
        # through the buffer protocol: no Python int per key
        self._ends.frombytes((table.offsets[1:].astype(np.uint64) + np.uint64(base)).tobytes())
        self._sizes.frombytes(table.sizes.astype(np.int64).tobytes())

    def build(self) -> KeyTable:
        """The table of everything added (the builder may go on growing)."""
        ends = np.frombuffer(self._ends, dtype=np.uint64) if self._ends else np.empty(0, np.uint64)
        sizes = compact_sizes(np.frombuffer(self._sizes, dtype=np.int64)) if self._sizes else (
            np.empty(0, dtype=np.int32))
        if sizes.base is not None:  # a view of the builder's buffer: copy what it may reuse
            sizes = sizes.copy()
        weights = None
        if self._weights is not None:
            weights = np.frombuffer(self._weights, dtype=np.float64).copy()
        checksums = None
        if self._checksums is not None and self._checksum_ends is not None:
            checksums = (bytes(self._checksums),
                         _offsets(np.frombuffer(self._checksum_ends, dtype=np.uint64),
                                  len(self._checksums)))
        return KeyTable(bytes(self._blob), _offsets(ends, len(self._blob)), sizes, weights,
                        checksums)
