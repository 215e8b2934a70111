"""Hostile inputs: a gzip bomb built without ever holding its expansion in memory."""

from __future__ import annotations

import struct
import zlib
from functools import lru_cache

_MIB = 1024 * 1024
#: CRC32 of 4 GiB of zeros (computing it takes seconds; ``gzip_bomb`` checks smaller ones live)
_CRC_OF_ZEROS_MIB = {4096: 0xD202EF8D}


@lru_cache(maxsize=4)
def gzip_bomb(expanded_mib: int = 4096) -> bytes:
    """A valid gzip member of about ``expanded_mib / 1000`` MiB that expands to
    ``expanded_mib`` MiB of zeros (4 MiB -> 4 GiB by default), CRC and length trailer correct.

    Deflate blocks after a full flush do not refer back, so the block that encodes 1 MiB of
    zeros is the same every time and is simply repeated.
    """
    zeros = bytes(_MIB)
    deflate = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    first = deflate.compress(zeros) + deflate.flush(zlib.Z_FULL_FLUSH)
    block = deflate.compress(zeros) + deflate.flush(zlib.Z_FULL_FLUSH)
    end = deflate.flush(zlib.Z_FINISH)
    crc = _CRC_OF_ZEROS_MIB.get(expanded_mib)
    if crc is None:
        crc = 0
        for _ in range(expanded_mib):
            crc = zlib.crc32(zeros, crc)
    header = b"\x1f\x8b\x08\x00" + struct.pack("<I", 0) + b"\x02\xff"
    trailer = struct.pack("<II", crc, (expanded_mib * _MIB) & 0xFFFFFFFF)
    return header + first + block * (expanded_mib - 1) + end + trailer
