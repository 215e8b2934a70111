"""A synthetic image-classification dataset: procedurally drawn shapes, JPEG in WebDataset shards.

Class ``c`` of ten is a shape (circle, square, triangle, diamond, cross, ring, star, hexagon,
ellipse, crescent) drawn at a random position, size and rotation on a noisy gradient
background, in a colour around a hue of the class's own that overlaps its neighbours' hues: the
colour is a hint, the shape decides. A small CNN needs several epochs and never gets every
augmented crop right. Sample ``i`` has class ``i % 10``; the
images are deterministic in the seed. Written by `epochcache.demo.write_demo_data` with
``kind="jpg"`` (``000123.jpg`` + ``000123.cls`` per sample in each ``shard-NNNNNN.tar``).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import numpy as np

NUM_CLASSES = 10

Mask = Callable[[np.ndarray, np.ndarray, Any], np.ndarray]


def _polar(u: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return np.hypot(u, v), np.arctan2(v, u)


def _regular(sides: int, size: float) -> Mask:
    def mask(u: np.ndarray, v: np.ndarray, r: np.ndarray) -> np.ndarray:
        # Inside a regular polygon: the projection on every edge normal is below the apothem.
        angles = np.arange(sides) * 2 * np.pi / sides
        proj = np.max([u * np.cos(a) + v * np.sin(a) for a in angles], axis=0)
        return proj < size * r  # type: ignore[no-any-return]
    return mask


def _star(u: np.ndarray, v: np.ndarray, r: np.ndarray) -> np.ndarray:
    d, theta = _polar(u, v)
    return d < r * (0.6 + 0.4 * np.cos(5 * theta))  # type: ignore[no-any-return]


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
