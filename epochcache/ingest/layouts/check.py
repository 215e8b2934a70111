"""Cheap content checks run on ingest, so a truncated or damaged object is quarantined, not cached.

* ``size`` and ``checksum``: against the listing or manifest, when it gives them;
* ``format``, by extension: gzip (full decompression, which verifies the CRC and length, bounded
  by ``max_bytes``: a decompression bomb is refused past it), ``.npy``
  (header parse and data length), ``.json`` (parse), ``.npz``/``.zip`` (member CRCs, inflated in
  steps to at most ``max_bytes`` in all; stored, deflate and bzip2 members), ``.tar`` (member
  integrity). Unknown extensions pass.

Every failure raises [`CorruptSample`][epochcache.CorruptSample] naming the key and what was wrong.
"""

from __future__ import annotations

import bz2
import functools
import hashlib
import io
import json
import struct
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from ...errors import CorruptSample
from ...limits import AST_LOCK, DEFAULT_MAX_SAMPLE_BYTES, gunzip
from ...units import format_size
from ..types import CHECKS

_ALGO_BY_LENGTH = {8: "crc32", 32: "md5", 40: "sha1", 64: "sha256"}


def digest(data: bytes, algorithm: str) -> str:
    """Hex digest of ``data`` with ``crc32``, ``md5``, ``sha1`` or ``sha256``."""
    if algorithm == "crc32":
        return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"
    if algorithm in ("md5", "sha1", "sha256"):
        return hashlib.new(algorithm, data).hexdigest()
    raise ValueError(f"checksum algorithm {algorithm!r}: unknown (use crc32, md5, sha1 or sha256)")


def parse_checksum(value: str) -> tuple[str, str]:
    """Split ``"algo:hex"`` or bare hex into ``(algorithm, hex)``."""
    algo, sep, hexdigest = value.strip().lower().partition(":")
    if not sep:
        hexdigest = algo
        algo = _ALGO_BY_LENGTH.get(len(hexdigest), "")
        if not algo:
            raise ValueError(
                f"checksum {value!r}: cannot tell the algorithm from {len(hexdigest)} hex digits "
                "(write it as sha256:<hex>, md5:<hex> or crc32:<hex>)"
            )
    return algo, hexdigest


class StreamDigest:
    """The digest of an object read as a stream, to compare with its manifest checksum.

    Raises:
        CorruptSample: the checksum names no known algorithm.
    """

    def __init__(self, key: str, checksum: str, url: str = "") -> None:
        self.key, self.url = key, url
        try:
            self.algo, self.expected = parse_checksum(checksum)
            if self.algo not in ("crc32", "md5", "sha1", "sha256"):
                digest(b"", self.algo)  # raises the error that names the algorithms
        except ValueError as exc:
            raise CorruptSample(f"{key}: {exc}", url, key) from exc
        self._crc = 0
        self._hash = None if self.algo == "crc32" else hashlib.new(self.algo)

    def update(self, data: bytes) -> None:
        if self._hash is None:
            self._crc = zlib.crc32(data, self._crc)
        else:
            self._hash.update(data)

    def mismatch(self) -> CorruptSample | None:
        """The error to report when what was read does not match (None: it matches)."""
        actual = (f"{self._crc & 0xFFFFFFFF:08x}" if self._hash is None
                  else self._hash.hexdigest())
        if actual == self.expected:
            return None
        return CorruptSample(f"{self.key}: {self.algo} mismatch: got {actual}, the manifest says "
                             f"{self.expected}", self.url, self.key)


def check_size(key: str, data: bytes, size: int | None, url: str = "") -> None:
    """Raise CorruptSample if ``data`` is not ``size`` bytes long (no-op when size is unknown)."""
    if size is not None and len(data) != size:
        raise CorruptSample(
            f"{key}: size mismatch: got {len(data)} bytes, the listing says {size} "
            "(truncated or changed object)",
            url,
            key,
        )


def check_checksum(key: str, data: bytes, checksum: str | None, url: str = "") -> None:
    """Raise CorruptSample if the digest of ``data`` differs from ``checksum``."""
    if not checksum:
        return
    try:
        algo, expected = parse_checksum(checksum)
        actual = digest(data, algo)
    except ValueError as exc:
        raise CorruptSample(f"{key}: {exc}", url, key) from exc
    if actual != expected:
        raise CorruptSample(
            f"{key}: {algo} mismatch: got {actual}, the manifest says {expected}", url, key
        )


def _check_gzip(data: bytes, max_bytes: int = DEFAULT_MAX_SAMPLE_BYTES) -> None:
    gunzip(data, max_bytes)  # verifies the CRC32 and ISIZE trailer of every member


def _check_npy(data: bytes) -> None:
    buffer = io.BytesIO(data)
    version = np.lib.format.read_magic(buffer)
    with AST_LOCK:  # numpy parses the header with ast.literal_eval (see limits.AST_LOCK)
        if version == (1, 0):
            shape, _fortran, dtype = np.lib.format.read_array_header_1_0(buffer)
        else:
            shape, _fortran, dtype = np.lib.format.read_array_header_2_0(buffer)
    if dtype.hasobject:
        return  # pickled payload: its length cannot be told from the header
    expected = buffer.tell() + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) != expected:
        raise ValueError(f"npy data is {len(data)} bytes, header {shape} {dtype} needs {expected}")


def _check_json(data: bytes) -> None:
    json.loads(data)


def _check_zip(data: bytes, max_bytes: int = DEFAULT_MAX_SAMPLE_BYTES) -> None:
    """Every member's CRC, inflating at most ``max_bytes`` in all (``zipfile.testzip`` inflates
    every member whole: a 1 MiB ``.npz`` of 1 GiB of zeros cost 3.5 s of CPU, bzip2 members
    hours). Members are inflated in steps of `_ZIP_STEP` output bytes, counted as they
    come, so a bomb stops at the bound whatever its headers claim."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        members = archive.infolist()
        claimed = sum(info.file_size for info in members)
        if claimed > max_bytes:
            raise ValueError(f"its members expand to {format_size(claimed)}, more than the "
                             f"{format_size(max_bytes)} a sample may be (loader.max_sample_bytes)")
        total = 0
        for info in members:
            if info.flag_bits & 0x1:
                raise ValueError(f"zip member {info.filename[:120]!r} is encrypted")
            crc = 0
            for chunk in _inflate(data, info, max_bytes - total):
                crc = zlib.crc32(chunk, crc)
                total += len(chunk)
            if crc != info.CRC:
                raise ValueError(f"zip member {info.filename[:120]!r} fails its CRC")


#: Output bytes inflated per step of a zip member.
_ZIP_STEP = 1024 * 1024


def _inflate(data: bytes, info: zipfile.ZipInfo, budget: int) -> Iterator[bytes]:
    """A member's bytes, in steps of at most `_ZIP_STEP`; ValueError past ``budget``
    bytes or the member's own size."""
    start = info.header_offset
    if data[start : start + 4] != b"PK\x03\x04":
        raise ValueError(f"zip member {info.filename[:120]!r}: no local header at {start}")
    name_len, extra_len = struct.unpack_from("<HH", data, start + 26)
    begin = start + 30 + name_len + extra_len
    raw = memoryview(data)[begin : begin + info.compress_size]
    limit = min(budget, info.file_size)
    size = 0
    if info.compress_type == zipfile.ZIP_STORED:
        pieces: Iterator[bytes] = (bytes(raw[i : i + _ZIP_STEP]) for i in range(0, len(raw),
                                                                                _ZIP_STEP))
    elif info.compress_type == zipfile.ZIP_DEFLATED:
        pieces = _stream(zlib.decompressobj(-15), raw)
    elif info.compress_type == zipfile.ZIP_BZIP2:
        pieces = _stream(bz2.BZ2Decompressor(), raw)
    else:
        raise ValueError(f"zip member {info.filename[:120]!r}: compression method "
                         f"{info.compress_type} is not checked (stored, deflate and bzip2 are)")
    for piece in pieces:
        size += len(piece)
        if size > limit:
            raise ValueError(f"zip member {info.filename[:120]!r} inflates past its stated "
                             f"{format_size(info.file_size)} (or loader.max_sample_bytes)")
        yield piece
    if size != info.file_size:
        raise ValueError(f"zip member {info.filename[:120]!r} is {size} bytes, its header says "
                         f"{info.file_size}")


def _stream(decompressor: Any, raw: memoryview) -> Iterator[bytes]:
    """Inflate ``raw`` in steps of at most `_ZIP_STEP` output bytes."""
    if isinstance(decompressor, bz2.BZ2Decompressor):
        piece = decompressor.decompress(bytes(raw), _ZIP_STEP)
        while True:
            yield piece
            if decompressor.eof or decompressor.needs_input:
                return
            piece = decompressor.decompress(b"", _ZIP_STEP)
    pending: bytes | memoryview = raw
    while pending and not decompressor.eof:
        piece = decompressor.decompress(pending, _ZIP_STEP)
        pending = decompressor.unconsumed_tail
        yield piece
        if not piece and pending:
            raise ValueError("deflate stream makes no progress")
    yield decompressor.flush()


def _check_tar(data: bytes) -> None:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
        for member in archive:
            if member.isfile():
                handle = archive.extractfile(member)
                if handle is None or len(handle.read()) != member.size:
                    raise ValueError(f"tar member {member.name!r} is truncated")


_FORMAT_CHECKS: dict[str, Callable[[bytes], Any]] = {
    "gz": _check_gzip,
    "gzip": _check_gzip,
    "tgz": _check_gzip,
    "npy": _check_npy,
    "json": _check_json,
    "npz": _check_zip,
    "zip": _check_zip,
    "tar": _check_tar,
}


def check_format(key: str, name: str, data: bytes, url: str = "",
                 max_bytes: int = DEFAULT_MAX_SAMPLE_BYTES) -> None:
    """Run the cheap check for the last extension of ``name`` (a key or a tar field).

    Raises:
        CorruptSample: the content does not parse as its extension says (or a gzip member
            expands past ``max_bytes``).
    """
    ext = name.rsplit(".", 1)[-1].lower()
    check = _FORMAT_CHECKS.get(ext)
    if check is None:
        return
    if check in (_check_gzip, _check_zip):
        check = functools.partial(check, max_bytes=max_bytes)
    try:
        check(data)
    except Exception as exc:  # any parse failure of untrusted bytes means corrupt, never a crash
        raise CorruptSample(
            f"{key}: not a valid .{ext} ({type(exc).__name__}: {exc})", url, key
        ) from exc


def check_object(
    key: str,
    data: bytes,
    *,
    size: int | None = None,
    checksum: str | None = None,
    checks: Iterable[str] = CHECKS,
    url: str = "",
    max_bytes: int = DEFAULT_MAX_SAMPLE_BYTES,
) -> None:
    """Run the enabled checks (``size``, ``checksum``, ``format``) on one fetched object;
    ``max_bytes`` bounds what a gzip check may decompress."""
    enabled = set(checks)
    if "size" in enabled:
        check_size(key, data, size, url)
    if "checksum" in enabled:
        check_checksum(key, data, checksum, url)
    if "format" in enabled:
        check_format(key, key, data, url, max_bytes)
