#!/usr/bin/env python
"""GPU benchmarks (issue 35): training fed from the cache against the GPU fed a fixed batch.

    .venv/bin/python scripts/bench_gpu.py                        on a CUDA machine (~5 minutes)
    .venv/bin/python scripts/bench_gpu.py --device cpu --quick   the same steps on the CPU, small

Needs a CUDA build of torch (``pip install torch==2.13.0`` from the CUDA index) in the venv; no
torchvision (ResNet-50 is built here when torchvision is missing). Every part runs in this one
command and prints its rows; everything also goes to ``bench_gpu.json``:

1. **The demo's CNN** (``epochcache.examples.make_cnn``, ``configs/demo.yaml``'s settings):
   images/s of training steps on the demo's 64x64 JPEGs of shapes read by ``cache.epochs(
   fields=("jpg;png", "cls"), image="torch", pin_memory=True)`` with JPEG decoding in workers and
   the augmentation on the GPU (as ``train_image_classifier`` does), against the same model and
   steps fed one fixed batch already on the GPU: the compute ceiling.
2. **ResNet-50-shaped inputs**: images/s training a ResNet-50 (bf16 autocast, channels last) on
   224x224x3 uint8 arrays stored raw in the cache (147 KiB each, read in process, pinned, made
   float and normalised on the GPU), against the same model fed a fixed on-GPU batch.
3. **1 MiB arrays to the GPU while ingesting**: the daemon turns the cache over (as
   scripts/bench_seed.py) while the loop copies each batch of 1 MiB float32 arrays to the GPU
   (``non_blocking=True`` from pinned batches), in process and with 2 workers: MB/s, next to
   the host-to-device bandwidth of one pinned 64 MiB copy (the link's ceiling) and memcpy's.
4. **tests/test_gpu.py**: NCCL under torchrun, and pinned batches read with one copy.

A ratio near 1 in parts 1 and 2 means the loader keeps the GPU busy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench_seed import MIB, write_dataset
from loader_rows import npy
from machine import core_probe, cores, memcpy_gbps
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import epochcache as ec  # noqa: E402 - this checkout's, after its path
from epochcache.augment import augment_batch  # noqa: E402
from epochcache.examples import make_cnn  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- ResNet-50 --------------------------------------------------------------------------------


class _Bottleneck(nn.Module):
    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        c_out = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(c_in, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width),
            nn.ReLU(inplace=True), nn.Conv2d(width, c_out, 1, bias=False), nn.BatchNorm2d(c_out))
        self.skip: nn.Module = (
            nn.Identity() if stride == 1 and c_in == c_out
            else nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                               nn.BatchNorm2d(c_out)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


def resnet50(num_classes: int = 1000) -> nn.Module:
    """torchvision's ResNet-50 where installed, else the same layers (bottlenecks 3-4-6-3)."""
    try:
        from torchvision.models import resnet50 as torchvision_resnet50
    except ImportError:
        pass
    else:
        model: nn.Module = torchvision_resnet50(num_classes=num_classes)
        return model
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                               nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    c_in = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for index in range(blocks):
            layers.append(_Bottleneck(c_in, width, stride if index == 0 else 1))
            c_in = 4 * width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, num_classes)]
    return nn.Sequential(*layers)


# -- training steps, from the cache and from a fixed batch ------------------------------------


class _Trainer:
    """One model, its optimizer and its step; ``prepare`` turns a batch from the loader into
    the model's inputs on the device."""

    def __init__(self, model: nn.Module, device: torch.device, prepare: Any,
                 channels_last: bool = False, bf16: bool = False) -> None:
        self.device, self.prepare, self.bf16 = device, prepare, bf16
        self.model = model.to(device)
        if channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)

    def step(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            loss = nn.functional.cross_entropy(self.model(inputs), labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()

    def from_cache(self, cache: ec.Cache, seconds: float, batch_size: int,
                   **loader: Any) -> dict[str, float]:
        """Images/s of steps on batches from ``cache.epochs()``, after a warm-up epoch."""
        images, started = 0, 0.0
        for epoch, batches in cache.epochs(1 << 20, batch_size=batch_size, **loader):
            for batch in batches:
                inputs, labels = self.prepare(batch)
                self.step(inputs, labels)
                if epoch > 0:
                    images += len(labels)
            _sync(self.device)
            if epoch == 0:
                started = time.perf_counter()
                continue
            if time.perf_counter() - started >= seconds and epoch >= 2:
                break
        return {"images_s": images / (time.perf_counter() - started)}

    def fixed(self, batch: Any, seconds: float) -> dict[str, float]:
        """Images/s of the same steps on one batch prepared once (on the device)."""
        inputs, labels = self.prepare(batch)
        inputs, labels = inputs.clone(), labels.clone()
        for _ in range(3):
            self.step(inputs, labels)
        _sync(self.device)
        steps, started = 0, time.perf_counter()
        while steps < 5 or time.perf_counter() - started < seconds:
            for _ in range(5):
                self.step(inputs, labels)
            steps += 5
            _sync(self.device)
        return {"images_s": steps * len(labels) / (time.perf_counter() - started)}


def first_batch(cache: ec.Cache, batch_size: int, **loader: Any) -> Any:
    """The first batch of an epoch of ``cache`` (the fixed batch)."""
    epochs = cache.epochs(1, batch_size=batch_size, **loader)
    try:
        for _epoch, batches in epochs:
            for batch in batches:
                return batch
    finally:
        epochs.close()
    raise RuntimeError("the cache is empty")


def demo_cnn(root: Path, device: torch.device, quick: bool, seconds: float) -> dict[str, Any]:
    from epochcache.demo import make_images

    count = 2_000 if quick else 20_000
    jpegs, labels = make_images(count, size=64)
    cache = ec.Cache(root / "demo", "1GiB", sync=False)
    for start in range(0, count, 1000):
        cache.put_many([(f"shard-{i // 1000:04d}.tar/{i:07d}",
                         {"jpg": jpegs[i], "cls": str(labels[i]).encode()})
                        for i in range(start, min(count, start + 1000))])
    generator = torch.Generator().manual_seed(0)

    def prepare(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        images, classes = batch
        images = images.to(device, non_blocking=True)
        return (augment_batch(images, 48, scale=(0.35, 1.0), generator=generator),
                classes.to(device, non_blocking=True).long())

    workers = 2 if quick else max(1, min(8, cores() - 2))
    loader = {"fields": ("jpg;png", "cls"), "image": "torch", "num_workers": workers,
              "pin_memory": device.type == "cuda"}
    trainer = _Trainer(make_cnn(10, 16), device, prepare)
    got = trainer.from_cache(cache, seconds, 256, **loader)
    ceiling = trainer.fixed(first_batch(cache, 256, **{**loader, "num_workers": 0}), seconds)
    cache.close()
    return {"workload": f"demo CNN, 64x64 JPEGs, batch 256, {workers} workers",
            "from_cache": got["images_s"], "fixed_batch": ceiling["images_s"]}


def resnet(root: Path, device: torch.device, quick: bool, seconds: float) -> dict[str, Any]:
    count, side, batch_size = (256, 64, 32) if quick else (2_000, 224, 128)
    rng = np.random.default_rng(0)
    cache = ec.Cache(root / "resnet", "2GiB", sync=False)
    for start in range(0, count, 100):
        cache.put_many([(f"train/{i:07d}.npy",
                         npy(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)))
                        for i in range(start, min(count, start + 100))])
    mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1) * 255
    labels = torch.arange(batch_size, device=device) % 1000

    def prepare(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        images = batch.to(device, non_blocking=True).permute(0, 3, 1, 2).float()
        images = ((images - mean) / std).contiguous(memory_format=torch.channels_last)
        return images, labels[: len(images)]

    trainer = _Trainer(resnet50(), device, prepare, channels_last=True,
                       bf16=device.type == "cuda")
    loader = {"pin_memory": device.type == "cuda", "drop_last": True}
    got = trainer.from_cache(cache, seconds, batch_size, **loader)
    ceiling = trainer.fixed(first_batch(cache, batch_size, **loader), seconds)
    cache.close()
    return {"workload": f"ResNet-50, {side}x{side}x3 uint8 arrays, batch {batch_size}, in process",
            "from_cache": got["images_s"], "fixed_batch": ceiling["images_s"]}


def h2d_gbps(device: torch.device, nbytes: int = 64 << 20, seconds: float = 0.5) -> float:
    """GB/s of one pinned buffer copied to the device again and again (the link's ceiling)."""
    if device.type != "cuda":
        return float("nan")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target.copy_(host, non_blocking=True)
    _sync(device)
    copies, started = 0, time.perf_counter()
    while copies == 0 or time.perf_counter() - started < seconds:
        target.copy_(host, non_blocking=True)
        copies += 1
        if copies % 8 == 0:
            _sync(device)
    _sync(device)
    return copies * nbytes / (time.perf_counter() - started) / 1e9


def arrays_to_gpu(root: Path, device: torch.device, quick: bool, seconds: float
                  ) -> dict[str, Any]:
    objects, capacity = (300, 192 * MIB) if quick else (3000, 2048 * MIB)
    write_dataset(root / "arrays", objects)
    config = {
        "source": {"url": f"file://{root / 'arrays'}", "pattern": "*.npy"},
        "cache": {"dir": str(root / "arrays-cache"), "capacity": capacity, "sync": False},
        "sampler": {"processes": 1, "bandwidth_limit": 300 * 10**6},
    }
    out: dict[str, Any] = {"h2d_gb_s": h2d_gbps(device), "memcpy_gb_s": memcpy_gbps()}
    with ec.Daemon(config):
        cache = ec.Cache(root / "arrays-cache")
        deadline = time.monotonic() + 600
        while cache.counters().bytes < 0.95 * capacity:
            if time.monotonic() > deadline:
                raise RuntimeError("the cache did not fill in 600 s")
            time.sleep(0.2)
        for workers in (0, 2, 2, 0):
            inserted = cache.counters().inserted
            moved, started = 0, 0.0
            for epoch, batches in cache.epochs(1 << 20, batch_size=64, num_workers=workers,
                                               pin_memory=device.type == "cuda"):
                for batch in batches:
                    batch.to(device, non_blocking=True)
                    if epoch > 0:
                        moved += batch.nbytes
                _sync(device)
                if epoch == 0:
                    started, inserted = time.perf_counter(), cache.counters().inserted
                elif time.perf_counter() - started >= seconds and epoch >= 2:
                    break
            elapsed = time.perf_counter() - started
            out.setdefault(f"w{workers}_mb_s", []).append(moved / elapsed / 1e6)
            out.setdefault(f"w{workers}_ingest_mb_s", []).append(
                (cache.counters().inserted - inserted) * MIB / elapsed / 1e6)
        cache.close()
    for key in [key for key in out if isinstance(out[key], list)]:
        out[key] = float(np.mean(out[key]))
    return out


def gpu_tests() -> dict[str, Any]:
    """tests/test_gpu.py, as the suite runs it."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-q", "-p", "no:cacheprovider",
                           "tests/test_gpu.py"], cwd=HERE.parent, capture_output=True, text=True)
    lines = (done.stdout + done.stderr).strip().splitlines()
    return {"exit_status": done.returncode, "summary": lines[-1] if lines else "",
            "seconds": round(time.perf_counter() - started, 1),
            "tail": "\n".join(lines[-40:]) if done.returncode else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run)")
    parser.add_argument("--quick", action="store_true", help="small datasets and models")
    parser.add_argument("--seconds", type=float, default=None, help="per measurement")
    parser.add_argument("--json", default="bench_gpu.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py: no CUDA device here (torch "
                         f"{torch.__version__}); run it on a GPU machine with a CUDA build of "
                         "torch, or --device cpu --quick for a smoke run")
    seconds = args.seconds if args.seconds is not None else (2.0 if args.quick else 20.0)
    result: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch": torch.__version__,
        "python": platform.python_version(), "device": args.device,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "machine": core_probe()}
    print(f"device {result['gpu'] or args.device}; {result['machine']['cores']} cores, "
          f"{result['machine']['cores_free']} free", flush=True)
    root = Path(tempfile.mkdtemp(prefix="bench-gpu-", dir=os.environ.get("EPOCHCACHE_BENCH_DIR")))
    try:
        rows = []
        for part in (demo_cnn, resnet):
            print(f"{part.__name__} ...", flush=True)
            rows.append(part(root, device, args.quick, seconds))
            row = rows[-1]
            print(f"  {row['workload']}: {row['from_cache']:,.0f} images/s from the cache, "
                  f"{row['fixed_batch']:,.0f} from a fixed batch on the device: "
                  f"{row['from_cache'] / row['fixed_batch']:.2f}", flush=True)
        result["training"] = rows
        print("1 MiB arrays to the device while the daemon ingests ...", flush=True)
        arrays = arrays_to_gpu(root, device, args.quick, seconds / 2)
        result["arrays"] = arrays
        print(f"  in process {arrays['w0_mb_s']:,.0f} MB/s, 2 workers {arrays['w2_mb_s']:,.0f} "
              f"MB/s (daemon ingest {arrays['w0_ingest_mb_s']:.0f} / "
              f"{arrays['w2_ingest_mb_s']:.0f} MB/s); host to device "
              f"{arrays['h2d_gb_s']:.1f} GB/s, memcpy {arrays['memcpy_gb_s']:.1f} GB/s",
              flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("tests/test_gpu.py ...", flush=True)
    result["tests"] = gpu_tests()
    print(f"  {result['tests']['summary']} ({result['tests']['seconds']} s)", flush=True)
    if result["tests"]["tail"]:
        print(result["tests"]["tail"])
    print("\n| workload | from the cache, images/s | fixed batch on the device | ratio |")
    print("|---|---|---|---|")
    for row in result["training"]:
        print(f"| {row['workload']} | {row['from_cache']:,.0f} | {row['fixed_batch']:,.0f} | "
              f"{row['from_cache'] / row['fixed_batch']:.2f} |")
    print(f"| 1 MiB arrays to the device while ingesting, MB/s: in process / 2 workers | "
          f"{arrays['w0_mb_s']:,.0f} / {arrays['w2_mb_s']:,.0f} | host to device "
          f"{arrays['h2d_gb_s'] * 1e3:,.0f} MB/s | {arrays['w2_mb_s'] / 1e3 / arrays['h2d_gb_s']:.2f} "
          "(2 workers) |")
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
