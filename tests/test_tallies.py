"""Figures counted where the reader works come back to the loop, per epoch (issue 36, item 1).

A figure marked ``tally=True`` in `epochcache.epoch_record` is counted by the reader, in the
training process or in a DataLoader worker, into its loader's `Tallies` block, and
`EpochLoader.tallies` gives an epoch's counts: with workers started by fork and by spawn,
while the next epoch's workers (the other of epochs()' two loaders) already prefetch its
batches. Real workers, a real cache with damaged samples skipped under ``on_error="skip"``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from common.writer import npy_bytes
from torch.utils.data import DataLoader

from epochcache import Cache
from epochcache.store.records import pack_fields

ARRAY = np.arange(12, dtype=np.float32).reshape(3, 4)
GOOD, BROKEN, EPOCHS = 37, 3, 3


def _cache(path: Path) -> Cache:
    cache = Cache(path, "16MiB", sync=False)
    items = [(f"ok{i:03d}.npy", npy_bytes(ARRAY + i)) for i in range(GOOD)]
    items += [(f"broken{i}.npy", b"\x93NUMPY garbage") for i in range(BROKEN)]
    cache.put_many(items)
    return cache


@pytest.mark.parametrize("context", [None, "fork", "spawn"],
                         ids=["in-process", "fork", "spawn"])
def test_each_epoch_gets_what_its_own_reads_counted(tmp_path: Path, context: str | None) -> None:
    cache = _cache(tmp_path / "c")
    workers = {} if context is None else {"num_workers": 2, "multiprocessing_context": context}
    counted, samples = [], []
    try:
        # 5 batches an epoch, the next epoch's 4 prefetched batches read during this one's
        for _epoch, loader in cache.epochs(EPOCHS, batch_size=8, on_error="skip", **workers):
            samples.append(sum(len(batch) for batch in loader))
            counted.append(loader.tallies())
    finally:
        cache.close()
    assert samples == [GOOD] * EPOCHS
    assert [c["skipped"] for c in counted] == [BROKEN] * EPOCHS, counted
    # the bytes decoded: every good sample's payload, once an epoch (a batch holding a
    # broken sample falls back from the raw .npy path to the general one)
    payload = len(npy_bytes(ARRAY))
    assert [c["decoded_bytes"] for c in counted] == [GOOD * payload] * EPOCHS, counted


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_the_bytes_decoded_by_the_multi_field_path_and_the_general_one(
        tmp_path: Path, compression: str) -> None:
    """Raw multi-field records take their fast path, compressed ones the general decoder:
    both count each sample's payload as it was put (``pack_fields``'s container)."""
    records = [{"npy": npy_bytes(ARRAY + i), "cls": str(i).encode()} for i in range(20)]
    cache = Cache(tmp_path / "c", "16MiB", sync=False, compression=compression)
    try:
        cache.put_many([(f"s/{i:04d}", record) for i, record in enumerate(records)])
        for _epoch, loader in cache.epochs(1, batch_size=8, fields=("npy", "cls")):
            assert sum(len(labels) for _arrays, labels in loader) == len(records)
            counted = loader.tallies()
    finally:
        cache.close()
    assert counted["decoded_bytes"] == sum(len(pack_fields(r)) for r in records), counted


def test_a_stream_counts_what_its_workers_read(tmp_path: Path) -> None:
    cache = _cache(tmp_path / "c")
    try:
        with cache.stream(on_error="skip") as stream:
            loader = DataLoader(stream, batch_size=8, num_workers=2,
                                multiprocessing_context="fork")
            seen = [sum(len(batch) for batch in loader) for _epoch in range(2)]
            assert seen == [GOOD, GOOD]
            counted = stream.tallies()
            assert counted["skipped"] == 2 * BROKEN, counted
            assert counted["decoded_bytes"] == 2 * GOOD * len(npy_bytes(ARRAY)), counted
    finally:
        cache.close()
