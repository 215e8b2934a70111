"""Image decoding: ``.jpg/.jpeg/.png/.webp/.bmp/.tif/.tiff`` to numpy, torch or PIL.

JPEG goes through simplejpeg (libjpeg-turbo straight into a numpy array): on the project's
2-core machines it decoded 128-256 px JPEGs 1.9-2.4x faster than Pillow (5.1k-6.1k images/s
against 2.2k-3.1k, pixel-identical; see ``docs/benchmarks.md``). Everything else, and JPEGs
simplejpeg cannot convert (CMYK), go through Pillow. Both are the ``images`` extra
(``pip install 'epochcache[images]'``); decoding an image without them raises
[`MissingImageLibrary`][epochcache.MissingImageLibrary], which no error policy skips (it would drop every image).

Forms (``image=``):

=========  ==========================================================================
``numpy``  HWC ``uint8`` array: RGB for colour, HxW for grayscale, RGBA when the image
           has alpha (deeper grayscale keeps its depth:
           ``uint16`` for 16-bit PNGs)
``torch``  the same as a CHW tensor (grayscale ``1xHxW``), as torchvision's ``pil_to_tensor``
``pil``    a loaded ``PIL.Image.Image`` in that mode (``RGB``, ``L``, ``RGBA``)
=========  ==========================================================================

Decoding is bounded like every other decoder: an image of more than Pillow's
``Image.MAX_IMAGE_PIXELS`` pixels (read when called: raise it there to allow bigger images)
raises [`DecodeError`][epochcache.DecodeError] before any pixel is decoded.
"""

from __future__ import annotations

import io
import struct
from typing import Any

import numpy as np

from ..errors import DecodeError, MissingImageLibrary
from ..options import IMAGE_FORMS

Buffer = bytes | bytearray | memoryview

IMAGE_EXTS = frozenset({"jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff"})
INSTALL_HINT = "pip install 'epochcache[images]'"
#: Pillow's own default, used when Pillow is not installed (simplejpeg alone).
DEFAULT_MAX_PIXELS = 89_478_485

#: Pillow modes kept as they are; the rest convert to RGB (or RGBA when they carry alpha).
_KEEP_MODES = frozenset({"RGB", "L", "RGBA", "I;16"})
_ALPHA_MODES = frozenset({"LA", "La", "RGBa", "PA"})


def check_form(image: str) -> str:
    """Validate the ``image`` argument.

    Raises:
        ValueError: not one of numpy, torch, pil.
    """
    if image not in IMAGE_FORMS:
        raise ValueError(f"image: expected 'numpy', 'torch' or 'pil', got {image!r}")
    return image


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError as exc:
        raise MissingImageLibrary(
            f"decoding images needs Pillow ({INSTALL_HINT})") from exc
    return Image


def _simplejpeg() -> Any:
    try:
        import simplejpeg
    except ImportError:
        return None
    return simplejpeg


def max_pixels() -> int | None:
    """The pixel limit in force: Pillow's ``MAX_IMAGE_PIXELS`` (None: unlimited)."""
    try:
        from PIL import Image
    except ImportError:
        return DEFAULT_MAX_PIXELS
    limit = Image.MAX_IMAGE_PIXELS
    return None if limit is None else int(limit)


def _check_pixels(width: int, height: int) -> None:
    limit = max_pixels()
    if limit is not None and width * height > limit:
        raise DecodeError(
            f"image of {width}x{height} = {width * height:,} pixels is over the limit of "
            f"{limit:,} (a decompression bomb?); raise PIL.Image.MAX_IMAGE_PIXELS if it is "
            "genuine")


def _jpeg_array(data: Buffer) -> np.ndarray | None:
    """simplejpeg's decode (HWC RGB, HxW gray), or None when Pillow must do it."""
    sj = _simplejpeg()
    if sj is None:
        return None
    height, width, colorspace, _sub = sj.decode_jpeg_header(data)
    _check_pixels(width, height)
    if colorspace == "Gray":
        return sj.decode_jpeg(data, colorspace="GRAY")[:, :, 0]  # type: ignore[no-any-return]
    if colorspace in ("YCbCr", "RGB"):
        return sj.decode_jpeg(data, colorspace="RGB")  # type: ignore[no-any-return]
    return None  # CMYK/YCCK: Pillow converts them


def _open_pil(data: Buffer) -> Any:
    """A loaded PIL image in one of the kept modes."""
    Image = _pil()
    try:
        im = Image.open(io.BytesIO(data))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise DecodeError(f"{exc} (raise PIL.Image.MAX_IMAGE_PIXELS if it is genuine)") from exc
    _check_pixels(*im.size)
    im.load()
    if im.mode in _KEEP_MODES or im.mode in ("I", "F"):
        return im  # I/F (32-bit grayscale) keep their depth, as I;16 does
    if im.mode == "1":
        return im.convert("L")
    has_alpha = im.mode in _ALPHA_MODES or (im.mode == "P" and "transparency" in im.info)
    return im.convert("RGBA" if has_alpha else "RGB")


def decode_image(data: Buffer, ext: str, form: str = "numpy") -> Any:
    """Decode one image blob into ``form`` (see the module docstring).

    Raises:
        MissingImageLibrary: neither simplejpeg (JPEG) nor Pillow is installed.
        DecodeError: the image is over the pixel limit.
        Exception: what the codec raises on bad data (callers wrap it in DecodeError).
    """
    array = _jpeg_array(data) if ext in ("jpg", "jpeg") else None
    if array is None:
        try:
            im = _open_pil(data)
        except (SyntaxError, struct.error) as exc:  # what some Pillow plugins raise on bad data
            raise ValueError(f"{type(exc).__name__}: {exc}") from exc
        if form == "pil":
            return im
        array = np.asarray(im)
        if not array.flags.writeable:
            array = array.copy()
    elif form == "pil":
        return _pil().fromarray(array)
    if form == "torch":
        import torch

        chw = array[None] if array.ndim == 2 else np.ascontiguousarray(array.transpose(2, 0, 1))
        return torch.from_numpy(chw)
    return array
