"""Large samples read in the training process are copied by two threads (data/collate.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from common.writer import npy_bytes, sample_array

from epochcache import Cache
from epochcache.data import collate

FLOATS = collate.SPLIT_BYTES // 4  # samples just large enough to be split


def test_large_samples_arrive_whole_and_in_order(tmp_path: Path) -> None:
    """Batches of samples of the split size, one stored under a longer key (another template,
    the same array layout), hold each sample's own array at its place in the epoch's order."""
    cache = Cache(tmp_path / "c", "64MiB", sync=False)
    cache.put_many([(f"s/{i:07d}.npy" if i != 5 else f"s/longer-key-{i:07d}.npy",
                     npy_bytes(sample_array(i, FLOATS))) for i in range(11)])
    seen = []
    for _epoch, loader in cache.epochs(1, batch_size=4, seed=1):
        for batch in loader:
            assert batch.shape[1:] == (FLOATS,)
            for row in batch.numpy():
                index = int(row[0])
                assert row.tobytes() == sample_array(index, FLOATS).tobytes(), index
                seen.append(index)
        assert seen == [int(loader.dataset.reader.cache.info(int(s)).key[-11:-4])
                        for s in loader.seqs]
    assert sorted(seen) == list(range(11))


def test_a_failed_copy_is_raised_and_the_next_batch_is_copied() -> None:
    rows = np.zeros((6, 8), np.uint8)
    good = [memoryview(bytes([i]) * 8) for i in range(6)]
    with pytest.raises(ValueError):
        collate.copy_rows(rows, [*good[:3], memoryview(b"short"), *good[4:]])
    collate.copy_rows(rows, good)
    assert rows.tolist() == [[i] * 8 for i in range(6)]
