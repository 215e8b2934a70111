"""Decoders round-trip every format, refuse pickle without the opt-in, and name a bad sample's key."""

from __future__ import annotations

import gzip
import io
import json
import pickle
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
        ("x.npy.gz", gzip.compress(npy_bytes(ARRAY)), lambda v: np.array_equal(v, ARRAY)),
        ("x.pt", _pt({"w": torch.ones(2)}), lambda v: torch.equal(v["w"], torch.ones(2))),
        ("x.json", json.dumps({"a": [1, 2]}).encode(), lambda v: v == {"a": [1, 2]}),
        ("x.json.gz", gzip.compress(b'{"a": 1}'), lambda v: v == {"a": 1}),
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
