"""Record framing: the checksum stays zlib's CRC-32 whichever implementation computes it, so
caches written by earlier versions verify and theirs verify ours; damage is detected."""

from __future__ import annotations

import os
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epochcache.errors import CacheCorrupted
from epochcache.store import records as codec
from epochcache.store.records import HEADER


def _payload_and_crc(record: bytes) -> tuple[bytes, int]:
    _version, _codec, _flags, crc, _raw, _ns, key_len = HEADER.unpack_from(record, 0)
    return record[HEADER.size + key_len:], crc


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=0, max_size=300_000), compress=st.booleans())
def test_the_record_checksum_is_zlibs_crc32_of_the_payload(data: bytes, compress: bool) -> None:
    record = codec.encode_record("k/x.bin", data, compress=compress)
    payload, crc = _payload_and_crc(record)
    assert crc == zlib.crc32(payload)
    assert codec.decode_payload(record) == data
    assert codec.check_record(record).raw_size == len(data)


def test_a_record_framed_with_zlibs_crc32_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """What earlier versions wrote (zlib.crc32) passes the check of this one."""
    monkeypatch.setattr(codec, "crc32", zlib.crc32)
    old = codec.encode_record("k/old.bin", os.urandom(3 << 20))
    monkeypatch.undo()
    assert codec.check_record(old).key == "k/old.bin"


@pytest.mark.parametrize("size", [200, 1 << 20])
def test_one_flipped_bit_in_a_large_payload_is_detected(size: int) -> None:
    record = bytearray(codec.encode_record("k/y.bin", os.urandom(size)))
    record[-size // 2] ^= 0x10
    with pytest.raises(CacheCorrupted, match="checksum mismatch"):
        codec.check_record(bytes(record))


def test_the_trial_stops_probing_a_kind_that_does_not_compress_and_resumes() -> None:
    trial = codec.CompressionTrial()
    noise, text = os.urandom(300_000), b"abc" * 100_000
    records = [codec.encode_record(f"s/{i}.bin", noise, trial=trial) for i in range(100)]
    assert all(codec.read_info(r).codec == codec.Codec.RAW for r in records)
    probed = sum(trial.should_try("bin") for _ in range(320))
    assert 5 <= probed <= 15  # one in TRIAL_EVERY once closed
    # another kind is judged on its own, and content that compresses again ends the trial
    assert codec.read_info(codec.encode_record("s/t.txt", text, trial=trial)).codec == codec.Codec.ZSTD
    for i in range(codec.TRIAL_EVERY):
        codec.encode_record(f"s/z{i}.bin", text, trial=trial)
    assert codec.read_info(codec.encode_record("s/after.bin", text, trial=trial)).codec == codec.Codec.ZSTD
    assert trial.should_try("bin")


@pytest.mark.parametrize("key, kind", [("a/b.npy", "npy"), ("x.tar/0001.jpg", "jpg"),
                                       ("noext", ""), ("a.b/c", ""), ("s/x.npy.gz", "gz")])
def test_the_kind_of_a_key_is_its_extension(key: str, kind: str) -> None:
    assert codec.CompressionTrial.kind(key) == kind
