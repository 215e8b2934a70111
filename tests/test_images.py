"""Images decode through the cache: pixel-exact PNG in every form, JPEG close to its source,
bounded against decompression bombs, and a clear error when the image libraries are missing."""

from __future__ import annotations

import gzip
import io
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from epochcache import Cache, DecodeError, MissingImageLibrary
from epochcache.data.decode import AutoDecoder, decode_sample


def _encode(array: np.ndarray, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, fmt, **kw)
    return buf.getvalue()


def _pixels(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


RGB, GRAY, RGBA = _pixels((23, 31, 3)), _pixels((17, 9), 1), _pixels((12, 14, 4), 2)


@pytest.fixture
def cache(tmp_path: Path) -> Cache:
    cache = Cache(tmp_path / "c", "16MiB", sync=False)
    cache.put_many([
        ("img/rgb.png", _encode(RGB, "PNG")),
        ("img/gray.PNG", _encode(GRAY, "PNG")),  # extensions are case-insensitive
        ("img/rgba.png", _encode(RGBA, "PNG")),
        ("img/rgb.png.gz", gzip.compress(_encode(RGB, "PNG"))),
        ("shard/000001", {"png": _encode(RGB, "PNG"), "cls": b"4"}),
    ])
    return cache


def _by_key(ds: object) -> dict[str, object]:
    return {ds.key(i): ds[i] for i in range(len(ds))}  # type: ignore[attr-defined]


def test_png_round_trip_is_pixel_exact_as_numpy(cache: Cache) -> None:
    with cache.dataset() as ds:
        got = _by_key(ds)
    for key, want in (("img/rgb.png", RGB), ("img/gray.PNG", GRAY), ("img/rgba.png", RGBA),
                      ("img/rgb.png.gz", RGB)):
        value = got[key]
        assert isinstance(value, np.ndarray) and value.dtype == np.uint8, key
        assert value.shape == want.shape and np.array_equal(value, want), key
        assert value.flags.writeable
    sample = got["shard/000001"]
    assert np.array_equal(sample["png"], RGB) and sample["cls"] == 4  # type: ignore[index]


def test_png_round_trip_as_torch_is_chw(cache: Cache) -> None:
    with cache.dataset(image="torch") as ds:
        got = _by_key(ds)
    for key, want in (("img/rgb.png", RGB), ("img/rgba.png", RGBA)):
        value = got[key]
        assert isinstance(value, torch.Tensor) and value.dtype == torch.uint8
        assert torch.equal(value, torch.from_numpy(want).permute(2, 0, 1)), key
        assert value.is_contiguous()
    assert torch.equal(got["img/gray.PNG"], torch.from_numpy(GRAY)[None])  # type: ignore[arg-type]


def test_png_round_trip_as_pil(cache: Cache) -> None:
    with cache.dataset(image="pil") as ds:
        got = _by_key(ds)
    for key, want, mode in (("img/rgb.png", RGB, "RGB"), ("img/gray.PNG", GRAY, "L"),
                            ("img/rgba.png", RGBA, "RGBA")):
        value = got[key]
        assert isinstance(value, Image.Image) and value.mode == mode, key
        assert np.array_equal(np.asarray(value), want), key


def test_jpeg_decodes_within_two_levels_of_the_source_mean(tmp_path: Path) -> None:
    yy, xx = np.mgrid[0:96, 0:128]
    smooth = np.stack([xx * 2, yy * 2, (xx + yy)], -1).astype(np.uint8)
    cache = Cache(tmp_path / "c", "16MiB", sync=False)
    cache.put_many([("a.jpg", _encode(smooth, "JPEG", quality=90)),
                    ("b.JPEG", _encode(smooth[:, :, 0], "JPEG", quality=90))])
    with cache.dataset() as ds:
        got = _by_key(ds)
    color, gray = got["a.jpg"], got["b.JPEG"]
    assert color.shape == (96, 128, 3) and color.dtype == np.uint8  # type: ignore[union-attr]
    assert gray.shape == (96, 128)  # type: ignore[union-attr]
    for value, source in ((color, smooth), (gray, smooth[:, :, 0])):
        assert abs(float(value.mean()) - float(source.mean())) <= 2  # type: ignore[union-attr]
        assert abs(value.astype(int) - source).mean() < 4  # type: ignore[union-attr]


def test_cmyk_jpeg_and_palette_png_become_rgb() -> None:
    cmyk = io.BytesIO()
    Image.new("CMYK", (8, 6), (0, 255, 255, 0)).save(cmyk, "JPEG")  # red
    value = decode_sample(AutoDecoder(), "x.jpg", cmyk.getvalue())
    assert value.shape == (6, 8, 3) and value[..., 0].mean() > 200 and value[..., 1].mean() < 50
    palette = io.BytesIO()
    Image.fromarray(RGB).convert("P").save(palette, "PNG")
    assert decode_sample(AutoDecoder(), "x.png", palette.getvalue()).shape == (23, 31, 3)


def test_webp_bmp_tiff_decode() -> None:
    for ext, fmt in (("webp", "WEBP"), ("bmp", "BMP"), ("tif", "TIFF"), ("TIFF", "TIFF")):
        kwargs = {"lossless": True} if fmt == "WEBP" else {}
        value = decode_sample(AutoDecoder(), f"x.{ext}", _encode(RGB, fmt, **kwargs))
        assert np.array_equal(value, RGB), ext


def test_decompression_bomb_png_raises_decode_error() -> None:
    # A 1-bit PNG of 20000 x 20000 pixels is a few kB; decoded as RGB it would be 1.2 GB.
    buf = io.BytesIO()
    Image.new("1", (20_000, 20_000)).save(buf, "PNG")
    assert len(buf.getvalue()) < 100_000
    with pytest.raises(DecodeError) as info:
        decode_sample(AutoDecoder(), "bomb/1.png", buf.getvalue())
    assert "bomb/1.png" in str(info.value) and "MAX_IMAGE_PIXELS" in str(info.value)


def test_jpeg_over_the_pixel_limit_raises_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    data = _encode(RGB, "JPEG")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # read when called, as Pillow does
    with pytest.raises(DecodeError, match=r"big\.jpg.*31x23 = 713 pixels"):
        decode_sample(AutoDecoder(), "big.jpg", data)
    with pytest.raises(DecodeError, match="big.png.*MAX_IMAGE_PIXELS"):
        decode_sample(AutoDecoder(), "big.png", _encode(RGB, "PNG"))


def test_truncated_image_names_the_key() -> None:
    data = _encode(RGB, "PNG")[:60]
    with pytest.raises(DecodeError, match="broken/1.png"):
        decode_sample(AutoDecoder(), "broken/1.png", data)
    with pytest.raises(DecodeError, match="broken/2.jpg"):
        decode_sample(AutoDecoder(), "broken/2.jpg", b"\xff\xd8\xff garbage")


def test_missing_libraries_name_the_extra_and_are_never_skipped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = Cache(tmp_path / "c", "16MiB", sync=False)
    cache.put_many([("a.jpg", _encode(RGB, "JPEG")), ("b.png", _encode(RGB, "PNG"))])
    monkeypatch.setitem(sys.modules, "PIL", None)  # import PIL now raises ImportError
    monkeypatch.setitem(sys.modules, "simplejpeg", None)
    with cache.dataset(on_error="skip") as ds:
        for i in range(2):
            with pytest.raises(MissingImageLibrary) as info:
                ds[i]
            assert "epochcache[images]" in str(info.value) and ds.key(i) in str(info.value)
            assert isinstance(info.value, DecodeError)
        assert ds.skipped == 0


def test_jpeg_falls_back_to_pillow_without_simplejpeg(monkeypatch: pytest.MonkeyPatch) -> None:
    data = _encode(RGB, "JPEG", quality=95)
    fast = decode_sample(AutoDecoder(), "a.jpg", data)
    monkeypatch.setitem(sys.modules, "simplejpeg", None)
    slow = decode_sample(AutoDecoder(), "a.jpg", data)
    assert np.array_equal(fast, slow)  # both libjpeg-turbo with the accurate IDCT


def test_bad_image_form_is_rejected(cache: Cache) -> None:
    with pytest.raises(ValueError, match="image: expected 'numpy', 'torch' or 'pil'"):
        cache.dataset(image="tensor")


def test_images_collate_with_fields_through_epochs(tmp_path: Path) -> None:
    cache = Cache(tmp_path / "c", "16MiB", sync=False)
    cache.put_many([(f"shard/{i:04d}", {"jpg": _encode(_pixels((16, 16, 3), i), "JPEG"),
                                        "cls": str(i % 3).encode()}) for i in range(10)])
    seen = 0
    for _epoch, loader in cache.epochs(1, batch_size=4, fields=("jpg;png", "cls"),
                                       image="torch", shuffle=False):
        for images, labels in loader:
            assert images.dtype == torch.uint8 and images.shape[1:] == (3, 16, 16)
            assert labels.dtype == torch.int64 and len(labels) == len(images)
            seen += len(images)
    assert seen == 10
