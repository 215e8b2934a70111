"""Cheap content checks run on ingest, so a truncated or damaged object is quarantined, not cached.

* ``size`` and ``checksum``: against the listing or manifest, when it gives them;
* ``format``, by extension: gzip (full decompression, which verifies the CRC and length, bounded
  by ``max_bytes``: a decompression bomb is refused past it), ``.npy``
  (header parse and data length), ``.json`` (parse), ``.npz``/``.zip`` (member CRCs), ``.tar`` (member
  integrity). Unknown extensions pass.

Every failure raises :class:`~epochcache.errors.CorruptSample` naming the key and what was wrong.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ...errors import CorruptSample
from ...limits import DEFAULT_MAX_SAMPLE_BYTES, gunzip
from .base import CHECKS

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


def _check_zip(data: bytes) -> None:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        bad = archive.testzip()
        if bad is not None:
            raise ValueError(f"zip member {bad!r} fails its CRC")


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


def format_checkable(name: str) -> bool:
    """Whether :func:`check_format` has a check for this name's last extension."""
    return name.rsplit(".", 1)[-1].lower() in _FORMAT_CHECKS


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
    if check is _check_gzip:
        check = functools.partial(_check_gzip, max_bytes=max_bytes)
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
