"""fields= turns multi-field samples into tuples, as WebDataset's to_tuple does: order,
alternatives, __key__, single-object samples, and a missing field named with its key."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from common.writer import npy_bytes

from epochcache import Cache, DecodeError
from epochcache.data.fields import FieldSelector, parse_fields

ARRAY = np.arange(6, dtype=np.int16).reshape(2, 3)


@pytest.fixture
def cache(tmp_path: Path) -> Cache:
    cache = Cache(tmp_path / "c", "16MiB", sync=False)
    cache.put_many([
        ("shard/0001", {"npy": npy_bytes(ARRAY), "cls": b"3", "json": b'{"a": 1}'}),
        ("shard/0002", {"NPY": npy_bytes(ARRAY + 1), "cls": b"4"}),  # no json; name case
        ("shard/0003", {"txt": b"hello", "cls": b"5"}),  # no array at all
    ])
    return cache


def test_parse_fields() -> None:
    assert parse_fields(("jpg;png;webp", "cls")) == (("jpg", "png", "webp"), ("cls",))
    assert parse_fields("jpg;png cls") == (("jpg", "png"), ("cls",))
    for bad in ((), ("jpg", ""), ("jpg", 3), {"jpg": 1}):
        with pytest.raises(ValueError, match="fields"):
            parse_fields(bad)  # type: ignore[arg-type]


def test_tuple_in_the_order_asked_with_alternatives(cache: Cache) -> None:
    with cache.dataset(fields=("cls", "npy;txt")) as ds:
        first, second, third = ds[0], ds[1], ds[2]
    assert first[0] == 3 and np.array_equal(first[1], ARRAY)
    assert second[0] == 4 and np.array_equal(second[1], ARRAY + 1)  # "npy" matched "NPY"
    assert third == (5, "hello")


def test_missing_field_names_the_key_and_the_field(cache: Cache) -> None:
    with cache.dataset(fields=("npy", "json")) as ds:
        assert ds[0][1] == {"a": 1}
        with pytest.raises(DecodeError) as info:
            ds[1]
    message = str(info.value)
    assert "shard/0002" in message and "'json'" in message and "NPY, cls" in message
    assert info.value.key == "shard/0002"


def test_missing_field_is_skipped_and_counted_with_on_error_skip(cache: Cache) -> None:
    with cache.dataset(fields=("npy", "cls"), on_error="skip") as ds:
        batch = ds.get_batch([0, 1, 2])
        assert ds.skipped == 1  # shard/0003 has no npy
    arrays, labels = batch
    assert torch.equal(labels, torch.tensor([3, 4]))
    assert torch.equal(arrays, torch.from_numpy(np.stack([ARRAY, ARRAY + 1])))


def test_key_field_and_raw_decoding(cache: Cache) -> None:
    with cache.dataset(fields=("__key__", "cls"), decode="raw") as ds:
        assert ds[2] == ("shard/0003", b"5")


def test_custom_decoder_runs_first_and_must_return_fields(cache: Cache) -> None:
    def decode(key: str, value: dict[str, bytes]) -> dict[str, object]:
        return {name.lower(): len(data) for name, data in value.items()}

    with cache.dataset(fields=("cls", "npy"), decode=decode) as ds:
        assert ds[1] == (1, len(npy_bytes(ARRAY)))
    with cache.dataset(fields=("cls",), decode=lambda key, value: 7) as ds:
        with pytest.raises(DecodeError, match="shard/0001.*dict of fields"):
            ds[0]


def test_single_object_samples_answer_to_their_extensions(tmp_path: Path) -> None:
    cache = Cache(tmp_path / "c", "16MiB", sync=False)
    cache.put_many([("a/x.0001.json", json.dumps([1]).encode()),
                    ("a/y.npy.gz", __import__("gzip").compress(npy_bytes(ARRAY)))])
    with cache.dataset(fields=("json;npy", "__key__")) as ds:
        assert ds[0] == ([1], "a/x.0001.json")  # "0001.json" answers to "json" too
        value, key = ds[1]
        assert np.array_equal(value, ARRAY) and key == "a/y.npy.gz"
    with cache.dataset(fields=("0001.json",)) as ds:
        assert ds[0] == ([1],)


def test_selector_pickles_into_workers(cache: Cache) -> None:
    import pickle

    selector = pickle.loads(pickle.dumps(FieldSelector(("npy", "cls"))))
    assert selector.selection == (("npy",), ("cls",))
    labels = []
    for _epoch, loader in cache.epochs(1, batch_size=2, fields=("cls",), num_workers=1,
                                       shuffle=False):
        for (batch,) in loader:
            labels += batch.tolist()
    assert sorted(labels) == [3, 4, 5]
