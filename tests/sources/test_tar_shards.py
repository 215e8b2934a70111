"""Reading WebDataset shards: damage is contained to the sample it hits."""

from __future__ import annotations

import io
import tarfile

from epochcache.errors import CorruptSample
from epochcache.ingest.layouts.shards import iter_shard_ends


def _shard(samples: int) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for i in range(samples):
            for ext, data in (("npy", bytes([i]) * 5000), ("cls", str(i).encode())):
                info = tarfile.TarInfo(f"{i:06d}.{ext}")
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_a_shard_cut_inside_its_last_sample_keeps_the_samples_before_it() -> None:
    data = _shard(3)
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        last = archive.getmembers()[-2]  # 000002.npy
    results = [(ref, payload) for ref, payload, _end in
               iter_shard_ends("s.tar", data[: last.offset_data + 1000], check_formats=False)]
    assert [ref.key for ref, _ in results] == ["s.tar/000000", "s.tar/000001", "s.tar/000002"]
    assert results[1][1] == {"npy": bytes([1]) * 5000, "cls": b"1"}
    assert isinstance(results[2][1], CorruptSample) and "truncated" in str(results[2][1])


def test_a_whole_shard_yields_every_sample_with_its_members() -> None:
    results = [(ref, payload) for ref, payload, _end in
               iter_shard_ends("s.tar", _shard(3), check_formats=False)]
    assert all(isinstance(payload, dict) for _, payload in results)
    assert results[2][0].members == ("000002.npy", "000002.cls")
    assert results[2][0].shard == "s.tar"
