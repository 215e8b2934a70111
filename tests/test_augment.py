"""The torchvision-free augmentation: crops inside the image, the output shape and scale, flips."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from epochcache.augment import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    RandomResizedCrop,
    augment_batch,
    crop_box,
    normalize,
)


def test_crop_boxes_stay_inside_and_follow_scale_and_ratio() -> None:
    rng = random.Random(0)
    for height, width in ((128, 256), (300, 90), (64, 64)):
        for _ in range(200):
            top, left, h, w = crop_box(height, width, (0.25, 1.0), (3 / 4, 4 / 3), rng)
            assert 0 <= top and top + h <= height and 0 <= left and left + w <= width
            assert h > 0 and w > 0
    # An image far outside the ratio range falls back to a centre crop clamped to it.
    top, left, h, w = crop_box(10, 1000, (0.99, 1.0), (3 / 4, 4 / 3), rng)
    assert (h, w) == (10, 13) and left == (1000 - 13) // 2


@pytest.mark.parametrize("form", ["hwc", "chw", "gray"])
def test_random_resized_crop_shapes_and_normalisation(form: str) -> None:
    image = np.full((150, 200, 3), 128, np.uint8)
    source: object = {"hwc": image, "chw": torch.from_numpy(image).permute(2, 0, 1),
                      "gray": image[:, :, 0]}[form]
    random.seed(0)
    out = RandomResizedCrop(64)(source)
    assert out.dtype == torch.float32 and out.shape[-2:] == (64, 64)
    want = (128 / 255 - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD)
    assert torch.allclose(out.mean(dim=(1, 2)), want.expand(out.shape[0]), atol=1e-2)


def test_flip_mirrors_the_crop() -> None:
    ramp = np.tile(np.arange(100, dtype=np.uint8)[None, :, None], (100, 1, 3))
    whole = RandomResizedCrop(100, scale=(1.0, 1.0), ratio=(1.0, 1.0), flip=0.0, mean=None)
    flipped = RandomResizedCrop(100, scale=(1.0, 1.0), ratio=(1.0, 1.0), flip=1.0, mean=None)
    a, b = whole(ramp), flipped(ramp)
    assert torch.allclose(a, b.flip(-1)) and a[0, 0, 0] < a[0, 0, -1]


def test_augment_batch_is_seeded_and_normalised() -> None:
    images = torch.randint(0, 256, (8, 3, 40, 50), dtype=torch.uint8)
    a = augment_batch(images, 32, generator=torch.Generator().manual_seed(1))
    b = augment_batch(images, 32, generator=torch.Generator().manual_seed(1))
    c = augment_batch(images, 32, generator=torch.Generator().manual_seed(2))
    assert a.shape == (8, 3, 32, 32) and a.dtype == torch.float32
    assert torch.equal(a, b) and not torch.equal(a, c)
    # The whole image, unflipped, is the identity resample (then normalised).
    full = augment_batch(images, 40, scale=(1.0, 1.0), ratio=(1.25, 1.25), flip=0.0, mean=None)
    assert full.shape == (8, 3, 40, 40)
    same = augment_batch(images[:, :, :40, :40], 40, scale=(1.0, 1.0), ratio=(1.0, 1.0),
                         flip=0.0, mean=None)
    assert torch.allclose(same, normalize(images[:, :, :40, :40].float(), None, IMAGENET_STD),
                          atol=1e-4)
