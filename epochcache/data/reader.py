"""SampleReader: reads and decodes cached samples by sequence number, one or a batch at a time.

The read path is built for batches. `SampleReader.read_batch` reads a whole batch in one
LMDB read transaction and, when the samples are fixed-shape ``.npy`` arrays stored raw, copies
each one straight from the memory map into one preallocated batch tensor: one ``memcpy`` per
sample, no per-sample tensor, no ``default_collate`` stacking, no header parsing (records are
recognised by a template, see `epochcache.data.raw`). In a DataLoader worker that
tensor is allocated in shared memory, so handing it to the trainer costs no further copy.
WebDataset-style records of ``.npy`` arrays with ``.cls`` labels or ``.json`` documents get the
same treatment field by field (`epochcache.data.raw`): one batch tensor per array
field, the labels of a batch converted at once. ``fields=`` selects and orders fields into
tuples (`epochcache.data.fields`) on either path.

A reader pickles as the cache path and its options -- never an LMDB handle: each process opens
an environment of its own on first read (a forked worker too: it never uses the inherited one).

In the loaders of ``epochs()`` a worker writes its batches into shared buffers it reuses from
batch to batch, which the trainer maps once (`epochcache.data.ring`).

What the reader counts for a run's epoch (the figures marked ``tally=True`` in
`epochcache.epoch_record`) it adds to ``self.tallies``, a block the training loop reads
whichever process the reader runs in (`epochcache.data.workers`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
from collections.abc import Sequence
from typing import Any

import lmdb
import numpy as np
import torch
from torch.utils.data import get_worker_info

from ..errors import DecodeError, MissingImageLibrary, PickleNotAllowed
from ..options import ReaderOptions
from ..store import SampleStore
from ..store.env import PROCESS, begin_read, end_read
from ..store.records import (
    DB_SAMPLES,
    HEADER,
    Codec,
    RecordFlags,
    decode_payload,
    seq_keys,
    source_key,
)
from ..store.records import seq_key as _pack_seq
from .collate import SPLIT_BYTES, alloc_rows, collate_samples, copy_rows
from .decode import decode_sample, make_decoder
from .fields import FieldSelector, parse_fields
from .raw import FieldsBatch, FieldsTemplate, Mismatch, NpyTemplate, fields_of
from .stall import Activity, watching
from .workers import Tallies

log = logging.getLogger(__name__)

_H = HEADER.size
_unpack = HEADER.unpack_from
_raw_size = struct.Struct("<8xQ").unpack_from  # a record's payload bytes (HEADER's raw_size)
_RAW, _FIELDS = int(Codec.RAW), int(RecordFlags.FIELDS)


class _Fallback(Exception):
    """The batch is not uniform raw .npy arrays: take the general path."""


class SampleReader:
    """Reads and decodes samples by sequence number; the part of a dataset workers need.

    Args:
        path: the cache directory.
        options: how samples are decoded, transformed and watched
            ([`ReaderOptions`][epochcache.ReaderOptions]; the defaults when None).
    """

    def __init__(self, path: str, options: ReaderOptions | None = None) -> None:
        options = options if options is not None else ReaderOptions()
        self.path = path
        self.options = options
        decode, fields, image = options.decode, options.fields, options.image
        self.decode = decode
        self.fields = None if fields is None else parse_fields(fields)
        self.image = image
        self.max_sample_bytes = options.max_sample_bytes
        self.decoder = (make_decoder(decode, options.allow_pickle, image, self.max_sample_bytes)
                        if fields is None
                        else FieldSelector(fields, decode, options.allow_pickle, image,
                                           self.max_sample_bytes))
        self.transform = options.transform
        self.allow_pickle = options.allow_pickle
        self.on_error = options.on_error
        self.stall_s = options.stall_s
        self.stall_file = options.stall_file
        self.stall_action = options.stall_action
        self.skipped = 0
        #: Where the figures counted here go (a loader's block: `counting`).
        self.tallies = Tallies.local()
        self._fast = decode == "auto" and options.transform is None
        # dataset[i] of a whole sample, decoded by the general rules. It is not watched for
        # stalls: a watch costs ~6 us, as much as reading the sample; DataLoader reads a
        # map-style dataset a batch at a time (__getitems__), and batches are watched.
        self._fast_one = self._fast and fields is None
        self._cache: SampleStore | None = None
        self._pid = -1
        self._env_db: tuple[Any, Any, object] = (None, None, None)
        # Templates of raw .npy samples seen (one per key length, dtype and shape), and the
        # last one used: later samples that match one need no parsing.
        self._templates: dict[tuple[int, int, int], NpyTemplate] = {}
        self._template: NpyTemplate | None = None
        # Templates of raw multi-field records, most recently matched first.
        self._field_templates: list[FieldsTemplate] = []

    def _watching(self, samples: int) -> contextlib.AbstractContextManager[Activity | None]:
        return watching(self.stall_s, f"batch of {samples} samples", self.stall_file,
                        self.stall_action, self.path)

    # -- process-local state ----------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_cache"], state["_pid"], state["skipped"] = None, -1, 0
        state["_env_db"] = (None, None, None)
        state["_templates"], state["_template"] = {}, None
        state["_field_templates"] = []
        return state

    def bind(self, cache: SampleStore) -> None:
        """Use an already open Cache in this process (avoids opening a second handle)."""
        self._cache, self._pid = cache, os.getpid()

    def counting(self, tallies: Tallies) -> SampleReader:
        """A reader like this one that counts into ``tallies`` (a loader's block)."""
        reader = SampleReader(self.path, self.options)
        if self._cache is not None and self._pid == os.getpid():
            reader.bind(self._cache)
        reader.tallies = tallies
        return reader

    @property
    def cache(self) -> SampleStore:
        if self._cache is None or self._pid != os.getpid():
            self._cache, self._pid = SampleStore(self.path), os.getpid()
        return self._cache

    # -- reading ----------------------------------------------------------------------------

    def _missing(self, seq: int) -> KeyError:
        return KeyError(f"sample {seq} is not in the cache at {self.path} (evicted: was the "
                        "epoch's snapshot released before reading it?)")

    def _skip(self, exc: DecodeError) -> None:
        if self.on_error == "raise" or isinstance(exc, (PickleNotAllowed, MissingImageLibrary)):
            raise exc
        self.skipped += 1
        self.tallies.add("skipped", 1)
        log.warning("skipping sample %r (%s); %d skipped in this process", exc.key, exc,
                    self.skipped)

    def _decode_record(self, record: memoryview) -> tuple[str, Any]:
        _v, codec, flags, _crc, _raw_size, _ns, key_len = _unpack(record)
        key = source_key(record)
        try:
            if codec == _RAW and not flags & _FIELDS:
                value: Any = record[_H + key_len :]  # decoders copy out of the map
            else:
                value = decode_payload(record)
        except Exception as exc:  # zstd or field-container damage: name the key
            raise DecodeError(f"sample {key!r}: stored record is damaged: {exc} (run "
                              "`epochcache verify`)", key=key) from exc
        return key, decode_sample(self.decoder, key, value)

    def read_samples(self, seqs: Sequence[int] | np.ndarray,
                     kept: list[int] | None = None) -> list[Any]:
        """Decoded (and transformed) samples; skipped ones are left out under on_error='skip'
        (``kept``, if given, receives the index in ``seqs`` of each sample returned)."""
        keys = seq_keys(np.asarray(seqs, dtype=np.uint64))
        out: list[Any] = []
        names: list[object] = []  # the source keys of ``out``, when a watchdog watches
        decoded = 0
        env, db = self.cache.env, self.cache.env.dbs[DB_SAMPLES]
        with self._watching(len(keys)) as act:
            with env.read() as txn:
                get = txn.get
                for index, lmdb_key in enumerate(keys):
                    record = get(lmdb_key, None, db)
                    if record is None:
                        raise self._missing(int.from_bytes(lmdb_key, "big"))
                    if act is not None:
                        act.key = source_key(record)
                    try:
                        _key, sample = self._decode_record(record)
                    except DecodeError as exc:
                        self._skip(exc)
                        continue
                    decoded += _raw_size(record)[0]
                    if kept is not None:
                        kept.append(index)
                    out.append(sample)
                    if act is not None:
                        names.append(act.key)
            self.tallies.add("decoded_bytes", decoded)
            if self.transform is None:
                pass
            elif act is None:
                out = [self.transform(sample) for sample in out]
            else:  # a report names the sample being transformed
                for index, sample in enumerate(out):
                    act.key = names[index]
                    out[index] = self.transform(sample)
        return out

    def _handles(self) -> tuple[lmdb.Environment, Any]:
        cache = self.cache
        self._env_db = (cache.env.lmdb_env, cache.env.dbs[DB_SAMPLES], PROCESS[0])
        return self._env_db[0], self._env_db[1]

    def read(self, seq: int) -> Any:
        """One sample (None when it was skipped under on_error='skip').

        The per-sample hot path (``dataset[i]``): one short read transaction, and a raw
        ``.npy`` sample that matches the previous one's template is copied once, straight out
        of the map, with no parsing.
        """
        if not self._fast_one:
            samples = self.read_samples([seq])
            return samples[0] if samples else None
        env, db, opened_by = self._env_db
        if opened_by is not PROCESS[0]:
            env, db = self._handles()
        txn = begin_read(env)
        try:
            record = txn.get(_pack_seq(seq), None, db)
            if record is None:
                raise self._missing(seq)
            template = self._template
            if template is not None and template.matches(record):
                return template.array(record)
            template = self._template_of(record)
            if template is not None:
                return template.array(record)
            try:
                return self._decode_record(record)[1]
            except DecodeError as exc:
                self._skip(exc)
                return None
        finally:
            end_read(txn)

    def key_of(self, lmdb_key: bytes) -> str:
        """The source key of the sample stored under ``lmdb_key`` (for stall reports)."""
        with self.cache.env.read() as txn:
            record = txn.get(lmdb_key, db=self.cache.env.dbs[DB_SAMPLES])
            if record is None:
                return f"(sample {int.from_bytes(lmdb_key, 'big')}: no longer cached)"
            return source_key(record)

    def _template_of(self, record: memoryview) -> NpyTemplate | None:
        """The template ``record`` matches (made on first sight), or None if it is not raw .npy."""
        if len(record) >= _H:
            template = self._templates.get(fields_of(record))
            if template is not None and template.matches(record):
                self._template = template
                return template
        template = NpyTemplate.of(record)
        if template is not None:
            if len(self._templates) >= 64:  # odd data must not grow it without bound
                self._templates.clear()
            self._templates[template.head] = self._template = template
        return template

    def read_batch(self, seqs: Sequence[int] | np.ndarray) -> Any:
        """One collated batch: a tensor ``(B, ...)`` for fixed-shape arrays, else collated fields."""
        if self._fast:
            seqs = np.asarray(seqs, dtype=np.uint64)
            try:
                if self._field_templates:  # the last batch was multi-field: try that first
                    return self._read_fields_batch(seqs)
                return self._npy_selected(self._read_npy_batch(seqs))
            except (_Fallback, Mismatch):
                pass
            try:
                if self._field_templates:
                    return self._npy_selected(self._read_npy_batch(seqs))
                return self._read_fields_batch(seqs)
            except (_Fallback, Mismatch):
                pass
        return collate_samples(self.read_samples(seqs))

    def _npy_selected(self, batch: torch.Tensor) -> Any:
        """A raw .npy batch as the selection asks (each position must name the .npy field)."""
        if self.fields is None:
            return batch
        for alternatives in self.fields:
            # The template pins the key's ".npy" suffix: the blob answers to "npy".
            if not any(alt.lower() == "npy" for alt in alternatives):
                raise _Fallback  # e.g. __key__, or a field the sample lacks: general path
        return tuple(batch for _ in self.fields)

    def _field_template_of(self, record: memoryview) -> FieldsTemplate | None:
        """The template ``record`` matches (made on first sight), or None."""
        for template in self._field_templates:
            if template.lengths(record) is not None:
                return template
        try:
            template = FieldsTemplate(record, self.fields)
        except (Mismatch, DecodeError, ValueError, struct.error):
            return None  # not a raw multi-field record of known kinds: the general path
        if len(self._field_templates) >= 16:  # odd data must not grow it without bound
            self._field_templates.pop()
        self._field_templates.insert(0, template)
        return template

    def _read_fields_batch(self, seqs: np.ndarray) -> Any:
        """Decode raw multi-field records into per-field batch tensors (see `epochcache.data.raw`).

        Raises:
            Mismatch: a record does not fit the first one's template signature.
        """
        keys = seq_keys(seqs)
        if not keys:
            raise Mismatch
        env, db = self.cache.env, self.cache.env.dbs[DB_SAMPLES]
        with self._watching(len(keys)) as act:
            with env.read() as txn:
                get = txn.get
                first = get(keys[0], None, db)
                if first is None:
                    raise self._missing(int(seqs[0]))
                template = self._field_template_of(first)
                if template is None:
                    raise Mismatch
                out = FieldsBatch(template, len(keys))
                signature = template.signature
                if act is not None:
                    act.resolve = self.key_of
                records: list[memoryview | None] = []
                done = out.fill(get, db, keys, records, act) if template.simple else 0
                # The records filled share the template's key length: their payloads are
                # their lengths less one header and key each.
                decoded = (sum(map(len, records[:done]))  # type: ignore[arg-type]
                           - done * (_H + (first[24] | first[25] << 8)))
                for i in range(done, len(keys)):  # other layouts, or not a simple template
                    lmdb_key = keys[i]
                    if act is not None:
                        act.key = lmdb_key
                    record = records[i] if i < len(records) else get(lmdb_key, None, db)
                    if record is None:
                        raise self._missing(int.from_bytes(lmdb_key, "big"))
                    lengths = template.lengths(record)
                    if lengths is None:  # another layout (key length, field lengths)?
                        other = self._field_template_of(record)
                        if other is None or other.signature != signature:
                            raise Mismatch
                        template = other
                        lengths = template.lengths(record)
                        if lengths is None:
                            raise Mismatch
                    out.add(i, record, template, lengths, source_key)
                    decoded += _raw_size(record)[0]
                batch = out.finish()
                self.tallies.add("decoded_bytes", decoded)
                return batch

    def _read_npy_batch(self, seqs: np.ndarray) -> torch.Tensor:
        """Copy raw fixed-shape ``.npy`` arrays straight from the map into one batch tensor.

        Raises:
            _Fallback: a sample is not a raw ``.npy`` array matching the first one's template.
        """
        keys = seq_keys(seqs)
        if not keys:
            return torch.empty(0)
        env, db, opened_by = self._env_db
        if opened_by is not PROCESS[0]:
            env, db = self._handles()
        with self._watching(len(keys)) as act:
            txn = begin_read(env)
            try:
                get = txn.get
                first = get(keys[0], None, db)
                if first is None:
                    raise self._missing(int(seqs[0]))
                template = self._template
                if template is None or not template.matches(first):
                    template = self._template_of(first)
                    if template is None:
                        raise _Fallback
                batch, out = alloc_rows((len(keys), *template.shape), template.dtype)
                size, hi, nbytes = template.size, template.hi, template.nbytes
                check, expect = template.check, template.expect
                if act is not None:
                    act.resolve = self.key_of  # names act.key only if a stall is reported
                # Large samples are copied after the loop, by two threads (see `collate.copy_rows`).
                large: list[memoryview] | None = (
                    [] if nbytes >= SPLIT_BYTES and len(keys) > 1 and get_worker_info() is None
                    else None)
                pos = 0
                # One get, two comparisons and one memcpy per sample: this loop is the
                # loader's throughput (see scripts/bench_loader.py). ``db`` is passed
                # positionally: py-lmdb parses keyword arguments at ~0.25 us a call. The
                # same steps as C loops over the batch (map, tee and zip: no bytecode per
                # sample) measured 2% slower at 1 KiB and 3% at 64 KiB, and py-lmdb's
                # Cursor.getmulti slower still (two cursor operations and a tuple per key):
                # what a sample costs here is LMDB's lookup and the copy, not the loop.
                for lmdb_key in keys:
                    if act is not None:
                        act.key = lmdb_key
                    record = get(lmdb_key, None, db)
                    if record is None:
                        raise self._missing(int.from_bytes(lmdb_key, "big"))
                    if len(record) == size and check(record) == expect:
                        data = record[hi:]
                    else:  # e.g. another key length: same array layout, another template
                        other = self._template_of(record)
                        if other is None or not template.same_array(other):
                            raise _Fallback
                        data = record[other.hi :]
                    if large is None:
                        out[pos : pos + nbytes] = data
                        pos += nbytes
                    else:
                        large.append(data)
                if large:
                    copy_rows(np.frombuffer(out, np.uint8).reshape(len(keys), nbytes), large)
                # Every sample holds one array of the template's: its payload's size.
                self.tallies.add("decoded_bytes", len(keys) * _raw_size(first)[0])
            finally:
                end_read(txn)
        return batch
