"""Raw ``.npy`` records: recognise one by a template, then copy its array with no parsing.

The loader's hot path. A dataset of fixed-shape arrays stores records that differ only in their
key, checksum, timestamp and array data: the codec, flags, key length, the key's ``.npy``
suffix and the whole ``.npy`` header (magic, dtype, shape, padding) are byte-for-byte the same.
So the first record of such a dataset is parsed once into an `NpyTemplate`, and every
later record is checked against it with three cheap comparisons (its length, three header
fields, and the bytes from the key's suffix to the end of the ``.npy`` header) before its data
is copied straight out of the LMDB map. Anything that does not match takes the general decoder,
which names the key on error.

Raw multi-field records (``{npy, cls}``, ``{npy, json}``) take the same path field by field,
into per-field batch tensors with no per-sample dict. A WebDataset-style dataset stores
records that differ only in their key, checksum, timestamp, array data and the *contents* of
their small fields (a label's digits, a JSON document): the codec, flags, key length, the field
table's names and the array fields' lengths and ``.npy`` headers are byte-for-byte the same. The
first such record is parsed once into a `FieldsTemplate`; every later one is checked
with one struct unpack and one tuple compare, its variable lengths read from the same unpack.
Then each array field costs one copy into its batch tensor, each integer label one copy of its
digits into a fixed-width buffer (all labels of the batch are converted by one numpy
expression at the end), each JSON field one ``json.loads``. Anything that does not match takes
the general decoder, which names the key on error.
"""

from __future__ import annotations

import json
import operator
import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..store.records import HEADER, Codec, RecordFlags, field_spans
from ..store.records import source_key as _source_key
from .collate import alloc_batch, collate_samples
from .decode import _INT_EXTS, extensions, parse_npy_header
from .fields import KEY_FIELD, Selection, resolve

#: codec, flags and key length of a record header (the fields a template pins).
_FIELDS = struct.Struct("<xBH20xH")
assert _FIELDS.size == HEADER.size

_SUFFIX = b".npy"


class NpyTemplate:
    """What every raw ``.npy`` record of one array shape and key length has in common.

    A record ``r`` matches when ``len(r) == size`` and ``check(r) == expect``: one C call
    compares its header fields (``head``) and the bytes from the key's suffix to the end of the
    ``.npy`` header (``r[lo:hi]``). Its array data is then ``r[hi:]``, ``nbytes`` long.
    """

    __slots__ = ("size", "head", "lo", "hi", "dtype", "shape", "nbytes", "flat", "check",
                 "expect")

    def __init__(self, record: memoryview, key_len: int, header_len: int, dtype: np.dtype[Any],
                 count: int, shape: tuple[int, ...], nbytes: int) -> None:
        self.lo = HEADER.size + key_len - len(_SUFFIX)
        self.hi = HEADER.size + key_len + header_len
        self.size = self.hi + nbytes
        self.head = _FIELDS.unpack_from(record)
        self.dtype, self.shape, self.nbytes = dtype, shape, nbytes
        self.flat = shape == (count,)
        self.check = struct.Struct(
            f"{_FIELDS.format}{self.lo - HEADER.size}x{self.hi - self.lo}s").unpack_from
        self.expect = (*self.head, bytes(record[self.lo : self.hi]))

    @classmethod
    def of(cls, record: memoryview) -> NpyTemplate | None:
        """The template of ``record`` if it is a raw, plain ``.npy`` array under a ``.npy`` key."""
        if len(record) < HEADER.size:
            return None
        codec, flags, key_len = _FIELDS.unpack_from(record)
        if codec != Codec.RAW or flags & RecordFlags.FIELDS or key_len < len(_SUFFIX):
            return None
        start = HEADER.size + key_len
        if bytes(record[start - len(_SUFFIX) : start]).lower() != _SUFFIX:
            return None
        try:
            header = parse_npy_header(record[start:])
        except ValueError:
            return None  # the general decoder reports it with the key
        if header.dtype.hasobject or header.fortran or len(record) - start != (
                header.offset + header.nbytes):
            return None
        return cls(record, key_len, header.offset, header.dtype, header.count, header.shape,
                   header.nbytes)

    def matches(self, record: memoryview) -> bool:
        return len(record) == self.size and self.check(record) == self.expect

    def same_array(self, other: NpyTemplate) -> bool:
        """Whether records of ``other`` hold arrays of the same dtype and shape."""
        return self.shape == other.shape and self.dtype == other.dtype

    def array(self, record: memoryview) -> np.ndarray:
        """A copy of a matching record's array (it must outlive the read transaction)."""
        # Slicing the view first is cheaper than frombuffer's count/offset arguments.
        flat = np.frombuffer(record[self.hi :], self.dtype)
        return flat.copy() if self.flat else flat.reshape(self.shape).copy()


fields_of = _FIELDS.unpack_from


_H = HEADER.size
ARRAY, INT, JSON, KEY, OTHER = range(5)
#: Label digits kept per record (int64 holds 18 decimal digits safely).
LABEL_WIDTH = 18
_POW10 = 10 ** np.arange(LABEL_WIDTH - 1, -1, -1, dtype=np.int64)


class Mismatch(Exception):
    """The record (or the batch) does not fit the template: take the general path."""


def _kind(name: str) -> int:
    exts = extensions(name, True)
    if exts[-1] == "npy":
        return ARRAY
    if exts[-1] in _INT_EXTS:
        return INT
    if exts[-1] == "json":
        return JSON
    return OTHER


def _tuple_getter(indices: Sequence[int]) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    if len(indices) == 1:
        (index,) = indices
        return lambda values: (values[index],)
    if not indices:
        return lambda values: ()
    return operator.itemgetter(*indices)


class _Out:
    """One output of the batch: a field's kind and where its bytes lie in a record."""

    __slots__ = ("dtype", "hdr", "hlen", "kind", "name", "nbytes", "shape", "start", "var")

    def __init__(self, name: str, kind: int, start: int, var: int) -> None:
        self.name, self.kind, self.start, self.var = name, kind, start, var
        self.hdr, self.hlen, self.nbytes = b"", 0, 0
        self.dtype: np.dtype[Any] | None = None
        self.shape: tuple[int, ...] = ()


class FieldsTemplate:
    """What every raw multi-field record of one layout has in common.

    A record matches when ``fixed(unpack(r)) == expect`` and its length is ``size`` plus its
    variable fields' lengths (``varlens(unpack(r))``). A field's value starts at ``start``
    plus the lengths of the first ``var`` variable fields.
    """

    def __init__(self, record: memoryview, selection: Selection | None) -> None:
        codec, flags, key_len = fields_of(record)
        if codec != Codec.RAW or not flags & RecordFlags.FIELDS:
            raise Mismatch
        base = _H + key_len
        spans, table_end = field_spans(record[base:])
        names = [name for name, _start, _len in spans]
        chosen = names if selection is None else resolve(names, selection, "")
        self.tuple = selection is not None
        kinds = {name: _kind(name) for name in names}
        # Pinned byte ranges and the offsets of variable lengths (u64), absolute in the record:
        # the table's magic, count, name lengths and names, the chosen arrays' value lengths
        # and .npy headers (those at fixed offsets); every other field's length varies.
        pinned: list[tuple[int, int]] = [(base, base + 8)]
        varying: list[int] = []
        entry = base + 8
        for name, _start, _length in spans:
            name_len = len(name.encode("utf-8"))
            pinned.append((entry, entry + 2))
            if kinds[name] == ARRAY and name in chosen:
                pinned.append((entry + 2, entry + 10))
            else:
                varying.append(entry + 2)
            pinned.append((entry + 10, entry + 10 + name_len))
            entry += 10 + name_len
        pos, var, static = base + table_end, 0, True
        outs: dict[str, _Out] = {}
        for name, start, length in spans:
            if name in chosen and kinds[name] == OTHER:
                raise Mismatch  # a field only the general decoder knows
            out = _Out(name, kinds[name] if name in chosen else OTHER, pos, var)
            if out.kind == ARRAY:
                header = parse_npy_header(record[base + start : base + start + length])
                if (header.dtype.hasobject or header.fortran
                        or header.offset + header.nbytes != length):
                    raise Mismatch
                out.hdr = bytes(record[base + start : base + start + header.offset])
                out.hlen, out.nbytes = header.offset, header.nbytes
                out.dtype, out.shape = header.dtype, header.shape
                if static:  # later headers are compared on their own (FieldsBatch.add)
                    pinned.append((pos, pos + header.offset))
                pos += length
            else:
                static, var = False, var + 1
            outs[name] = out
        fmt, fixed, lengths = self._layout(pinned, varying)
        self.unpack = struct.Struct(fmt).unpack_from
        self.fixed = _tuple_getter(fixed)
        self.varlens = _tuple_getter(lengths)
        self.expect = self.fixed(self.unpack(record))
        self.size = pos
        self.outs = [outs[name] if name != KEY_FIELD or name in outs else _Out(name, KEY, 0, 0)
                     for name in chosen]
        # The common shape gets a loop of its own (see FieldsBatch.fill): arrays at fixed
        # offsets and one field of variable length (a label, a JSON document) after them.
        variable_outs = [o for o in self.outs if o.kind in (INT, JSON)]
        self.simple = (len(lengths) == 1 and len(variable_outs) <= 1
                       and all(o.var == 0 for o in self.outs if o.kind == ARRAY))
        self.var_index = lengths[0] if self.simple else -1
        # FieldsBatch.fill's plan: (output, data offset, bytes) per array; the output of the
        # variable field, if it is chosen, and where it starts; the outputs of __key__.
        self.arrays = [(i, o.start + o.hlen, o.nbytes) for i, o in enumerate(self.outs)
                       if o.kind == ARRAY]
        self.var_outs = [(i, o.kind, o.start) for i, o in enumerate(self.outs)
                         if o.kind in (INT, JSON)]
        self.key_outs = [i for i, o in enumerate(self.outs) if o.kind == KEY]
        self.signature = (self.tuple, tuple((o.name if not self.tuple else "", o.kind, o.shape,
                                             str(o.dtype)) for o in self.outs))

    @staticmethod
    def _layout(pinned: list[tuple[int, int]], varying: list[int]
                ) -> tuple[str, list[int], list[int]]:
        """One struct format reading the header fields, each run of pinned bytes as one
        string and each variable length as a u64; and which items are which."""
        runs: list[list[int]] = []
        for lo, hi in sorted(pinned):
            if runs and runs[-1][1] == lo:
                runs[-1][1] = hi
            else:
                runs.append([lo, hi])
        items = sorted([(lo, hi, True) for lo, hi in runs]
                       + [(at, at + 8, False) for at in varying])
        fmt, cursor, fixed = [_FIELDS.format], _H, [0, 1, 2]
        lengths: list[int] = []
        for lo, hi, is_pinned in items:
            fmt.append(f"{lo - cursor}x" if lo > cursor else "")
            fmt.append(f"{hi - lo}s" if is_pinned else "Q")
            (fixed if is_pinned else lengths).append(len(fixed) + len(lengths))
            cursor = hi
        return "".join(fmt), fixed, lengths

    def lengths(self, record: memoryview) -> tuple[int, ...] | None:
        """The variable fields' lengths if ``record`` matches, else None."""
        try:
            values = self.unpack(record)
        except struct.error:  # shorter than the template
            return None
        if self.fixed(values) != self.expect:
            return None
        lengths = self.varlens(values)
        if len(record) != self.size + sum(lengths):
            return None
        return lengths


class FieldsBatch:
    """Per-field buffers of one batch being filled record by record."""

    def __init__(self, template: FieldsTemplate, batch: int) -> None:
        self.template, self.batch = template, batch
        self.columns: list[Any] = []
        for out in template.outs:
            if out.kind == ARRAY:
                tensor = alloc_batch((batch, *out.shape), out.dtype)  # type: ignore[arg-type]
                self.columns.append((tensor, memoryview(tensor.numpy()).cast("B")))  # type: ignore[arg-type]
            elif out.kind == INT:
                self.columns.append(bytearray(b"0" * (LABEL_WIDTH * batch)))
            else:
                self.columns.append([])

    def fill(self, get: Callable[..., Any], db: Any, keys: Sequence[bytes],
             records: list[memoryview | None], act: Any) -> int:
        """Read and copy records of a simple template's layout in one tight loop, appending
        each record read to ``records``; returns how many were copied. It stops at the first
        record that is missing (None) or does not match: the caller goes on from there.
        """
        template = self.template
        unpack, fixed, expect, size = template.unpack, template.fixed, template.expect, template.size
        vi, columns = template.var_index, self.columns
        view, lo, nbytes = (columns[template.arrays[0][0]][1], *template.arrays[0][1:]) \
            if template.arrays else (None, 0, 0)
        more = [(columns[i][1], start, count) for i, start, count in template.arrays[1:]]
        labels = docs = None
        var_start = 0
        for i, kind, var_start in template.var_outs:  # noqa: B007 - the last one is kept
            labels, docs = (columns[i], None) if kind == INT else (None, columns[i])
        names = [columns[i] for i in template.key_outs]
        hi, pos, end, width = lo + nbytes, 0, 0, LABEL_WIDTH
        append = records.append
        # One get, one unpack, one compare and one copy per record (plus a label's digits):
        # this loop is the multi-field loader's throughput (scripts/bench_loader.py).
        for lmdb_key in keys:
            if act is not None:
                act.key = lmdb_key
            record = get(lmdb_key, None, db)
            append(record)
            if record is None:
                return len(records) - 1
            try:
                values = unpack(record)
            except struct.error:
                return len(records) - 1
            if fixed(values) != expect:
                return len(records) - 1
            length = values[vi]
            if len(record) != size + length:
                return len(records) - 1
            if view is not None:
                view[pos : pos + nbytes] = record[lo:hi]
                if more:
                    i = pos // nbytes
                    for other, start, count in more:
                        other[i * count : (i + 1) * count] = record[start : start + count]
                pos += nbytes
            end += width
            if labels is not None:
                if not 0 < length <= width:
                    raise Mismatch
                labels[end - length : end] = record[var_start : var_start + length]
            elif docs is not None:
                try:
                    docs.append(json.loads(bytes(record[var_start : var_start + length])))
                except ValueError as exc:
                    raise Mismatch from exc
            for column in names:
                column.append(_source_key(record))
        return len(records)

    def add(self, i: int, record: memoryview, template: FieldsTemplate,
            lengths: tuple[int, ...], key: Callable[[memoryview], str]) -> None:
        """Copy record ``i``'s fields; ``template`` must have this batch's signature."""
        for column, out in zip(self.columns, template.outs):
            start = out.start + sum(lengths[: out.var]) if out.var else out.start
            kind = out.kind
            if kind == ARRAY:
                if out.var and record[start : start + out.hlen] != out.hdr:
                    raise Mismatch
                nbytes = out.nbytes
                column[1][i * nbytes : (i + 1) * nbytes] = record[start + out.hlen :
                                                                  start + out.hlen + nbytes]
            elif kind == INT:
                length = lengths[out.var]
                if not 0 < length <= LABEL_WIDTH:
                    raise Mismatch
                end = (i + 1) * LABEL_WIDTH
                column[end - length : end] = record[start : start + length]
            elif kind == JSON:
                try:
                    column.append(json.loads(bytes(record[start : start + lengths[out.var]])))
                except ValueError as exc:
                    raise Mismatch from exc
            else:
                column.append(key(record))

    def finish(self) -> Any:
        values = []
        for column, out in zip(self.columns, self.template.outs):
            if out.kind == ARRAY:
                values.append(column[0])
            elif out.kind == INT:
                digits = np.frombuffer(column, np.uint8).reshape(self.batch, LABEL_WIDTH) - 48
                if (digits > 9).any():  # not all digits (a sign, spaces): the general path
                    raise Mismatch
                values.append(torch.from_numpy(digits.astype(np.int64) @ _POW10))
            elif out.kind == JSON:
                values.append(collate_samples(column))
            else:
                values.append(list(column))
        if self.template.tuple:
            return tuple(values)
        return {out.name: value for out, value in zip(self.template.outs, values)}
