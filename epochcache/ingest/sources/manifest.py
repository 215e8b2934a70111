"""Manifests (text, CSV, JSONL, Parquet) and key patterns (globs, brace ranges).

A manifest replaces listing for buckets too large to list quickly. Formats, chosen by extension
(``.txt``, ``.csv``, ``.jsonl``/``.ndjson``, ``.parquet``; a trailing ``.gz`` is decompressed):

* text: one key per line; blank lines and lines starting with ``#`` are skipped;
* CSV: a header naming ``key`` and any of ``size``, ``weight``, ``checksum`` (other columns ignored);
* JSONL: one object per line with the same fields;
* Parquet: the same columns; needs ``pyarrow`` (not a dependency of epochcache).

Manifests are bounded like any untrusted input: at most ``source.manifest_max_bytes`` are read
(and decompressed), at most ``source.manifest_max_lines`` lines parsed; past a bound the
listing fails with an error naming the setting. Keys are kept compactly (:mod:`.keytable`).

Keys are relative to the source root. For the ``tar`` layout a manifest lists shards. ``checksum``
is ``"algo:hex"`` (``sha256``, ``sha1``, ``md5``, ``crc32``) or bare hex, whose algorithm is told by its
length (8 crc32, 32 md5, 40 sha1, 64 sha256).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import re
import zlib
from typing import Any

import fsspec

from ...errors import SourceError, SourceUnavailable
from ...limits import DEFAULT_MANIFEST_MAX_BYTES, DEFAULT_MANIFEST_MAX_LINES, gunzip
from ...units import format_size
from ..remote import call, retry
from .keytable import KeyTable, KeyTableBuilder

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


def read_manifest(
    fs: fsspec.AbstractFileSystem,
    path: str,
    *,
    url: str,
    fmt: str = "auto",
    deadline_s: float = 10.0,
    timeout_s: float = 30.0,
    max_bytes: int = DEFAULT_MANIFEST_MAX_BYTES,
    max_lines: int = DEFAULT_MANIFEST_MAX_LINES,
) -> KeyTable:
    """Read a manifest into a table of refs (in file order), within bounds: a manifest is
    someone else's file too. At most ``max_bytes`` are read (and as many decompressed, for
    ``.gz``), and at most ``max_lines`` lines (rows) parsed.

    Raises:
        SourceUnavailable: the manifest cannot be read, is malformed (line named), is empty, or
            passes a bound (named with the setting that raises it).
    """
    fmt = detect_format(path) if fmt == "auto" else fmt
    try:
        # One byte more than accepted: a larger manifest is told without holding all of it.
        data: bytes = retry(
            lambda: call(fs, "cat_file", path, start=0, end=max_bytes + 1, timeout_s=timeout_s),
            url=url,
            attempts=2,
            deadline_s=deadline_s,
        )
    except SourceError as exc:
        raise SourceUnavailable(
            f"{url}: cannot read the manifest ({exc}); check source.manifest", url
        ) from exc
    if len(data) > max_bytes:
        raise SourceUnavailable(
            f"{url}: the manifest is larger than {format_size(max_bytes)} "
            "(source.manifest_max_bytes); raise it if the manifest is real", url)
    if path.lower().endswith(".gz"):
        try:
            data = gunzip(data, max_bytes, what="source.manifest_max_bytes")
        except (OSError, EOFError, ValueError, zlib.error) as exc:
            raise SourceUnavailable(f"{url}: manifest is not valid gzip within bounds ({exc})",
                                    url) from exc
    lines = data.count(b"\n") + (0 if data.endswith(b"\n") or not data else 1)
    if lines > max_lines:
        raise SourceUnavailable(
            f"{url}: the manifest has {lines:,} lines, more than the {max_lines:,} allowed "
            "(source.manifest_max_lines); raise it if the manifest is real", url)
    builder = KeyTableBuilder()
    try:
        if fmt == "parquet":
            _parse_parquet(data, url, builder, max_lines)
        else:
            parse = {"txt": _parse_text, "csv": _parse_csv, "jsonl": _parse_jsonl}.get(fmt)
            if parse is None:
                raise SourceUnavailable(
                    f"{url}: unknown manifest format {fmt!r} (use txt, csv, jsonl or parquet)", url
                )
            parse(data, url, builder)
    except UnicodeDecodeError as exc:
        raise SourceUnavailable(f"{url}: manifest is not UTF-8 text ({exc})", url) from exc
    if not len(builder):
        raise SourceUnavailable(f"{url}: the manifest lists no keys; check source.manifest", url)
    log.info("%s: manifest lists %s keys", url, f"{len(builder):,}")
    return builder.build()


def _text(data: bytes) -> str:
    return data.decode("utf-8-sig")


def _parse_text(data: bytes, url: str, builder: KeyTableBuilder) -> None:
    _text(data)  # the whole file is UTF-8 (raises UnicodeDecodeError otherwise)
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    add = builder.add_bytes
    for line in data.split(b"\n"):
        key = line.strip()
        if key and not key.startswith(b"#"):
            add(key)


def _add_row(builder: KeyTableBuilder, row: dict[str, Any], url: str, where: str) -> None:
    key = row.get("key")
    if key is None or str(key).strip() == "":
        raise SourceUnavailable(f"{url}: {where}: missing 'key'; every row needs a key", url)
    try:
        size = row.get("size")
        size = None if size in (None, "") else int(size)
        weight = row.get("weight")
        weight = None if weight in (None, "") else float(weight)
    except (TypeError, ValueError) as exc:
        raise SourceUnavailable(
            f"{url}: {where}: bad size or weight ({exc}); size is bytes, weight a number >= 0", url
        ) from exc
    if (size is not None and size < 0) or (weight is not None and not weight >= 0):
        raise SourceUnavailable(f"{url}: {where}: size and weight must be >= 0", url)
    checksum = row.get("checksum")
    checksum = None if checksum in (None, "") else str(checksum).strip().lower()
    if checksum is not None and not checksum.isascii():
        raise SourceUnavailable(f"{url}: {where}: checksum {checksum[:80]!r} is not hex", url)
    builder.add(str(key).strip(), size, weight, checksum)


def _parse_csv(data: bytes, url: str, builder: KeyTableBuilder) -> None:
    reader = csv.reader(io.StringIO(_text(data)))
    header = next(reader, None)
    names = [name.strip() for name in header or []]
    if "key" not in names:
        raise SourceUnavailable(
            f"{url}: CSV manifest needs a header with a 'key' column (and optionally size, "
            f"weight, checksum), got {header}",
            url,
        )
    wanted = [(name, names.index(name)) for name in ("key", "size", "weight", "checksum")
              if name in names]
    for number, row in enumerate(reader, start=2):
        if not row:
            continue
        values: dict[str, Any] = {name: (row[i].strip() if i < len(row) else None)
                                   for name, i in wanted}
        _add_row(builder, values, url, f"line {number}")


def _parse_jsonl(data: bytes, url: str, builder: KeyTableBuilder) -> None:
    for number, line in enumerate(_text(data).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SourceUnavailable(f"{url}: line {number}: not JSON ({exc})", url) from exc
        if isinstance(row, str):
            row = {"key": row}
        if not isinstance(row, dict):
            raise SourceUnavailable(f"{url}: line {number}: expected an object with 'key'", url)
        _add_row(builder, row, url, f"line {number}")


def _parse_parquet(data: bytes, url: str, builder: KeyTableBuilder, max_rows: int) -> None:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise SourceUnavailable(
            f"{url}: reading a Parquet manifest needs pyarrow (pip install pyarrow), or use a "
            ".csv/.jsonl manifest",
            url,
        ) from exc
    table = pq.read_table(io.BytesIO(data))
    if table.num_rows > max_rows:
        raise SourceUnavailable(
            f"{url}: the manifest has {table.num_rows:,} rows, more than the {max_rows:,} "
            "allowed (source.manifest_max_lines); raise it if the manifest is real", url)
    for number, row in enumerate(table.to_pylist(), start=1):
        _add_row(builder, row, url, f"row {number}")
