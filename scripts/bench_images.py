#!/usr/bin/env python
"""Image loading benchmark (issue 12): epochcache against WebDataset on JPEG classification data.

A synthetic ImageNet-like set (20,000 JPEGs of 128x128-256x256 RGB, labels in 1000 classes) is
written once as WebDataset tar shards (``--data``, reused by later runs) and copied into an
epochcache cache as the daemon would store it (one ``{jpg, cls}`` record per sample). Every
contender decodes with simplejpeg and applies the same augmentation
(``epochcache.augment.RandomResizedCrop(112)``: random resized crop, flip, normalise) per
sample, then batches 64, at ``num_workers`` 0 and 2:

* epochcache: ``cache.epochs(fields=("jpg", "cls"), transform=...)``;
* WebDataset: ``WebDataset(shards).shuffle(1000).map(decode + augment).batched(64)`` through a
  ``DataLoader(batch_size=None)`` (its recommended shape), and once more with WebDataset's own
  decoder (``.decode("rgb8")``, Pillow) for reference.

litdata is left out: it does not install cleanly next to torch 2.13 CPU (pip resolves it to a
torch upgrade or a torchvision build for another torch).

First, JPEG decoding alone (why epochcache decodes JPEG with simplejpeg): Pillow
(``Image.open(...).convert("RGB")`` to a numpy array) against ``simplejpeg.decode_jpeg`` on the
same 1,000 images of the set, alternating, ``--rounds`` rounds.

Measured per contender: samples/s after the first batch over ``--samples`` samples, and the time
from creating the loader to its first batch. The contenders run back to back, ``--rounds``
rounds in alternating order; a ratio is the median of per-round ratios (shared machines drift).

Usage: .venv/bin/python scripts/bench_images.py [--images 20000] [--samples 3000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from epochcache import Cache
from epochcache.augment import RandomResizedCrop

BATCH = 64
PER_SHARD = 1000
AUGMENT = RandomResizedCrop(112)


# ------------------------------------------------------------------------------------- data


def _image(rng: np.random.Generator) -> np.ndarray:
    """A photo-like RGB image: a smooth random field, a few shapes, sensor noise."""
    from PIL import Image

    height, width = (int(v) for v in rng.integers(128, 257, 2))
    low = rng.uniform(0, 255, (rng.integers(3, 9), rng.integers(3, 9), 3)).astype(np.uint8)
    image = np.asarray(Image.fromarray(low).resize((width, height), Image.BILINEAR), np.float32)
    yy, xx = np.mgrid[0:height, 0:width]
    for _ in range(rng.integers(1, 4)):
        cy, cx, r = rng.uniform(0, height), rng.uniform(0, width), rng.uniform(10, 60)
        image[(yy - cy) ** 2 + (xx - cx) ** 2 < r * r] = rng.uniform(0, 255, 3)
    image += rng.normal(0, 6, image.shape)
    return np.clip(image, 0, 255).astype(np.uint8)


def write_dataset(root: str, images: int) -> list[str]:
    """WebDataset shards of ``images`` JPEGs under ``root`` (kept: later runs reuse them)."""
    from PIL import Image

    os.makedirs(root, exist_ok=True)
    count = (images + PER_SHARD - 1) // PER_SHARD
    shards = [os.path.join(root, f"train-{i:06d}.tar") for i in range(count)]
    if all(os.path.exists(s) for s in shards):
        return shards
    print(f"writing {images} JPEGs to {root} (once) ...", flush=True)
    rng = np.random.default_rng(0)
    for index, path in enumerate(shards):
        tmp = path + ".tmp"
        with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(index * PER_SHARD, min(images, (index + 1) * PER_SHARD)):
                buffer = io.BytesIO()
                Image.fromarray(_image(rng)).save(buffer, "JPEG", quality=90)
                for name, data in ((f"{i:08d}.jpg", buffer.getvalue()),
                                   (f"{i:08d}.cls", str(int(rng.integers(1000))).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        os.replace(tmp, path)
    return shards


def fill_cache(path: str, shards: list[str]) -> Cache:
    """The shards' samples as the sampler stores them: one ``{jpg, cls}`` record each."""
    cache = Cache(path, "4GiB", sync=False)
    for shard in shards:
        samples: dict[str, dict[str, bytes]] = {}
        with tarfile.open(shard) as tar:
            for member in tar:
                stem, field = member.name.split(".", 1)
                data = tar.extractfile(member).read()  # type: ignore[union-attr]
                samples.setdefault(f"{os.path.basename(shard)}/{stem}", {})[field] = data
        cache.put_many(list(samples.items()))
    return cache


# ------------------------------------------------------------------------------ contenders


class AugmentPair:
    """epochcache's per-sample transform: ``(image, label)`` -> ``(augmented, label)``."""

    def __call__(self, sample: tuple[np.ndarray, int]) -> tuple[torch.Tensor, int]:
        return AUGMENT(sample[0]), sample[1]


def _wds_decode_augment(sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
    import simplejpeg

    return AUGMENT(simplejpeg.decode_jpeg(sample["jpg"], colorspace="RGB")), int(sample["cls"])


def _wds_augment(sample: tuple[np.ndarray, int]) -> tuple[torch.Tensor, int]:
    return AUGMENT(sample[0]), int(sample[1])


def _collate(samples: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([s[0] for s in samples]), torch.tensor([s[1] for s in samples])


def wds_loader(shards: list[str], workers: int, own_decoder: bool = False) -> Any:
    import webdataset as wds

    pipeline = wds.WebDataset(shards, shardshuffle=len(shards), empty_check=False).shuffle(1000)
    if own_decoder:  # WebDataset's image decoding (Pillow), then the same augmentation
        pipeline = pipeline.decode("rgb8").to_tuple("jpg", "cls").map(_wds_augment)
    else:
        pipeline = pipeline.map(_wds_decode_augment)
    pipeline = pipeline.batched(BATCH, collation_fn=_collate)
    kwargs: dict[str, Any] = {"multiprocessing_context": "forkserver"} if workers else {}
    return DataLoader(pipeline, batch_size=None, num_workers=workers, **kwargs)


def _timed(batches: Any, samples: int, started: float) -> dict[str, float]:
    """Time to the first batch, and samples/s after it until ``samples`` were read."""
    first = None
    n = 0
    for images, _labels in batches:
        if first is None:
            first = time.perf_counter()
            continue  # the rate counts from the first batch on
        n += len(images)
        if n >= samples:
            break
    end = time.perf_counter()
    if first is None or n == 0:
        raise RuntimeError("the loader yielded too few batches")
    return {"first_batch_s": first - started, "rate": n / (end - first)}


def decode_rates(shards: list[str], rounds: int, count: int = 1000) -> dict[str, list[float]]:
    """Images/s of Pillow and simplejpeg decoding the same JPEGs to RGB arrays."""
    import simplejpeg
    from PIL import Image

    blobs: list[bytes] = []
    with tarfile.open(shards[0]) as tar:
        for member in tar:
            if member.name.endswith(".jpg") and len(blobs) < count:
                blobs.append(tar.extractfile(member).read())  # type: ignore[union-attr]

    def pillow(data: bytes) -> np.ndarray:
        with Image.open(io.BytesIO(data)) as image:
            return np.asarray(image.convert("RGB"))

    def turbo(data: bytes) -> np.ndarray:
        return simplejpeg.decode_jpeg(data, colorspace="RGB")  # type: ignore[no-any-return]

    if not np.array_equal(pillow(blobs[0]), turbo(blobs[0])):
        print("note: Pillow and simplejpeg decoded different pixels", flush=True)
    out: dict[str, list[float]] = {"pillow": [], "simplejpeg": []}
    for rnd in range(rounds):
        order = [("pillow", pillow), ("simplejpeg", turbo)]
        for name, fn in order if rnd % 2 == 0 else order[::-1]:
            started = time.perf_counter()
            for data in blobs:
                fn(data)
            out[name].append(len(blobs) / (time.perf_counter() - started))
    return out


def measure_ours(cache: Cache, workers: int, samples: int) -> dict[str, float]:
    started = time.perf_counter()
    epochs = cache.epochs(1, batch_size=BATCH, num_workers=workers, fields=("jpg", "cls"),
                          transform=AugmentPair(), samples_per_epoch=samples + BATCH,
                          seed=int(started))
    result = _timed((b for _epoch, loader in epochs for b in loader), samples, started)
    epochs.close()  # type: ignore[attr-defined]
    return result


def measure_wds(shards: list[str], workers: int, samples: int,
                own_decoder: bool = False) -> dict[str, float]:
    started = time.perf_counter()
    loader = wds_loader(shards, workers, own_decoder)
    iterator = iter(loader)
    try:
        return _timed(iterator, samples, started)
    finally:
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


# ------------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=20_000)
    parser.add_argument("--samples", type=int, default=3000, help="samples read per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data", default=os.path.join(tempfile.gettempdir(),
                                                       "epochcache-bench-images"))
    parser.add_argument("--json", default="bench_images.json")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as in DataLoader workers: the comparison is of the loaders
    shards = write_dataset(os.path.join(args.data, f"shards-{args.images}"), args.images)
    root = tempfile.mkdtemp(prefix="bench-images-")
    r: dict[str, Any] = {"images": args.images, "samples": args.samples, "batch": BATCH,
                         "cpus": os.cpu_count(), "shard_bytes": sum(map(os.path.getsize, shards))}
    try:
        print("JPEG decoding: Pillow vs simplejpeg ...", flush=True)
        r["decode"] = decode_rates(shards, args.rounds)
        print("filling the cache ...", flush=True)
        cache = fill_cache(os.path.join(root, "cache"), shards)
        r["cache_samples"] = cache.counters().samples
        for path in shards:  # warm the page cache for the shards as the cache is warm
            with open(path, "rb") as f:
                while f.read(1 << 24):
                    pass
        contenders = {
            **{f"ours_w{w}": (lambda w=w: measure_ours(cache, w, args.samples)) for w in (0, 2)},
            **{f"wds_w{w}": (lambda w=w: measure_wds(shards, w, args.samples)) for w in (0, 2)},
            "wds_own_decoder_w2": lambda: measure_wds(shards, 2, args.samples, own_decoder=True),
        }
        rounds: dict[str, list[dict[str, float]]] = {}
        for rnd in range(args.rounds):
            print(f"round {rnd + 1}/{args.rounds} ...", flush=True)
            items = list(contenders.items())
            if rnd % 2:
                items.reverse()
            for name, fn in items:
                rounds.setdefault(name, []).append(fn())
        r["rounds"] = rounds
        for name, values in rounds.items():
            r[name] = {key: float(np.median([v[key] for v in values])) for key in values[0]}
        for w in (0, 2):
            peers = [f"wds_w{w}"] + (["wds_own_decoder_w2"] if w == 2 else [])
            per_round = [rounds[f"ours_w{w}"][i]["rate"] / max(rounds[p][i]["rate"] for p in peers)
                         for i in range(args.rounds)]
            r[f"ratio_w{w}_rounds"] = per_round
            r[f"ratio_w{w}"] = float(np.median(per_round))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    with open(args.json, "w") as f:
        json.dump(r, f, indent=2)
    report(r)


def report(r: dict[str, Any]) -> None:
    dec = r["decode"]
    ratios = [s / p for s, p in zip(dec["simplejpeg"], dec["pillow"])]
    print(f"JPEG decode: Pillow {np.median(dec['pillow']):,.0f}/s, simplejpeg "
          f"{np.median(dec['simplejpeg']):,.0f}/s = {np.median(ratios):.2f}x "
          f"[rounds {min(ratios):.2f}-{max(ratios):.2f}]")
    print(f"{r['images']} JPEGs ({r['shard_bytes'] / 2**20:.0f} MiB of shards), "
          f"{r['samples']} samples per measurement, batch {r['batch']}, {r['cpus']} cores")
    print(f"{'contender':<34} {'samples/s (median [range])':<30} first batch (median)")
    for name, label in (("ours_w0", "epochcache epochs(), 0 workers"),
                        ("wds_w0", "WebDataset, 0 workers"),
                        ("ours_w2", "epochcache epochs(), 2 workers"),
                        ("wds_w2", "WebDataset, 2 workers"),
                        ("wds_own_decoder_w2", "WebDataset .decode('rgb8'), 2 wkr")):
        rates = [v["rate"] for v in r["rounds"][name]]
        print(f"{label:<34} {r[name]['rate']:>8,.0f} [{min(rates):,.0f}-{max(rates):,.0f}]"
              f"{'':<9} {r[name]['first_batch_s']:.2f} s")
    for w in (0, 2):
        values = r[f"ratio_w{w}_rounds"]
        print(f"epochcache / best peer, {w} workers: {r[f'ratio_w{w}']:.2f}x "
              f"[rounds {min(values):.2f}-{max(values):.2f}] (target >= 1.2)")


if __name__ == "__main__":
    main()
