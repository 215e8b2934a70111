"""Bounds on untrusted input: a source is someone else's bucket.

* :data:`DEFAULT_MAX_SAMPLE_BYTES` (256 MiB, ``loader.max_sample_bytes``) is the largest sample
  epochcache accepts: samplers refuse (quarantine) an object listed larger, or larger than the
  cache capacity, before downloading it, and read at most that much of one whose size is not
  listed; decompression (gzip) stops there on ingest and in the loader;
* :func:`gunzip` decompresses gzip in a stream and gives up as soon as the output passes the
  bound, so a 4 MiB bomb that would expand to 4 GiB costs at most the bound;
* manifests are read as a stream (:func:`gunzip_chunks` for ``.gz``), a line at a time: a
  line longer than :data:`MANIFEST_MAX_LINE_BYTES` is an error, the keys kept may take at
  most :data:`DEFAULT_MANIFEST_MAX_BYTES` (``source.manifest_max_bytes``) and at most
  :data:`DEFAULT_MANIFEST_MAX_LINES` lines are read (``source.manifest_max_lines``), so
  memory follows the keys kept, never the file or what it inflates to;
* :data:`NPY_MAX_HEADER_BYTES` caps a ``.npy`` header before it is parsed, as numpy does.

A base module: no layer, no fsspec, no torch. Callers turn the ``ValueError`` it raises into
their own error that names the key (``DecodeError``, ``CorruptSample``).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator
from typing import Any

from .units import format_size

DEFAULT_MAX_SAMPLE_BYTES = 256 * 1024 * 1024
#: The most memory the keys of a manifest may take (``source.manifest_max_bytes``)...
DEFAULT_MANIFEST_MAX_BYTES = 4 * 1024**3
#: ... the most lines read from it (``source.manifest_max_lines``)...
DEFAULT_MANIFEST_MAX_LINES = 100_000_000
#: ... and the longest line: one key (S3 keys are at most 1,024 bytes) and its columns.
MANIFEST_MAX_LINE_BYTES = 64 * 1024
#: numpy refuses ``.npy`` headers longer than this unless the file is fully trusted.
NPY_MAX_HEADER_BYTES = 10_000

_GZIP = 16 + zlib.MAX_WBITS  # zlib's gzip framing: header, CRC32 and length trailer checked
#: Output per decompression call (a large sample is joined from these once).
_STEP = 8 * 1024 * 1024


def gunzip(data: bytes | bytearray | memoryview, max_bytes: int,
           what: str = "loader.max_sample_bytes") -> bytes:
    """Decompress gzip ``data`` (one or more members) in a stream, to at most ``max_bytes``.

    Args:
        data: the compressed bytes.
        max_bytes: the largest output accepted.
        what: the setting that holds ``max_bytes``, named in the error.

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
                    f"gzip data expands past {format_size(max_bytes)} ({what}); refused as a "
                    f"decompression bomb (raise {what} if such samples are real)"
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
