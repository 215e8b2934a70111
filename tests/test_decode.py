"""Decoders round-trip every format, refuse pickle without the opt-in, and name a bad sample's key."""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from common.writer import npy_bytes

from epochcache import Cache, DecodeError, PickleNotAllowed
from epochcache.data.decode import AutoDecoder, decode_sample, make_decoder


def _pt(value: object) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


ARRAY = np.arange(12, dtype=np.int16).reshape(3, 4)


@pytest.mark.parametrize(
    ("key", "data", "check"),
    [
        ("a/x.npy", npy_bytes(ARRAY), lambda v: np.array_equal(v, ARRAY) and v.flags.writeable),
        ("a/f.npy", npy_bytes(np.asfortranarray(ARRAY)), lambda v: np.array_equal(v, ARRAY)),
        ("x.npy.gz", gzip.compress(npy_bytes(ARRAY), mtime=0), lambda v: np.array_equal(v, ARRAY)),
        ("x.pt", _pt({"w": torch.ones(2)}), lambda v: torch.equal(v["w"], torch.ones(2))),
        ("x.json", json.dumps({"a": [1, 2]}).encode(), lambda v: v == {"a": [1, 2]}),
        ("x.json.gz", gzip.compress(b'{"a": 1}', mtime=0), lambda v: v == {"a": 1}),
        ("x.txt", "héllo".encode(), lambda v: v == "héllo"),
        ("x.cls", b" 7\n", lambda v: v == 7),
        ("x.bin", b"\x00\x01", lambda v: v == b"\x00\x01"),
        ("noext", b"raw", lambda v: v == b"raw"),
    ],
)
def test_formats_round_trip(key: str, data: bytes, check: object) -> None:
    value = decode_sample(AutoDecoder(), key, data)
    assert check(value)  # type: ignore[operator]


def test_tar_fields_decoded_by_field_name() -> None:
    value = decode_sample(AutoDecoder(), "shard/0001", {"npy": npy_bytes(ARRAY), "cls": b"3",
                                                        "json": b"[1]"})
    assert np.array_equal(value["npy"], ARRAY) and value["cls"] == 3 and value["json"] == [1]


def test_pickle_refused_without_opt_in_and_names_key_and_fix() -> None:
    data = pickle.dumps({"a": 1})
    with pytest.raises(PickleNotAllowed) as info:
        decode_sample(AutoDecoder(), "x/y.pkl", data)
    assert "x/y.pkl" in str(info.value) and "allow_pickle" in str(info.value)
    assert info.value.key == "x/y.pkl"
    assert decode_sample(AutoDecoder(allow_pickle=True), "x/y.pkl", data) == {"a": 1}
    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(PickleNotAllowed):
        decode_sample(AutoDecoder(), "objects.npy", buf.getvalue())


def test_corrupt_sample_names_its_key() -> None:
    with pytest.raises(DecodeError, match="bad/one.npy") as info:
        decode_sample(AutoDecoder(), "bad/one.npy", npy_bytes(ARRAY)[:-5])
    assert info.value.key == "bad/one.npy"
    with pytest.raises(DecodeError, match="b.json"):
        decode_sample(AutoDecoder(), "b.json", b"{not json")
    with pytest.raises(DecodeError, match="c.npy.gz"):
        decode_sample(AutoDecoder(), "c.npy.gz", b"not gzip")


def test_callable_and_raw_decoders() -> None:
    assert decode_sample(make_decoder(lambda k, v: (k, len(v))), "k", b"abc") == ("k", 3)
    assert decode_sample(make_decoder("raw"), "k.npy", b"abc") == b"abc"
    with pytest.raises(ValueError, match="decode"):
        make_decoder("jpeg-magic")


def test_dataset_skips_and_counts_corrupt_samples(tmp_path: Path) -> None:
    cache = Cache(tmp_path / "c", "16MiB", sync=False)
    cache.put_many([("ok0.npy", npy_bytes(ARRAY)), ("broken.npy", b"\x93NUMPY garbage"),
                    ("ok1.npy", npy_bytes(ARRAY + 1))])
    with cache.dataset(0) as ds:
        with pytest.raises(DecodeError, match="broken.npy"):
            ds[1]
        with pytest.raises(DecodeError, match="broken.npy"):
            ds.get_batch([0, 1, 2])
    with cache.dataset(1, on_error="skip") as ds:
        assert ds[1] is None and ds.skipped == 1
        batch = ds.get_batch([0, 1, 2])
        assert batch.shape == (2, 3, 4) and ds.skipped == 2
        assert len(ds.__getitems__([0, 1, 2])) == 2


# -- untrusted input is bounded (issue 10, item 7) ------------------------------------------


def test_a_gzip_bomb_raises_a_decode_error_naming_the_key_at_the_default_limit() -> None:
    """A 4 MiB gzip member that expands to 4 GiB: decoding stops past the default 256 MiB. Run
    in a process whose address space is capped at 1.2 GiB, so that an unbounded decompression
    fails the test (MemoryError) instead of taking the machine's memory."""
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1200 << 20, 1200 << 20))\n"
        "from common.bombs import gzip_bomb\n"
        "from epochcache.data.decode import AutoDecoder, decode_sample\n"
        "from epochcache.errors import DecodeError\n"
        "bomb = gzip_bomb()\n"
        "assert len(bomb) < 5 << 20\n"
        "try:\n"
        "    decode_sample(AutoDecoder(), 'x/bomb.npy.gz', bomb)\n"
        "except DecodeError as exc:\n"
        "    print('KEY', exc.key)\n"
        "    print('MESSAGE', exc)\n"
        "print('PEAK_MIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)\n"
    )
    tests = Path(__file__).resolve().parent
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=tests,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(tests), os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines["KEY"] == "x/bomb.npy.gz"
    assert "'x/bomb.npy.gz'" in lines["MESSAGE"] and "expands past 256.0 MiB" in lines["MESSAGE"]
    assert "loader.max_sample_bytes" in lines["MESSAGE"]
    assert int(lines["PEAK_MIB"]) < 700


def test_max_sample_bytes_is_an_argument_of_datasets_and_loaders(tmp_path: Path) -> None:
    from common.bombs import gzip_bomb

    small = gzip.compress(npy_bytes(np.zeros((64, 64), np.float32)))  # 16 KiB inside
    with Cache(tmp_path / "cache", "64MiB") as cache:
        cache.put_many([("a/bomb.npy.gz", gzip_bomb(64)), ("a/ok.npy.gz", small)])
        bomb_seq, ok_seq = cache.seq_of("a/bomb.npy.gz"), cache.seq_of("a/ok.npy.gz")
        with cache.dataset(max_sample_bytes=1024**2) as ds:
            index = {int(s): i for i, s in enumerate(ds.seqs)}
            assert ds[index[ok_seq]].shape == (64, 64)
            with pytest.raises(DecodeError, match="expands past 1.0 MiB") as info:
                ds[index[bomb_seq]]
            assert info.value.key == "a/bomb.npy.gz"
        with cache.dataset(max_sample_bytes=8 * 1024) as ds:  # smaller than the good one
            with pytest.raises(DecodeError, match="expands past 8.0 KiB"):
                ds[{int(s): i for i, s in enumerate(ds.seqs)}[ok_seq]]
        with pytest.raises(ValueError, match="max_sample_bytes"):
            cache.dataset(max_sample_bytes=0)


def test_an_npy_header_over_numpys_limit_is_refused_before_it_is_parsed() -> None:
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }"
    padded = header + " " * (20_000 - len(header) - 1) + "\n"  # legal, but 20 kB
    data = b"\x93NUMPY\x02\x00" + len(padded).to_bytes(4, "little") + padded.encode("latin1")
    data += np.zeros(2, np.float32).tobytes()
    with pytest.raises(DecodeError, match="header is 20000 bytes, over the 10000") as info:
        decode_sample(AutoDecoder(), "big-header.npy", data)
    assert info.value.key == "big-header.npy"
