"""Manifests (text, CSV, JSONL, Parquet) and key patterns (globs, brace ranges).

A manifest replaces listing for buckets too large to list quickly. Formats, chosen by extension
(``.txt``, ``.csv``, ``.jsonl``/``.ndjson``, ``.parquet``; a trailing ``.gz`` is decompressed):

* text: one key per line; blank lines and lines starting with ``#`` are skipped;
* CSV: a header naming ``key`` and any of ``size``, ``weight``, ``checksum`` (other columns ignored);
* JSONL: one object per line with the same fields;
* Parquet: the same columns; needs ``pyarrow`` (not a dependency of epochcache).

Manifests are bounded like any untrusted input. They are read as a stream, a line at a time
(``.gz`` decompressed as it goes): a line longer than 64 KiB is refused (a line holds one key,
S3 keys are at most 1,024 bytes, and its columns), the keys kept may take at most
``source.manifest_max_bytes`` and at most ``source.manifest_max_lines`` lines are read; past a
bound the listing fails with an error naming the manifest and the setting. So a 4 MiB gzip
that inflates to 4 GiB in one line costs a line's memory, not 4 GiB. Keys are kept compactly
(`keytable`).

Keys are relative to the source root. For the ``tar`` layout a manifest lists shards. ``checksum``
is ``"algo:hex"`` (``sha256``, ``sha1``, ``md5``, ``crc32``) or bare hex, whose algorithm is told by its
length (8 crc32, 32 md5, 40 sha1, 64 sha256).
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import re
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import fsspec

from ..errors import PermanentRemoteError, SourceError, SourceUnavailable
from ..limits import (
    DEFAULT_MANIFEST_MAX_BYTES,
    DEFAULT_MANIFEST_MAX_LINES,
    MANIFEST_MAX_LINE_BYTES,
    gunzip_chunks,
)
from ..units import format_size
from .keytable import KeyTable, KeyTableBuilder
from .remote import retry

log = logging.getLogger(__name__)

_BRACE_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")
_BRACE_LIST = re.compile(r"\{([^{}]*,[^{}]*)\}")


def expand_braces(pattern: str) -> list[str]:
    """Expand ``{000..554}`` ranges (zero padding kept) and ``{a,b}`` lists, like the shell.

    >>> expand_braces("train-{00..02}.tar")
    ['train-00.tar', 'train-01.tar', 'train-02.tar']
    """
    match = _BRACE_RANGE.search(pattern)
    if match is not None:
        first, last = match.group(1), match.group(2)
        width = len(first) if first.startswith("0") or len(first) == len(last) else 0
        lo, hi = int(first), int(last)
        step = 1 if hi >= lo else -1
        head, tail = pattern[: match.start()], pattern[match.end() :]
        out: list[str] = []
        for number in range(lo, hi + step, step):
            out.extend(expand_braces(f"{head}{number:0{width}d}{tail}"))
        return out
    match = _BRACE_LIST.search(pattern)
    if match is not None:
        head, tail = pattern[: match.start()], pattern[match.end() :]
        return [x for part in match.group(1).split(",") for x in expand_braces(head + part + tail)]
    return [pattern]


def glob_to_regex(pattern: str) -> re.Pattern[str]:
    """Compile a glob over relative paths: ``*`` and ``?`` stay within one path segment, ``**``
    crosses segments (``**/`` also matches nothing), ``[...]`` is a character class, and brace
    lists/ranges expand to alternatives."""
    alternatives = expand_braces(pattern) if "{" in pattern else [pattern]
    parts: list[str] = []
    for alt in alternatives:
        i, out = 0, []
        while i < len(alt):
            c = alt[i]
            if alt.startswith("**/", i):
                out.append("(?:.*/)?")
                i += 3
            elif alt.startswith("**", i):
                out.append(".*")
                i += 2
            elif c == "*":
                out.append("[^/]*")
                i += 1
            elif c == "?":
                out.append("[^/]")
                i += 1
            elif c == "[" and "]" in alt[i + 1 :]:
                end = alt.index("]", i + 1)
                body = alt[i + 1 : end].replace("\\", "\\\\")
                out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
                i = end + 1
            else:
                out.append(re.escape(c))
                i += 1
        parts.append("".join(out))
    return re.compile("^(?:" + "|".join(parts) + ")$")


def detect_format(path: str) -> str:
    """The manifest format told by the file name: txt, csv, jsonl or parquet."""
    name = path.lower().removesuffix(".gz")
    for ext, fmt in (
        (".csv", "csv"),
        (".jsonl", "jsonl"),
        (".ndjson", "jsonl"),
        (".json", "jsonl"),
        (".parquet", "parquet"),
        (".txt", "txt"),
    ):
        if name.endswith(ext):
            return fmt
    return "txt"


class _Refused(Exception):
    """The manifest's content is refused (malformed, or past a bound): not retried."""


#: Bytes read from the manifest per call (compressed, for ``.gz``), and decompressed per step.
_CHUNK = 1024 * 1024


def read_manifest(
    fs: fsspec.AbstractFileSystem,
    path: str,
    *,
    url: str,
    fmt: str = "auto",
    deadline_s: float = 10.0,
    max_bytes: int = DEFAULT_MANIFEST_MAX_BYTES,
    max_lines: int = DEFAULT_MANIFEST_MAX_LINES,
    open_stream: Callable[[], Any] | None = None,
) -> KeyTable:
    """Read a manifest into a table of refs (in file order), within bounds: a manifest is
    someone else's file too. It is read as a stream, a line at a time (``.gz`` decompressed
    as it goes), so memory follows the keys kept: a line longer than
    `MANIFEST_MAX_LINE_BYTES` is refused, the keys kept may take at
    most ``max_bytes``, and at most ``max_lines`` lines (rows) are read. Each read has the
    filesystem's timeouts; a transient failure reads the manifest once more, within
    ``deadline_s``.

    Args:
        open_stream: opens the manifest as a file object read in order (the source's body
            reader, its requests counted: `epochcache.ingest.bodies`); None, or a parquet
            manifest (read from its end): ``fs.open``.

    Raises:
        SourceUnavailable: the manifest cannot be read, is malformed (line named), is empty, or
            passes a bound (named with the setting that raises it).
    """
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt not in ("txt", "csv", "jsonl", "parquet"):
        raise SourceUnavailable(
            f"{url}: unknown manifest format {fmt!r} (use txt, csv, jsonl or parquet)", url)

    def attempt() -> KeyTableBuilder:
        builder, bounds = KeyTableBuilder(), _Bounds(url, max_bytes, max_lines)
        opened = (open_stream() if open_stream is not None and fmt != "parquet"
                  else _open(fs, path))
        with opened as handle:
            if fmt == "parquet":
                _parse_parquet(handle, url, builder, bounds)
                return builder
            chunks: Iterator[bytes] = iter(lambda: handle.read(_CHUNK), b"")
            if path.lower().endswith(".gz"):
                chunks = _gunzipped(chunks, url)
            lines = _lines(chunks, bounds)
            {"txt": _parse_text, "csv": _parse_csv, "jsonl": _parse_jsonl}[fmt](
                lines, url, builder, bounds)
        return builder

    try:
        builder = retry(attempt, url=url, attempts=2, deadline_s=deadline_s)
    except PermanentRemoteError as exc:
        if str(exc).startswith(f"{url}: not found"):  # the most common: say it plainly
            raise SourceUnavailable(
                f"{url}: no such manifest; check source.manifest (a relative path is read "
                "from the working directory; a manifest beside the data is named by its URL)",
                url) from exc
        raise SourceUnavailable(
            f"{url}: cannot read the manifest ({exc}); check source.manifest", url
        ) from exc
    except SourceError as exc:
        raise SourceUnavailable(
            f"{url}: cannot read the manifest ({exc}); check source.manifest", url
        ) from exc
    except _Refused as exc:
        raise SourceUnavailable(str(exc), url) from None
    if not len(builder):
        raise SourceUnavailable(f"{url}: the manifest lists no keys; check source.manifest", url)
    log.info("%s: manifest lists %s keys", url, f"{len(builder):,}")
    return builder.build()


@contextlib.contextmanager
def _open(fs: fsspec.AbstractFileSystem, path: str) -> Iterator[Any]:
    """The manifest as a file object read in chunks. Over HTTP it is one streamed GET (many
    servers answer no ranged reads); other filesystems read it in blocks. Every read has the
    filesystem's timeouts (`open_fs`)."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    options = {"block_size": 0} if protocol in ("http", "https") else {}
    with fs.open(path, "rb", **options) as handle:
        yield handle


class _Bounds:
    """What one manifest may hold, and the count of lines read so far."""

    def __init__(self, url: str, max_bytes: int, max_lines: int) -> None:
        self.url, self.max_bytes, self.max_lines = url, max_bytes, max_lines
        self.lines = 0

    def count_lines(self, n: int) -> None:
        self.lines += n
        if self.lines > self.max_lines:
            raise _Refused(
                f"{self.url}: the manifest has more than the {self.max_lines:,} lines allowed "
                "(source.manifest_max_lines); raise it if the manifest is real")

    def too_long(self, where: str, size: int) -> _Refused:
        return _Refused(
            f"{self.url}: {where} is longer than {format_size(MANIFEST_MAX_LINE_BYTES)} "
            f"({format_size(size)} so far); a manifest line holds one key (S3 keys are at most "
            "1,024 bytes) and its columns: check that source.manifest names a manifest of keys "
            "(txt, csv, jsonl or parquet; .gz compressed or not) and source.manifest_format")

    def check_kept(self, builder: KeyTableBuilder) -> None:
        if builder.nbytes > self.max_bytes:
            raise _Refused(
                f"{self.url}: the keys of the manifest take more than "
                f"{format_size(self.max_bytes)} after {len(builder):,} keys "
                "(source.manifest_max_bytes); raise it if the manifest is real")


def _lines(chunks: Iterable[bytes], bounds: _Bounds) -> Iterator[bytes]:
    """The lines of a stream of chunks (without their newline), none longer than
    `MANIFEST_MAX_LINE_BYTES`: what is held is a chunk and a line."""
    pending = bytearray()
    for chunk in chunks:
        parts = chunk.split(b"\n")
        tail = parts.pop()  # the line the next chunk goes on with
        if parts:
            if pending:
                pending += parts[0]
                parts[0], pending = bytes(pending), bytearray()
            first = bounds.lines + 1
            bounds.count_lines(len(parts))
            for number, line in enumerate(parts, start=first):
                if len(line) > MANIFEST_MAX_LINE_BYTES:
                    raise bounds.too_long(f"line {number:,}", len(line))
                yield line
        pending += tail
        if len(pending) > MANIFEST_MAX_LINE_BYTES:
            raise bounds.too_long(f"line {bounds.lines + 1:,}", len(pending))
    if pending:
        bounds.count_lines(1)
        yield bytes(pending)


def _gunzipped(chunks: Iterator[bytes], url: str) -> Iterator[bytes]:
    try:
        yield from gunzip_chunks(chunks, _CHUNK)
    except (EOFError, ValueError, zlib.error) as exc:
        raise _Refused(f"{url}: manifest is not valid gzip ({exc})") from None


def _decode(line: bytes, number: int, url: str) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Refused(f"{url}: line {number:,}: manifest is not UTF-8 text ({exc})") from None


def _parse_text(lines: Iterable[bytes], url: str, builder: KeyTableBuilder,
                bounds: _Bounds) -> None:
    add = builder.add_bytes
    for number, line in enumerate(lines, start=1):
        if number == 1 and line.startswith(b"\xef\xbb\xbf"):
            line = line[3:]  # a byte order mark
        key = line.strip()
        if key and not key.startswith(b"#"):
            _decode(key, number, url)  # keys are UTF-8
            add(key)
            bounds.check_kept(builder)


def _add_row(builder: KeyTableBuilder, row: dict[str, Any], url: str, where: str) -> None:
    key = row.get("key")
    if key is None or str(key).strip() == "":
        raise _Refused(f"{url}: {where}: missing 'key'; every row needs a key")
    try:
        size = row.get("size")
        size = None if size in (None, "") else int(size)
        weight = row.get("weight")
        weight = None if weight in (None, "") else float(weight)
    except (TypeError, ValueError) as exc:
        raise _Refused(
            f"{url}: {where}: bad size or weight ({str(exc)[:200]}); size is bytes, weight a "
            "number >= 0") from None
    if (size is not None and size < 0) or (weight is not None and not weight >= 0):
        raise _Refused(f"{url}: {where}: size and weight must be >= 0")
    checksum = row.get("checksum")
    checksum = None if checksum in (None, "") else str(checksum).strip().lower()
    if checksum is not None and not checksum.isascii():
        raise _Refused(f"{url}: {where}: checksum {checksum[:80]!r} is not hex")
    builder.add(str(key).strip(), size, weight, checksum)


def _parse_csv(lines: Iterable[bytes], url: str, builder: KeyTableBuilder,
               bounds: _Bounds) -> None:
    # A quoted field may span lines: what one row takes is bounded like a line.
    row_bytes = 0

    def text() -> Iterator[str]:
        nonlocal row_bytes
        for number, line in enumerate(lines, start=1):
            if number == 1 and line.startswith(b"\xef\xbb\xbf"):
                line = line[3:]
            row_bytes += len(line) + 1
            if row_bytes > MANIFEST_MAX_LINE_BYTES:
                raise bounds.too_long(f"the CSV row ending on line {number:,}", row_bytes)
            yield _decode(line, number, url) + "\n"

    reader = csv.reader(text())
    try:
        header = next(reader, None)
        names = [name.strip() for name in header or []]
        if "key" not in names:
            raise _Refused(
                f"{url}: CSV manifest needs a header with a 'key' column (and optionally size, "
                f"weight, checksum), got {str(header)[:300]}")
        wanted = [(name, names.index(name)) for name in ("key", "size", "weight", "checksum")
                  if name in names]
        row_bytes = 0
        for row in reader:
            if row:
                values: dict[str, Any] = {name: (row[i].strip() if i < len(row) else None)
                                           for name, i in wanted}
                _add_row(builder, values, url, f"line {reader.line_num:,}")
                bounds.check_kept(builder)
            row_bytes = 0
    except csv.Error as exc:
        raise _Refused(f"{url}: line {reader.line_num:,}: not CSV ({exc})") from None


def _parse_jsonl(lines: Iterable[bytes], url: str, builder: KeyTableBuilder,
                 bounds: _Bounds) -> None:
    for number, line in enumerate(lines, start=1):
        text = _decode(line, number, url)
        if number == 1:
            text = text.removeprefix("\ufeff")
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as exc:
            raise _Refused(f"{url}: line {number:,}: not JSON ({exc})") from None
        if isinstance(row, str):
            row = {"key": row}
        if not isinstance(row, dict):
            raise _Refused(f"{url}: line {number:,}: expected an object with 'key'")
        _add_row(builder, row, url, f"line {number:,}")
        bounds.check_kept(builder)


def _parse_parquet(handle: Any, url: str, builder: KeyTableBuilder, bounds: _Bounds) -> None:
    """The rows of a Parquet manifest, a batch of rows at a time from its file object."""
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise SourceUnavailable(
            f"{url}: reading a Parquet manifest needs pyarrow (pip install pyarrow), or use a "
            ".csv/.jsonl manifest",
            url,
        ) from exc
    import pyarrow as pa

    number = 0
    try:
        parquet = pq.ParquetFile(handle)
        columns = [name for name in ("key", "size", "weight", "checksum")
                   if name in parquet.schema_arrow.names]
        for batch in parquet.iter_batches(batch_size=8192, columns=columns):
            bounds.count_lines(batch.num_rows)
            for row in batch.to_pylist():
                number += 1
                key = row.get("key")
                if isinstance(key, (str, bytes)) and len(key) > MANIFEST_MAX_LINE_BYTES:
                    raise bounds.too_long(f"the key of row {number:,}", len(key))
                _add_row(builder, row, url, f"row {number:,}")
                bounds.check_kept(builder)
    except pa.ArrowException as exc:
        raise _Refused(f"{url}: row {number + 1:,}: not a readable Parquet manifest "
                       f"({str(exc)[:300]})") from None
