"""Bounds on untrusted input: a source is someone else's bucket.

* `DEFAULT_MAX_SAMPLE_BYTES` (256 MiB, ``loader.max_sample_bytes``) is the largest sample
  epochcache accepts: samplers refuse (quarantine) an object listed larger, or larger than the
  cache capacity, before downloading it, and read at most that much of one whose size is not
  listed; decompression (gzip) stops there on ingest and in the loader;
* `gunzip` decompresses gzip in a stream and gives up as soon as the output passes the
  bound, so a 4 MiB bomb that would expand to 4 GiB costs at most the bound;
* manifests are read as a stream (`gunzip_chunks` for ``.gz``), a line at a time: a
  line longer than `MANIFEST_MAX_LINE_BYTES` is an error, the keys kept may take at
  most `DEFAULT_MANIFEST_MAX_BYTES` (``source.manifest_max_bytes``) and at most
  `DEFAULT_MANIFEST_MAX_LINES` lines are read (``source.manifest_max_lines``), so
  memory follows the keys kept, never the file or what it inflates to;
* `NPY_MAX_HEADER_BYTES` caps a ``.npy`` header before it is parsed, as numpy does;
* keys are someone else's names too (a tar member's name may be megabytes long): wherever one
  is kept or printed beside the samples (the quarantine, logs, ``status``, ``verify``), it is
  `cut_key` to `KEY_SHOWN_CHARS` with a digest of the whole, and messages that
  carry one are `cut_text`.

A base module: no layer, no fsspec, no torch. Callers turn the ``ValueError`` it raises into
their own error that names the key (``DecodeError``, ``CorruptSample``).
"""

from __future__ import annotations

import hashlib
import re
import threading
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

from .units import format_size

DEFAULT_MAX_SAMPLE_BYTES = 256 * 1024 * 1024
#: What one sampler process holds between fetch and commit (``sampler.max_bytes_in_flight``),
#: and so the largest range a source reads at once (`SourceSpec.max_range_bytes`).
DEFAULT_MAX_BYTES_IN_FLIGHT = 512 * 1024**2
#: The most memory the keys of a manifest may take (``source.manifest_max_bytes``)...
DEFAULT_MANIFEST_MAX_BYTES = 4 * 1024**3
#: ... the most lines read from it (``source.manifest_max_lines``)...
DEFAULT_MANIFEST_MAX_LINES = 100_000_000
#: ... and the longest line: one key (S3 keys are at most 1,024 bytes) and its columns.
MANIFEST_MAX_LINE_BYTES = 64 * 1024
#: numpy refuses ``.npy`` headers longer than this unless the file is fully trusted.
NPY_MAX_HEADER_BYTES = 10_000

#: Keys up to this many characters are shown whole (every legal S3 key: at most 1,024 bytes)...
KEY_SHOWN_CHARS = 1024
#: ... and a message that carries keys is cut to this many characters.
TEXT_SHOWN_CHARS = 2048

#: A run of non-blank characters (each is matched once, from its start: linear; a pattern
#: for long runs only would rescan every shorter run from each of its characters).
_WORD = re.compile(r"\S+")

_GZIP = 16 + zlib.MAX_WBITS  # zlib's gzip framing: header, CRC32 and length trailer checked
#: Output per decompression call (a large sample is joined from these once).
_STEP = 8 * 1024 * 1024


def gunzip(data: bytes | bytearray | memoryview, max_bytes: int) -> bytes:
    """Decompress gzip ``data`` (one or more members) in a stream, to at most ``max_bytes``.

    Args:
        data: the compressed bytes.
        max_bytes: the largest output accepted (``loader.max_sample_bytes``, named in the error).

    Raises:
        ValueError: the output would be larger than ``max_bytes`` (a decompression bomb, or a
            sample over the limit), or trailing bytes are not gzip.
        EOFError: the data ends before the end of a member (truncated).
        zlib.error: the data is not gzip, or a member fails its CRC or length check.
    """
    view = memoryview(data)
    if not len(view):
        return b""
    out: list[bytes] = []
    size = 0
    while True:
        stream = zlib.decompressobj(_GZIP)
        pending: bytes | memoryview = view
        while not stream.eof:
            chunk = stream.decompress(pending, min(_STEP, max_bytes - size + 1))
            out.append(chunk)
            size += len(chunk)
            if size > max_bytes:
                raise ValueError(
                    f"gzip data expands past {format_size(max_bytes)} (loader.max_sample_bytes); "
                    "refused as a decompression bomb (raise loader.max_sample_bytes if such "
                    "samples are real)"
                )
            pending = stream.unconsumed_tail
            if not chunk and not pending and not stream.eof:
                raise EOFError("gzip data is truncated (no end-of-stream marker)")
        rest = stream.unused_data
        if not rest.strip(b"\0"):  # another member, or zero padding as gzip.decompress allows
            return out[0] if len(out) == 1 else b"".join(out)
        if rest[:2] != b"\x1f\x8b":
            raise ValueError("trailing bytes after the gzip data are not gzip")
        view = memoryview(rest)


def gunzip_chunks(chunks: Iterable[bytes], step: int = 1024 * 1024) -> Iterator[bytes]:
    """Decompress a stream of gzip ``chunks`` (one or more members), yielding at most ``step``
    bytes at a time: what a caller keeps of the output is its own bound (a bomb costs a step).

    Raises:
        ValueError: trailing bytes after the gzip data are not gzip.
        EOFError: the data ends before the end of a member (truncated).
        zlib.error: the data is not gzip, or a member fails its CRC or length check.
    """
    stream: Any = None  # the member being read; None between members
    begun = False  # a member has started: the end of the input must not come first
    for chunk in chunks:
        pending: bytes = chunk
        while pending:
            if stream is None:
                if not pending.strip(b"\0"):  # zero padding after the last member
                    pending = b""
                    break
                if begun and pending[:1] != b"\x1f":
                    raise ValueError("trailing bytes after the gzip data are not gzip")
                stream, begun = zlib.decompressobj(_GZIP), True
            out = stream.decompress(pending, step)
            if out:
                yield out
            if stream.eof:
                pending, stream = stream.unused_data, None
            else:
                pending = stream.unconsumed_tail
    if stream is not None:
        while not stream.eof:  # output held back by `step`
            out = stream.decompress(b"", step)
            if not out:
                raise EOFError("gzip data is truncated (no end-of-stream marker)")
            yield out


def key_digest(key: str) -> str:
    """``sha256:`` and the first 16 hex digits of the digest of ``key`` (its UTF-8 bytes): what
    names a key too long to show whole."""
    digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()
    return f"sha256:{digest[:16]}"


def cut_key(key: str) -> str:
    """``key`` as it is shown and kept beside the samples: whole up to `KEY_SHOWN_CHARS`,
    else its first 160 and last 40 characters with its length and `key_digest` between
    them (the tail keeps the extension), so that two long keys stay told apart."""
    if len(key) <= KEY_SHOWN_CHARS:
        return key
    return f"{key[:160]}...[{len(key):,} characters, {key_digest(key)}]...{key[-40:]}"


def cut_text(text: str, limit: int = TEXT_SHOWN_CHARS, keys: Iterable[str] = ()) -> str:
    """``text`` (a message, a reason) with each of ``keys`` in it cut (`cut_key`, so its
    digest is the key's), then any other run of more than `KEY_SHOWN_CHARS`
    non-blank characters, then the whole cut to ``limit`` characters (its head and tail, and
    how long it was). Linear in the text."""
    for key in keys:
        if len(key) > KEY_SHOWN_CHARS and key in text:
            text = text.replace(key, cut_key(key))
    if len(text) > KEY_SHOWN_CHARS:
        text = _WORD.sub(lambda m: cut_key(m.group(0)), text)  # short runs come back as they are
    if len(text) <= limit:
        return text
    tail = limit // 8
    return f"{text[: limit - tail]}...[{len(text):,} characters]...{text[-tail:]}"


#: Held around every parse of an ``.npy`` header (``ast.literal_eval``, also inside numpy's
#: ``read_array_header``). CPython before 3.13 keeps the AST converter's recursion depth in
#: interpreter-wide state: two threads converting at once (a thread switch during a garbage
#: collection inside one) fail with "SystemError: AST constructor recursion depth mismatch",
#: and the sampler's content check then quarantined a valid sample (seen once in an S3 ingest
#: with concurrent fetch threads; python/cpython#106905). A parse takes microseconds and
#: parsed headers are cached, so the lock costs nothing measurable.
AST_LOCK = threading.Lock()

