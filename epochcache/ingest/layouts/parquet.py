"""The ``parquet`` layout: a ref is one Parquet file, its samples are its rows, read a row
group at a time with ranged reads (`Source.read_range`), never the whole file.

Fetching a file reads its last 8 bytes (the footer's length and the magic ``PAR1``), then
its footer (refused past `MAX_FOOTER_BYTES` or past the file), then, for each row group, the
byte span of its column chunks (from the first chunk's first page to the last one's end)
with one ranged read, decodes it with pyarrow from those bytes only, and hands its rows to
the sampler in `Piece`s of at most ``piece_bytes`` as a tar shard's are: a file of ``n`` row
groups is ``2 + n`` GETs, and what it holds at once is one row group (its bytes, its decoded
table, the piece being handed over). A row group larger than the sampler may hold in flight
(``sampler.max_bytes_in_flight``) is refused, and so is a file that is not Parquet or whose
pages do not decode: quarantined with the reason, the rows handed over before kept. A file
whose read failed (the network) goes on from the row group after the last one handed over.

A sample's key is ``<file>/<row:09d>`` (its row in the file); its fields are the file's
columns: binary as it is, strings in UTF-8, numbers and booleans as text (so that the
``cls`` and ``txt`` decoders read them), lists and structs as JSON; a null leaves its field
out. A manifest's checksum of a file is not checked: the file is never read whole.

pyarrow is an optional dependency (``pip install 'epochcache[parquet]'``): the config refuses
``layout: parquet`` without it (`epochcache.registry`).
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Sequence
from typing import Any

from ...errors import CorruptSample, SourceError
from ...limits import cut_text
from ...units import format_size
from ..bodies import RawReader
from ..types import PIECE_BYTES, STREAMED, FetchResult, OnPiece, Piece, SampleRef
from .base import Source

log = logging.getLogger(__name__)

#: A Parquet file ends with its footer's length (4 bytes, little-endian) and ``PAR1``.
TAIL_BYTES = 8
MAGIC = b"PAR1"
#: The largest footer read: a footer is the file's schema and the offsets of its column
#: chunks (kilobytes to a few MiB for wide tables of many row groups); a larger length is a
#: damaged or hostile file, not read.
MAX_FOOTER_BYTES = 64 * 1024 * 1024


class _Spans(RawReader):
    """A read-only file of ``size`` bytes that holds only the byte spans fetched: what pyarrow
    decodes a row group from (a read outside them is an error: nothing else is fetched)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self._size = size
        self._at = 0
        self._spans: dict[int, bytes | bytearray] = {}

    def hold(self, start: int, data: bytes | bytearray) -> None:
        self._spans[start] = data

    def drop(self, start: int) -> None:
        self._spans.pop(start, None)

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._size}[whence]
        self._at = base + offset
        return self._at

    def tell(self) -> int:
        return self._at

    def read(self, size: int | None = -1) -> memoryview:
        """The next ``size`` bytes as a view of the span that holds them: not copied (pyarrow
        wraps what a Python file's ``read`` returns as its buffer; a copy here doubled what a
        row group's decoding held)."""
        want = self._size - self._at if size is None or size < 0 else \
            min(size, self._size - self._at)
        if want <= 0:
            return memoryview(b"")
        for start, data in self._spans.items():
            if start <= self._at and self._at + want <= start + len(data):
                view = memoryview(data)[self._at - start : self._at - start + want]
                self._at += want
                return view
        raise OSError(f"bytes {self._at:,}-{self._at + want:,} were not fetched (the footer "
                      "names pages outside its row group's column chunks)")


def _text(value: Any) -> bytes:
    """A column's value as a field's bytes (see the module docstring)."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (list, dict)):
        return json.dumps(value, default=str).encode("utf-8")
    return str(value).encode("utf-8")


def _rows(table: Any) -> list[dict[str, bytes]]:
    """A pyarrow table's rows as samples' fields (see the module docstring)."""
    columns = table.to_pydict()
    return [{name: _text(values[i]) for name, values in columns.items() if values[i] is not None}
            for i in range(table.num_rows)]


def _group_span(group: Any) -> tuple[int, int]:
    """``[start, end)`` of a row group's column chunks in the file (``group``: pyarrow's
    ``RowGroupMetaData``)."""
    starts, ends = [], []
    for j in range(group.num_columns):
        column = group.column(j)
        start = column.data_page_offset
        if column.has_dictionary_page and column.dictionary_page_offset:
            start = min(start, column.dictionary_page_offset)
        starts.append(start)
        ends.append(start + column.total_compressed_size)
    return min(starts), max(ends)


class ParquetSource(Source):
    """Parquet files under ``source.url`` (a listing matching ``source.pattern``, default
    ``**/*.parquet``, or a manifest of files); ``list_table`` holds one ref per file,
    ``fetch_many`` one result per row."""

    unit = "shard"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: files whose read failed after handing pieces over: (next row group, its first row,
        #: rows handed), by key
        self._resumes: dict[str, tuple[int, int, int]] = {}

    def held_bytes(self, ref: SampleRef, size: int, piece_bytes: int) -> int:
        """Nothing up front: each piece takes its bytes when it is handed over (as tar's)."""
        return 0

    def fetch_grouped(self, refs: Sequence[SampleRef], on_piece: OnPiece | None = None,
                      piece_bytes: int = PIECE_BYTES) -> list[list[FetchResult]]:
        """Every row of each file in ``refs``, one list per file, the files read at once (up
        to ``concurrency``). With ``on_piece``, a file's rows go to it a piece of at most
        ``piece_bytes`` at a time, and stand in the list as ``STREAMED``."""
        return self._each(refs, lambda ref: self._read_file(ref, on_piece, piece_bytes),
                          "epochcache-parquet")

    def _read_file(self, ref: SampleRef, on_piece: OnPiece | None,
                   piece_bytes: int) -> list[FetchResult]:
        """One file's rows (see `fetch_grouped`); a failed read keeps where to go on."""
        url = self.object_url(ref.key)
        first_group, row, handed_before = self._resumes.pop(ref.key, (0, 0, 0))
        stand_in = SampleRef(ref.key, shard=ref.key)
        handed: list[FetchResult] = [(stand_in, STREAMED)] * handed_before
        pending: list[FetchResult] = []
        held = 0  # bytes of the rows in pending
        resume = (first_group, row, handed_before)

        def hand(members: int | None) -> None:
            """Hand the rows in ``pending`` over as a piece (``members``: on the file's last)."""
            nonlocal pending, held, row
            assert on_piece is not None
            on_piece(Piece(ref, pending, row, members))
            row += len(pending)
            handed.extend((stand_in, STREAMED) for _ in pending)
            pending, held = [], 0

        try:
            import pyarrow as pa
            import pyarrow.parquet as pq

            size = self.object_size(ref)
            metadata = self._footer(ref, size, url)
            spans = _Spans(size)
            # pre_buffer: arrow's read-ahead would copy the row group once more (the bytes are
            # here already)
            try:
                parquet = pq.ParquetFile(spans, metadata=metadata, pre_buffer=False)
            except Exception as exc:  # pyarrow's errors for a schema it cannot read
                raise CorruptSample(f"{ref.key}: its Parquet schema cannot be read: "
                                    f"{cut_text(str(exc))}", url, ref.key) from exc
            for index in range(first_group, metadata.num_row_groups):
                start, end = _group_span(metadata.row_group(index))
                if end - start > self.spec.max_range_bytes:
                    raise CorruptSample(
                        f"{ref.key}: refused: row group {index} is {format_size(end - start)}, "
                        f"more than the {format_size(self.spec.max_range_bytes)} a sampler "
                        "holds in flight (sampler.max_bytes_in_flight; or write smaller row "
                        "groups); not downloaded", url, ref.key)
                spans.hold(start, self.read_range(ref, start, end))
                try:
                    table = parquet.read_row_group(index, use_threads=False)
                except Exception as exc:  # pyarrow's errors (ArrowInvalid, OSError...): damaged
                    raise CorruptSample(f"{ref.key}: row group {index} does not decode: "
                                        f"{cut_text(str(exc))}", url, ref.key) from exc
                finally:
                    spans.drop(start)
                # Rows become Python objects a piece's worth at a time: the whole group at once
                # held it twice (its table and its rows) and left the allocator fragmented.
                step = max(1, piece_bytes * table.num_rows // max(1, table.nbytes))
                for at in range(0, table.num_rows, step):
                    for fields in _rows(table.slice(at, step)):
                        nbytes = sum(len(value) for value in fields.values())
                        if on_piece is not None and pending and held + nbytes > piece_bytes:
                            hand(None)
                        pending.append((SampleRef(f"{ref.key}/{row + len(pending):09d}",
                                                  shard=ref.key), fields))
                        held += nbytes
                del table
                # what decoding it took back to the OS, not kept by arrow's allocator for the
                # next group (mimalloc kept ~4 groups' worth, measured with 8 MiB groups)
                pa.default_memory_pool().release_unused()
                if on_piece is not None and pending:
                    last = index == metadata.num_row_groups - 1
                    hand(row + len(pending) if last else None)
                resume = (index + 1, row, len(handed))
        except CorruptSample as exc:
            log.warning("%s", cut_text(f"{url}: corrupt Parquet file: {exc}", keys=(ref.key,)))
            return [*handed, *pending, (ref, exc)]
        except SourceError as exc:
            if on_piece is not None and handed:
                self._resumes[ref.key] = resume
            return [*handed, (ref, exc)]
        return handed + pending

    def _footer(self, ref: SampleRef, size: int, url: str) -> Any:
        """The file's metadata (pyarrow's ``FileMetaData``), read from its footer alone: two
        ranged reads.

        Raises:
            CorruptSample: the file is not Parquet, or its footer is absurd or damaged.
        """
        import pyarrow as pa
        import pyarrow.parquet as pq

        if size < len(MAGIC) + TAIL_BYTES:
            raise CorruptSample(f"{ref.key}: not a Parquet file ({size} bytes)", url, ref.key)
        tail = bytes(self.read_range(ref, size - TAIL_BYTES, size))
        if tail[4:] != MAGIC:
            raise CorruptSample(f"{ref.key}: not a Parquet file (it does not end with PAR1)",
                                url, ref.key)
        length = int.from_bytes(tail[:4], "little")
        if length > min(MAX_FOOTER_BYTES, size - len(MAGIC) - TAIL_BYTES):
            raise CorruptSample(
                f"{ref.key}: refused: its footer says {format_size(length)}, more than "
                f"{'the file holds' if length <= MAX_FOOTER_BYTES else format_size(MAX_FOOTER_BYTES)}"
                " (a damaged or hostile file); not read", url, ref.key)
        footer = self.read_range(ref, size - TAIL_BYTES - length, size - TAIL_BYTES)
        try:
            return pq.read_metadata(pa.BufferReader(bytes(footer) + tail))
        except Exception as exc:  # pyarrow's errors for a damaged footer
            raise CorruptSample(f"{ref.key}: its Parquet footer does not decode: "
                                f"{cut_text(str(exc))}", url, ref.key) from exc
