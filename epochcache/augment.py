"""The standard ImageNet training augmentation in numpy/torch, for installs without torchvision.

Random resized crop (torchvision's parameters: scale 0.08-1 of the area, aspect ratio 3/4-4/3,
bilinear), horizontal flip with probability 0.5, and normalisation by the ImageNet mean and
standard deviation. Two shapes of the same thing:

* `RandomResizedCrop`: a per-sample transform (HWC ``uint8`` numpy array or CHW
  ``uint8`` tensor in, normalised CHW ``float32`` tensor out), picklable, for
  ``cache.epochs(transform=...)`` or any Dataset; randomness from Python's ``random`` (seeded
  per DataLoader worker);
* `augment_batch`: the same crop, flip and normalisation for a whole ``uint8`` batch at
  once (one ``affine_grid`` + ``grid_sample``), for a training loop that augments batches.

The example trainer and ``scripts/bench_images.py`` use these (the latter for every contender).
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def crop_box(height: int, width: int, scale: tuple[float, float] = (0.08, 1.0),
             ratio: tuple[float, float] = (3 / 4, 4 / 3),
             rng: random.Random | Any = random) -> tuple[int, int, int, int]:
    """``(top, left, h, w)`` of a random crop, as torchvision's ``RandomResizedCrop`` picks it:
    ten tries at a random area and aspect ratio, then a centre crop clamped to ``ratio``."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif in_ratio > ratio[1]:
        h, w = height, round(height * ratio[1])
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class RandomResizedCrop:
    """Per-sample random resized crop + flip + normalise (see the module docstring).

    Args:
        size: output side in pixels (square).
        scale: range of the crop's area as a fraction of the image's.
        ratio: range of the crop's aspect ratio.
        flip: probability of a horizontal flip.
        mean: per-channel mean of pixel values scaled to 0-1; None skips normalising.
        std: per-channel standard deviation.
    """

    def __init__(self, size: int, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), flip: float = 0.5,
                 mean: tuple[float, ...] | None = IMAGENET_MEAN,
                 std: tuple[float, ...] = IMAGENET_STD) -> None:
        self.size, self.scale, self.ratio, self.flip = size, scale, ratio, flip
        self.mean, self.std = mean, std

    def __call__(self, image: Any) -> torch.Tensor:
        height, width = image.shape[:2] if isinstance(image, np.ndarray) else image.shape[-2:]
        top, left, h, w = crop_box(height, width, self.scale, self.ratio)
        if isinstance(image, np.ndarray):
            crop = image[top : top + h, left : left + w]
            crop = crop[:, :, None] if crop.ndim == 2 else crop
            # HWC, contiguous and writable: as NCHW it is channels-last, where torch resizes
            # uint8 images with its vectorised kernel (3x the float path here).
            hwc = torch.from_numpy(np.require(crop, requirements=["C", "W"]))
            nchw = hwc.permute(2, 0, 1)[None]
        else:
            nchw = image[..., top : top + h, left : left + w][None]
            if nchw.ndim == 3:  # HxW grayscale tensor
                nchw = nchw[None]
        x = F.interpolate(nchw, size=(self.size, self.size), mode="bilinear",
                          align_corners=False, antialias=True)[0].float()
        if random.random() < self.flip:
            x = x.flip(-1)
        return normalize(x, self.mean, self.std)


def normalize(x: torch.Tensor, mean: tuple[float, ...] | None,
              std: tuple[float, ...]) -> torch.Tensor:
    """``x`` (0-255, channels at dim -3) scaled to 0-1, minus ``mean``, over ``std``."""
    x = x / 255.0
    if mean is None:
        return x
    shape = (-1, 1, 1)
    return ((x - torch.tensor(mean, device=x.device).view(shape))
            / torch.tensor(std, device=x.device).view(shape))


def augment_batch(images: torch.Tensor, size: int, scale: tuple[float, float] = (0.08, 1.0),
                  ratio: tuple[float, float] = (3 / 4, 4 / 3), flip: float = 0.5,
                  mean: tuple[float, ...] | None = IMAGENET_MEAN,
                  std: tuple[float, ...] = IMAGENET_STD,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Random resized crop + flip + normalise a ``(B, C, H, W)`` uint8 batch in one resample.

    Each sample gets its own crop (torchvision's area and aspect-ratio distributions, the
    crop kept inside the image) and flip, applied by one ``affine_grid``/``grid_sample``.
    ``images`` may be on any device; the random parameters are drawn on the CPU (from
    ``generator``), so a seed gives the same crops on every device.
    """
    batch, _channels, height, width = images.shape
    u = torch.rand(batch, 4, generator=generator)
    area = scale[0] + (scale[1] - scale[0]) * u[:, 0]
    log_r = math.log(ratio[0]) + (math.log(ratio[1]) - math.log(ratio[0])) * u[:, 1]
    aspect = torch.exp(log_r) * width / height
    # Crop sides as fractions of the image sides, clamped inside it.
    fw = torch.sqrt(area * aspect).clamp(max=1.0)
    fh = torch.sqrt(area / aspect).clamp(max=1.0)
    cx = (u[:, 2] * 2 - 1) * (1 - fw)  # centre in [-1, 1] coordinates
    cy = (u[:, 3] * 2 - 1) * (1 - fh)
    flips = torch.where(torch.rand(batch, generator=generator) < flip, -1.0, 1.0)
    theta = torch.zeros(batch, 2, 3)
    theta[:, 0, 0], theta[:, 0, 2] = fw * flips, cx
    theta[:, 1, 1], theta[:, 1, 2] = fh, cy
    grid = F.affine_grid(theta.to(images.device), [batch, 1, size, size], align_corners=False)
    x = F.grid_sample(images.float(), grid, mode="bilinear", padding_mode="border",
                      align_corners=False)
    return normalize(x, mean, std)
