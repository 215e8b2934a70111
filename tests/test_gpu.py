"""``epochcache run`` on CUDA under torchrun: NCCL, each rank on its GPU (issue 20, item 4); and
pinned batches read with one copy (issue 35).

Marked ``gpu`` and skipped where ``torch.cuda.is_available()`` is false (the CPU suite covers
gloo, and the run's bookkeeping under a default group without CPU support with a stand-in for
NCCL: test_run_devices.py). Here NCCL itself: ``torchrun --nproc-per-node 1`` (and 2 on a machine
with two GPUs) on configs/ddp.yaml-like settings with a local source, then ``--resume``.
``scripts/bench_gpu.py`` runs this file after its measurements.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from common.writer import npy_bytes, sample_array
from test_run import RUN_TIMEOUT_S, demo_config, read_metrics, status_json, torchrun, write_yaml

from epochcache import Cache
from epochcache.data.reader import SampleReader

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (NCCL)"),
]

PROBE_TRAINER = '''\
"""The example trainer, after writing where the first batch and the model live."""
import json
import os

import torch

from epochcache.examples import train_epoch as example_epoch


def train_epoch(run, epoch, loader):
    def batches():
        for index, batch in enumerate(loader):
            if index == 0 and epoch == 0:
                seen = {"run_device": str(run.device),
                        "current_device": torch.cuda.current_device(),
                        "pinned": bool(batch["npy"].is_pinned())}
                path = os.path.join(run.options["probe_dir"], f"rank{os.environ['RANK']}.json")
                with open(path, "w") as f:
                    json.dump(seen, f)
            yield batch

    result = example_epoch(run, epoch, batches())
    model = run.state["model"]
    result["model_on_cuda"] = float(next(model.parameters()).is_cuda)
    return result
'''


def _ddp_config(tmp_path: Path, epochs: int) -> Path:
    """configs/ddp.yaml's shape on a local tar source: per-node cache dir, workers, a run dir."""
    (tmp_path / "probe_trainer.py").write_text(PROBE_TRAINER)
    config = demo_config(
        tmp_path,
        cache={"dir": "demo-cache/node-${GROUP_RANK:-0}"},
        sampler={"processes": 2, "concurrency": 4},
        loader={"num_workers": 2},
        train={"epochs": epochs, "min_samples": 300, "entrypoint": "probe_trainer:train_epoch",
               "options": {"lr": 0.05, "hidden": 64, "probe_dir": str(tmp_path)}},
    )
    return write_yaml(tmp_path / "ddp.yaml", config)


@pytest.mark.parametrize("nproc", [1, 2])
def test_torchrun_trains_each_rank_on_its_gpu_with_nccl_then_resumes(tmp_path: Path,
                                                                     nproc: int) -> None:
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    cfg = _ddp_config(tmp_path, epochs=2)
    status, logs = torchrun(cfg, cwd=tmp_path, nproc=nproc, timeout_s=RUN_TIMEOUT_S * 2,
                            pythonpath=tmp_path)
    assert status == 0, logs[-6000:]
    for rank in range(nproc):
        assert f"rank {rank} of {nproc} (node 0, local rank {rank}), backend nccl, device " \
               f"cuda:{rank}" in logs, logs[-6000:]
        probe = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert probe == {"run_device": f"cuda:{rank}", "current_device": rank, "pinned": True}
    rows = read_metrics(tmp_path / "runs/demo")
    assert [row["epoch"] for row in rows] == [0, 1], rows
    assert all(row["model_on_cuda"] == 1.0 for row in rows), rows
    assert rows[-1]["loss"] < rows[0]["loss"], rows
    checkpoint = torch.load(tmp_path / "runs/demo/checkpoint.pt", map_location="cpu",
                            weights_only=True)
    assert checkpoint["epoch"] == 1

    status, logs = torchrun(cfg, "--resume", "--epochs", "3", cwd=tmp_path, nproc=nproc,
                            timeout_s=RUN_TIMEOUT_S * 2, pythonpath=tmp_path)
    assert status == 0, logs[-6000:]
    assert "epoch 2:" in logs and "epoch 0:" not in logs, logs[-6000:]
    rows = read_metrics(tmp_path / "runs/demo")
    assert [row["epoch"] for row in rows] == [0, 1, 2], rows
    assert rows[2]["loss"] < 1.5 * rows[1]["loss"], rows  # the model was restored on the GPU
    stats = status_json(tmp_path / "demo-cache" / "node-0", cwd=tmp_path)
    assert stats["leases"] == 0 and stats["daemon"]["stopped"], stats


def test_the_image_demo_trains_on_the_gpu(tmp_path: Path) -> None:
    """configs/demo.yaml's trainer (a CNN, augmentation on the device) under torchrun."""
    config = demo_config(
        tmp_path,
        source={"url": "demo-data/shapes", "demo_samples": 600, "demo_kind": "jpg"},
        cache={"capacity": "2MiB"},
        loader={"num_workers": 2, "fields": ["jpg;png", "cls"], "image": "torch"},
        train={"epochs": 1, "min_samples": 200, "samples_per_epoch": 640,
               "entrypoint": "epochcache.examples:train_image_classifier",
               "options": {"lr": 0.005, "size": 32, "width": 8}},
    )
    status, logs = torchrun(write_yaml(tmp_path / "demo.yaml", config), cwd=tmp_path, nproc=1,
                            timeout_s=RUN_TIMEOUT_S * 2, pythonpath=tmp_path)
    assert status == 0, logs[-6000:]
    assert "backend nccl, device cuda:0" in logs, logs[-6000:]
    rows = read_metrics(tmp_path / "runs/demo")
    assert [row["epoch"] for row in rows] == [0] and rows[0]["samples"] > 0, rows


@pytest.mark.parametrize("workers", [0, 2])
def test_pinned_batches_reach_the_gpu_intact_with_one_copy_in_process(
        tmp_path: Path, workers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``pin_memory=True``: every batch arrives page-locked, and copied to the GPU with
    ``non_blocking=True`` (the batch dropped at once, as a loop does) it holds the values read
    without pinning. In process the reader writes each batch into page-locked memory itself:
    the batch the loop gets is the very memory read_batch filled (DataLoader's pin step,
    which copies anything not yet pinned, has nothing to do)."""
    floats = 16384  # 64 KiB samples, 5 batches of 16 and a last one of 4
    cache = Cache(tmp_path / "c", "64MiB", sync=False)
    cache.put_many([(f"s/{i:07d}.npy", npy_bytes(sample_array(i, floats))) for i in range(84)])
    expected = []
    for _epoch, loader in cache.epochs(1, batch_size=16, seed=7):
        expected.extend(batch.numpy().copy() for batch in loader)
    filled: list[int] = []
    read_batch = SampleReader.read_batch

    def recording(self: SampleReader, seqs: Any) -> Any:
        batch = read_batch(self, seqs)
        filled.append(batch.data_ptr())
        return batch

    monkeypatch.setattr(SampleReader, "read_batch", recording)
    on_gpu, delivered = [], []
    for _epoch, loader in cache.epochs(1, batch_size=16, seed=7, num_workers=workers,
                                       pin_memory=True):
        for batch in loader:
            assert batch.is_pinned()
            delivered.append(batch.data_ptr())
            on_gpu.append(batch.to("cuda", non_blocking=True))
    torch.cuda.synchronize()
    assert len(on_gpu) == len(expected) == 6
    for got, want in zip(on_gpu, expected):
        assert np.array_equal(got.cpu().numpy(), want)
    if workers == 0:
        assert delivered == filled  # no copy between the reader and the loop
