"""A small synthetic dataset on any fsspec URL, so everything can be tried without a cloud account.

Samples are float32 "images" of ``num_classes`` classes; class ``c`` has its own seeded mean
pattern plus unit Gaussian noise, so a tiny model learns to tell them apart. Sample ``i`` has class
``i % num_classes``. Layouts:

* ``files``: ``sample-000000.npy`` (its class is also the ``label`` column of the manifests),
  plus ``manifest.jsonl`` and ``manifest.csv`` listing ``key,size,checksum,label``. Use
  ``pattern: "*.npy"`` so the manifests are not listed as samples.
* ``tar``: WebDataset shards ``shard-000000.tar`` holding ``000000.npy`` + ``000000.cls`` (the class as
  ASCII digits) per sample, plus manifests whose rows are shards (``key,size,checksum``).

With ``kind="jpg"`` the samples are instead 64x64 JPEG images (`make_images`):
``sample-000000.jpg`` (files) or ``000000.jpg`` + ``000000.cls`` (tar); this is what
``configs/demo.yaml`` trains a CNN on. Class ``c`` of ten is a shape (circle, square, triangle,
diamond, cross, ring, star, hexagon, ellipse, crescent) drawn at a random position, size and
rotation on a noisy gradient background, in a colour around a hue of the class's own that
overlaps its neighbours' hues: the colour is a hint, the shape decides. A small CNN needs
several epochs and never gets every augmented crop right.

Checksums are SHA-256, bare lowercase hex (64 digits; the manifest reader infers the algorithm).
With ``layout="both"`` the two layouts go to ``<url>/files/`` and ``<url>/tar/``. The data is
deterministic in the seed.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import tarfile
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np

from .ingest.remote import join_url, open_fs, translate_errors

log = logging.getLogger(__name__)

_WRITE_BATCH = 256  # objects per fs.pipe call: concurrent on async filesystems, bounded memory


def _sample_shape(sample_bytes: int | None) -> tuple[int, ...]:
    if sample_bytes is None:
        return (16, 16)
    if sample_bytes < 256:
        raise ValueError(f"sample_bytes: must be at least 256, got {sample_bytes}")
    values = (sample_bytes - 128) // 4  # an npy v1 header of a small shape is 128 bytes
    return (values // 16, 16) if values % 16 == 0 else (values,)


def make_samples(
    samples: int, *, num_classes: int = 4, sample_bytes: int | None = None, seed: int = 0
) -> tuple[list[bytes], list[int]]:
    """The ``.npy`` bytes and class of every sample (deterministic in ``seed``)."""
    shape = _sample_shape(sample_bytes)
    rng = np.random.default_rng(seed)
    means = rng.normal(0.0, 1.0, size=(num_classes, *shape)).astype(np.float32)
    payloads: list[bytes] = []
    labels: list[int] = []
    for index in range(samples):
        label = index % num_classes
        image = means[label] + rng.normal(0.0, 1.0, size=shape).astype(np.float32)
        buffer = io.BytesIO()
        np.save(buffer, image.astype(np.float32), allow_pickle=False)
        payloads.append(buffer.getvalue())
        labels.append(label)
    return payloads, labels


def _tar_shard(items: list[tuple[str, bytes, int]], ext: str = "npy") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as archive:
        for stem, payload, label in items:
            for name, data in ((f"{stem}.{ext}", payload), (f"{stem}.cls", str(label).encode())):
                info = tarfile.TarInfo(name)
                info.size, info.mode, info.mtime = len(data), 0o644, 0
                archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _files_objects(payloads: list[bytes], labels: list[int], ext: str = "npy"
                   ) -> tuple[dict[str, bytes], list[dict[str, Any]]]:
    """One object per sample, and its manifest rows (key, size, checksum, label)."""
    objects: dict[str, bytes] = {}
    rows: list[dict[str, Any]] = []
    for index, (payload, label) in enumerate(zip(payloads, labels)):
        key = f"sample-{index:06d}.{ext}"
        objects[key] = payload
        rows.append({"key": key, "size": len(payload),
                     "checksum": hashlib.sha256(payload).hexdigest(), "label": label})
    return objects, rows


def _tar_objects(payloads: list[bytes], labels: list[int], samples_per_shard: int,
                 ext: str = "npy") -> tuple[dict[str, bytes], list[dict[str, Any]]]:
    """WebDataset shards of ``samples_per_shard`` samples, and their manifest rows."""
    objects: dict[str, bytes] = {}
    rows: list[dict[str, Any]] = []
    for shard, start in enumerate(range(0, len(payloads), samples_per_shard)):
        stop = min(len(payloads), start + samples_per_shard)
        data = _tar_shard([(f"{i:06d}", payloads[i], labels[i]) for i in range(start, stop)], ext)
        key = f"shard-{shard:06d}.tar"
        objects[key] = data
        rows.append({"key": key, "size": len(data), "checksum": hashlib.sha256(data).hexdigest()})
    return objects, rows


def _manifests(rows: list[dict[str, Any]]) -> dict[str, bytes]:
    fields = list(rows[0]) if rows else ["key", "size", "checksum"]
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    jsonl = "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows)
    return {"manifest.csv": text.getvalue().encode(), "manifest.jsonl": jsonl.encode()}


def write_demo_data(
    url: str,
    samples: int = 1000,
    layout: Literal["files", "tar", "both"] = "both",
    storage_options: Mapping[str, Any] | None = None,
    *,
    sample_bytes: int | None = None,
    samples_per_shard: int = 100,
    num_classes: int | None = None,
    seed: int = 0,
    kind: Literal["npy", "jpg"] = "npy",
) -> dict[str, Any]:
    """Write the demo dataset under ``url`` and return a summary.

    Args:
        url: any fsspec URL (``file:///tmp/demo``, ``memory://demo``, ``s3://bucket/demo``).
        samples: number of samples.
        layout: ``files``, ``tar`` or ``both`` (then under ``<url>/files`` and ``<url>/tar``).
        storage_options: passed to fsspec (credentials are never logged).
        sample_bytes: approximate ``.npy`` size per sample; default 16x16 float32 (1152 bytes).
        samples_per_shard: samples per tar shard.
        num_classes: classes of the synthetic images; default 4 (npy) or 10 (jpg).
        seed: makes the data reproducible.
        kind: ``npy`` float arrays, or ``jpg`` images of shapes (needs the ``images`` extra).

    Returns:
        ``{"url", "samples", "num_classes", "layouts": {name: {"url", "objects", "bytes", "keys"}}}``;
        ``keys`` counts samples (files) or shards (tar).

    Raises:
        ValueError: an argument is out of range.
        SourceError: the URL cannot be written.
    """
    if samples < 1:
        raise ValueError(f"samples: must be at least 1, got {samples}")
    if layout not in ("files", "tar", "both"):
        raise ValueError(f"layout: expected files, tar or both, got {layout!r}")
    if kind not in ("npy", "jpg"):
        raise ValueError(f"kind: expected npy or jpg, got {kind!r}")
    if num_classes is None:
        num_classes = 10 if kind == "jpg" else 4
    if samples_per_shard < 1 or num_classes < 1:
        raise ValueError("samples_per_shard and num_classes: must be at least 1")
    if kind == "jpg":
        payloads, labels = make_images(samples, num_classes=num_classes, seed=seed)
    else:
        payloads, labels = make_samples(
            samples, num_classes=num_classes, sample_bytes=sample_bytes, seed=seed
        )
    fs, root = open_fs(url, storage_options)
    summary: dict[str, Any] = {
        "url": url,
        "samples": samples,
        "num_classes": num_classes,
        "layouts": {},
    }
    layouts = ["files", "tar"] if layout == "both" else [layout]
    for name in layouts:
        sub_url = join_url(url, name) if layout == "both" else url
        sub_root = join_url(root, name) if layout == "both" else root
        if name == "files":
            objects, rows = _files_objects(payloads, labels, kind)
        else:
            objects, rows = _tar_objects(payloads, labels, samples_per_shard, kind)
        objects.update(_manifests(rows))
        _write_objects(fs, sub_root, sub_url, objects)
        summary["layouts"][name] = {
            "url": sub_url,
            "objects": len(objects),
            "bytes": sum(len(v) for v in objects.values()),
            "keys": len(rows),
        }
        log.info("demo data: wrote %d %s objects to %s", len(objects), name, sub_url)
    return summary


def _write_objects(fs: Any, root: str, url: str, objects: dict[str, bytes]) -> None:
    items = list(objects.items())
    with translate_errors(url):
        if not getattr(fs, "async_impl", False):
            fs.makedirs(root, exist_ok=True)  # local filesystems need the directory
        for start in range(0, len(items), _WRITE_BATCH):
            batch = {join_url(root, key): data for key, data in items[start : start + _WRITE_BATCH]}
            fs.pipe(batch)


NUM_CLASSES = 10

Mask = Callable[[np.ndarray, np.ndarray, Any], np.ndarray]


def _regular(sides: int, size: float) -> Mask:
    def mask(u: np.ndarray, v: np.ndarray, r: np.ndarray) -> np.ndarray:
        # Inside a regular polygon: the projection on every edge normal is below the apothem.
        angles = np.arange(sides) * 2 * np.pi / sides
        proj = np.max([u * np.cos(a) + v * np.sin(a) for a in angles], axis=0)
        return proj < size * r  # type: ignore[no-any-return]
    return mask


def _star(u: np.ndarray, v: np.ndarray, r: np.ndarray) -> np.ndarray:
    return np.hypot(u, v) < r * (0.6 + 0.4 * np.cos(5 * np.arctan2(v, u)))  # type: ignore[no-any-return]


def _cross(u: np.ndarray, v: np.ndarray, r: np.ndarray) -> np.ndarray:
    au, av = np.abs(u), np.abs(v)
    return ((au < r / 3) & (av < r)) | ((av < r / 3) & (au < r))  # type: ignore[no-any-return]


_SHAPES: tuple[Mask, ...] = (
    lambda u, v, r: np.hypot(u, v) < r,                                   # circle
    lambda u, v, r: np.maximum(np.abs(u), np.abs(v)) < 0.8 * r,           # square
    _regular(3, 0.5),                                                     # triangle
    lambda u, v, r: np.abs(u) + np.abs(v) < r,                            # diamond
    _cross,                                                               # cross
    lambda u, v, r: (np.hypot(u, v) < r) & (np.hypot(u, v) > 0.6 * r),   # ring
    _star,                                                                # star
    _regular(6, 0.85),                                                    # hexagon
    lambda u, v, r: (u / r) ** 2 + (v / (0.45 * r)) ** 2 < 1,             # ellipse
    lambda u, v, r: (np.hypot(u, v) < r) & (np.hypot(u - 0.5 * r, v) > 0.75 * r),  # crescent
)


def _class_colour(label: int, rng: np.random.Generator) -> np.ndarray:
    hue = (label / NUM_CLASSES + rng.normal(0, 0.07)) % 1.0
    saturation, value = rng.uniform(0.45, 1.0), rng.uniform(0.45, 1.0)
    # HSV to RGB, one colour.
    sector = hue * 6
    chroma = value * saturation
    x = chroma * (1 - abs(sector % 2 - 1))
    rgb = [(chroma, x, 0), (x, chroma, 0), (0, chroma, x), (0, x, chroma), (x, 0, chroma),
           (chroma, 0, x)][int(sector) % 6]
    return (np.array(rgb) + (value - chroma)) * 255


def draw(label: int, rng: np.random.Generator, size: int = 64) -> np.ndarray:
    """One ``size x size`` RGB image of class ``label``."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    top, bottom = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    t = (yy / size)[..., None]
    image = top * (1 - t) + bottom * t + rng.normal(0, 12, (size, size, 3))
    radius = rng.uniform(0.17, 0.36) * size
    cx, cy = rng.uniform(radius * 0.8, size - radius * 0.8, 2)
    angle = rng.uniform(0, 2 * np.pi)
    u = (xx - cx) * np.cos(angle) + (yy - cy) * np.sin(angle)
    v = -(xx - cx) * np.sin(angle) + (yy - cy) * np.cos(angle)
    mask = _SHAPES[label](u, v, np.float32(radius))
    # Each class has a hue of its own, blurred into its neighbours' (so colour is a hint that
    # is right about half the time), and the colour differs enough from what is behind it.
    behind = image[mask].mean(0) if mask.any() else top
    colour = _class_colour(label, rng)
    while np.abs(colour - behind).sum() < 150:
        colour = _class_colour(label, rng)
    image[mask] = colour + rng.normal(0, 10, (int(mask.sum()), 3))
    out: np.ndarray = np.clip(image, 0, 255).astype(np.uint8)
    return out


def encode_jpeg(image: np.ndarray, quality: int = 90) -> bytes:
    """JPEG bytes of an RGB image (Pillow: the ``images`` extra)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def make_images(samples: int, *, num_classes: int = NUM_CLASSES, size: int = 64,
                seed: int = 0) -> tuple[list[bytes], list[int]]:
    """The JPEG bytes and class of every sample (deterministic in ``seed``).

    Raises:
        ValueError: ``num_classes`` is not between 1 and 10.
    """
    if not 1 <= num_classes <= len(_SHAPES):
        raise ValueError(f"num_classes: the image demo draws 1 to {len(_SHAPES)} shapes, "
                         f"got {num_classes}")
    rng = np.random.default_rng(seed)
    labels = [i % num_classes for i in range(samples)]
    return [encode_jpeg(draw(label, rng, size)) for label in labels], labels
