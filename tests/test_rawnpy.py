"""The raw .npy fast path gives exactly what the general decoder gives, whatever the batch mixes.

The fast path recognises records by a template (key length, ``.npy`` suffix, ``.npy`` header);
these tests feed it records that differ from the template in each of those ways and check every
batch and every ``dataset[i]`` against the general decoder, sample by sample.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from common.writer import npy_bytes, sample_array

from epochcache import Cache
from epochcache.data.raw import NpyTemplate


def _general(cache: Cache, ds: object, indices: list[int]) -> list[object]:
    """What the general path (no templates) decodes for these dataset indices."""
    return ds.reader.read_samples(ds.seqs[indices])  # type: ignore[attr-defined]


F = 1024  # 4 KiB arrays: incompressible, so stored raw (the header alone does not pay)


def _array(i: int, floats: int = F) -> bytes:
    return npy_bytes(sample_array(i, floats))


def _mixed_items() -> list[tuple[str, bytes]]:
    items = [(f"s/{i:07d}.npy", _array(i)) for i in range(40)]
    items += [(f"s/{i}.npy", _array(i)) for i in range(100, 110)]  # other key lengths
    items += [("upper/0000001.NPY", _array(200))]  # suffix case
    items += [("zeros/0000001.npy", npy_bytes(np.zeros(F, np.float32)))]  # stored compressed
    items += [("shape/0000001.npy", _array(300, floats=F // 2))]  # another shape
    items += [("dtype/0000001.npy", npy_bytes(sample_array(301, F).view(np.int32)))]
    items += [("not/npy/0000001.bin", _array(302))]  # .npy bytes under another suffix
    items += [("fortran/000001.npy", npy_bytes(np.asfortranarray(sample_array(303, F).reshape(
        32, 32))))]
    return items


@pytest.fixture
def cache(tmp_path: Path) -> Cache:
    cache = Cache(tmp_path / "c", "16MiB", sync=False)
    cache.put_many(_mixed_items())
    return cache


def _same(a: object, b: object) -> bool:
    if isinstance(a, (np.ndarray, torch.Tensor)) and isinstance(b, (np.ndarray, torch.Tensor)):
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    return bool(a == b)


def test_items_match_the_general_decoder_in_any_order(cache: Cache) -> None:
    with cache.dataset() as ds:
        expected = _general(cache, ds, list(range(len(ds))))
        order = np.random.default_rng(0).permutation(len(ds))
        for i in order:  # the template changes whenever the previous sample differed
            assert _same(ds[int(i)], expected[i]), ds.key(int(i))
        keys = [ds.key(i) for i in range(len(ds))]
        assert isinstance(ds[keys.index("not/npy/0000001.bin")], bytes)  # another suffix: raw
        assert len(ds.reader._templates) >= 3  # the fast path did the work: key lengths, case


@pytest.mark.parametrize("odd", ["s/100.npy", "upper/0000001.NPY"])
def test_batches_mixing_key_lengths_stay_on_the_fast_path(cache: Cache, odd: str) -> None:
    with cache.dataset() as ds:
        keys = [ds.key(i) for i in range(len(ds))]
        indices = [0, keys.index(odd), 5, keys.index("s/109.npy"), 7]
        batch = ds.get_batch(indices)
        assert isinstance(batch, torch.Tensor) and batch.shape == (5, F)
        assert len(ds.reader._templates) == len({len(keys[i]) for i in indices})  # all fast
        for row, item in zip(batch, _general(cache, ds, indices)):
            assert _same(row, item)


def _outcome(fn: object) -> object:
    try:
        return fn()  # type: ignore[operator]
    except Exception as exc:  # the general path may refuse to collate a mix: so must we
        return type(exc)


@pytest.mark.parametrize("odd", ["zeros/0000001.npy", "shape/0000001.npy", "dtype/0000001.npy",
                                 "not/npy/0000001.bin", "fortran/000001.npy"])
def test_batches_with_an_odd_sample_give_what_the_general_path_gives(cache: Cache,
                                                                      odd: str) -> None:
    from epochcache.data.collate import collate_samples

    with cache.dataset() as ds:
        keys = [ds.key(i) for i in range(len(ds))]
        for indices in ([3, 4, keys.index(odd), 6], [keys.index(odd), 4]):
            got = _outcome(lambda: ds.get_batch(indices))  # noqa: B023 - called at once
            want = _outcome(lambda: collate_samples(_general(cache, ds, indices)))  # noqa: B023
            if isinstance(want, type):
                assert got is want, (odd, got)
            elif isinstance(want, list):
                assert isinstance(got, list) and len(got) == len(want)
                assert all(_same(a, b) for a, b in zip(got, want)), odd
            else:
                assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)
                assert got.shape == want.shape and got.dtype == want.dtype
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), odd


def test_template_rejects_what_it_cannot_copy() -> None:
    import struct

    from epochcache.store.records import HEADER

    def record(key: str, payload: bytes, codec: int = 0, flags: int = 0) -> memoryview:
        raw = key.encode()
        return memoryview(HEADER.pack(1, codec, flags, 0, len(payload), 0, len(raw)) + raw
                          + payload)

    good = npy_bytes(sample_array(1))
    template = NpyTemplate.of(record("a/1.npy", good))
    assert template is not None and template.shape == (64,) and template.nbytes == 256
    assert template.array(record("b/1.npy", good)).tobytes() == sample_array(1).tobytes()
    assert template.matches(record("a/2.npy", npy_bytes(sample_array(2))))
    assert not template.matches(record("a/10.npy", good))  # another key length
    assert not template.matches(record("a/2.npy", good, flags=1))  # a field container
    assert NpyTemplate.of(record("a/1.npy", good, codec=1)) is None  # compressed
    assert NpyTemplate.of(record("a/1.bin", good)) is None
    assert NpyTemplate.of(record("npy", good)) is None  # key shorter than the suffix
    assert NpyTemplate.of(record("a/1.npy", good[:-4])) is None  # truncated data
    assert NpyTemplate.of(record("a/1.npy", b"\x93NUMPY garbage")) is None
    assert NpyTemplate.of(memoryview(struct.pack("<B", 1))) is None


def _read_in_child(ds: object, indices: list[int], out: object) -> None:
    out.put([ds[i].tobytes() for i in indices])  # type: ignore[attr-defined, index]


def test_dataset_items_after_fork_use_the_childs_handles(cache: Cache) -> None:
    import multiprocessing as mp

    with cache.dataset() as ds:
        indices = list(range(0, 40, 3))
        before = [ds[i].tobytes() for i in indices]  # the parent's handles are now cached
        ctx = mp.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_read_in_child, args=(ds, indices, queue))
        child.start()
        got = queue.get(timeout=60)
        child.join(60)
        assert child.exitcode == 0 and got == before
        assert [ds[i].tobytes() for i in indices] == before  # the parent reads on
