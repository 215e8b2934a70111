"""The multi-field fast path gives exactly what the general decoder gives, whatever a batch mixes.

Records of ``{npy, cls}`` / ``{npy, json}`` are recognised by a template (key length, field
table, array lengths and ``.npy`` headers); these tests check every batch against the general
path (decode each sample, then collate), sample by sample, for uniform batches (which must
take the fast path) and for batches mixing records the template does not cover.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from common.writer import npy_bytes, sample_array

from epochcache import Cache
from epochcache.data.collate import collate_samples

F = 1024


def _rec(i: int, **extra: bytes) -> dict[str, bytes]:
    return {"npy": npy_bytes(sample_array(i, F)), "cls": str(i % 120).encode(), **extra}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                                b.view(torch.uint8) if b.is_floating_point() else b))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


def _general(ds: Any, indices: list[int]) -> Any:
    return collate_samples(ds.reader.read_samples(ds.seqs[indices]))


def _forbid_general(ds: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(seqs: Any) -> Any:
        raise AssertionError("took the general path")

    monkeypatch.setattr(ds.reader, "read_samples", fail)


@pytest.mark.parametrize("fields", [None, ("npy", "cls"), ("cls", "npy;png", "__key__"),
                                    ("cls", "npy", "cls", "npy")])
def test_uniform_records_take_the_fast_path_and_equal_the_general_decoder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fields: Any) -> None:
    cache = Cache(tmp_path / "c", "16MiB", sync=False)
    # Labels of 1, 2 and 3 digits, and keys of two lengths: one template per key length.
    cache.put_many([(f"shard-0/{i:06d}", _rec(i)) for i in range(130)]
                   + [(f"shard-10/{i:06d}", _rec(i)) for i in range(130, 140)])
    with cache.dataset(fields=fields) as ds:
        order = np.random.default_rng(0).permutation(len(ds)).tolist()
        batches = [order[s : s + 32] for s in range(0, len(order), 32)]
        want = [_general(ds, b) for b in batches]
        _forbid_general(ds, monkeypatch)
        got = [ds.get_batch(b) for b in batches]
        assert len(ds.reader._field_templates) == 2
    for w, g in zip(want, got):
        assert _same(w, g)
    assert isinstance(got[0], dict if fields is None else tuple)


def test_json_fields_and_fields_before_the_array(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    cache = Cache(tmp_path / "c", "16MiB", sync=False)
    items = []
    for i in range(40):
        doc = json.dumps({"label": i % 7, "w": 0.5 * i, "name": "x" * (i % 5)}).encode()
        # cls first, then the array, then a JSON document: lengths before the array vary
        items.append((f"s/{i:04d}", {"cls": str(i).encode(), "npy": npy_bytes(
            sample_array(i, F)), "json": doc}))
    cache.put_many(items)
    for fields in (None, ("npy", "json"), ("json", "cls")):
        with cache.dataset(fields=fields) as ds:
            batches = [list(range(s, min(s + 16, 40))) for s in range(0, 40, 16)]
            want = [_general(ds, b) for b in batches]
            _forbid_general(ds, monkeypatch)
            got = [ds.get_batch(b) for b in batches]
            monkeypatch.undo()
        for w, g in zip(want, got):
            assert _same(w, g), fields


def _mixed(tmp_path: Path) -> Cache:
    cache = Cache(tmp_path / "c", "16MiB", sync=False)
    items: list[tuple[str, Any]] = [(f"s/{i:06d}", _rec(i)) for i in range(30)]
    items += [
        ("odd/000001", _rec(100, txt=b"extra field")),  # a field only the general path knows
        ("odd/000002", {"npy": npy_bytes(np.zeros(F, np.float32)), "cls": b"1"}),  # zstd
        ("odd/000003", {"npy": npy_bytes(sample_array(3, F)), "cls": b" 7\n"}),  # spaces
        ("odd/000004", {"npy": npy_bytes(sample_array(4, F)), "cls": b"-2"}),  # a sign
        ("odd/000005", {"npy": npy_bytes(sample_array(5, F).reshape(32, 32)), "cls": b"1"}),
        ("odd/000006", {"npy": npy_bytes(sample_array(6, F)), "cls": b"x"}),  # not a number
        ("odd/000007", {"npy": npy_bytes(sample_array(7, F).view(np.int32)), "cls": b"1"}),
        ("odd/000008", {"cls": b"8", "npy": npy_bytes(sample_array(8, F))}),  # field order
        ("odd/000009", {"npy": npy_bytes(sample_array(9, F)), "cls": b"9" * 20}),  # > int64
    ]
    cache.put_many(items)
    return cache


def test_mixed_batches_fall_back_and_equal_the_general_decoder(tmp_path: Path) -> None:
    cache = _mixed(tmp_path)
    with cache.dataset(on_error="skip") as ds:
        n = len(ds)
        for odd in range(30, n):
            batch = [0, 1, odd, 2]  # the odd record in the middle of template matches
            want: Any = None
            try:
                want = _general(ds, batch)
            except (RuntimeError, TypeError, ValueError) as exc:  # cannot collate: both refuse
                with pytest.raises(type(exc)):
                    ds.get_batch(batch)
                continue
            assert _same(want, ds.get_batch(batch)), ds.key(odd)


def test_mixed_batches_with_fields_fall_back(tmp_path: Path) -> None:
    cache = _mixed(tmp_path)
    with cache.dataset(fields=("npy", "cls")) as ds:
        for odd in range(30, len(ds)):
            batch = [odd, 0, 1]
            try:
                want = _general(ds, batch)
            except (RuntimeError, TypeError, ValueError) as exc:
                with pytest.raises(type(exc)):
                    ds.get_batch(batch)
                continue
            assert _same(want, ds.get_batch(batch)), ds.key(odd)


def test_fast_path_through_epochs_with_workers(tmp_path: Path) -> None:
    cache = Cache(tmp_path / "c", "16MiB", sync=False)
    cache.put_many([(f"s/{i:06d}", _rec(i)) for i in range(100)])
    seen: dict[int, int] = {}
    for _epoch, loader in cache.epochs(1, batch_size=16, fields=("npy", "cls"), num_workers=2):
        for arrays, labels in loader:
            assert arrays.shape[1:] == (F,) and labels.dtype == torch.int64
            for array, label in zip(arrays, labels):
                index = int(array[0])  # sample_array writes its index into element 0
                seen[index] = int(label)
    assert seen == {i: i % 120 for i in range(100)}
