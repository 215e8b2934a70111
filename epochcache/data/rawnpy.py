"""Raw ``.npy`` records: recognise one by a template, then copy its array with no parsing.

The loader's hot path. A dataset of fixed-shape arrays stores records that differ only in their
key, checksum, timestamp and array data: the codec, flags, key length, the key's ``.npy``
suffix and the whole ``.npy`` header (magic, dtype, shape, padding) are byte-for-byte the same.
So the first record of such a dataset is parsed once into an `NpyTemplate`, and every
later record is checked against it with three cheap comparisons (its length, three header
fields, and the bytes from the key's suffix to the end of the ``.npy`` header) before its data
is copied straight out of the LMDB map. Anything that does not match takes the general decoder,
which names the key on error.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from ..store.records import HEADER, Codec, RecordFlags
from .decode import parse_npy_header

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
