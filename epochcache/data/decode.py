"""Turn a cached sample's bytes into Python values, chosen by key extension or field name.

``decode="auto"`` picks a decoder from the sample key's extensions (``train/001.npy.gz``) or,
for tar samples stored as a dict of fields, from each field's name (``{"npy": ..., "cls": ...}``):

=============  ===============================================================
``npy``        `numpy.ndarray` (never unpickles object arrays unless opted in)
``pt``/``pth`` ``torch.load(..., weights_only=True)``
``json``       the parsed document
``txt``        ``str``; ``cls``/``cls2``/``index`` an ``int`` when the text is one
``jpg`` ...    images (``jpg/jpeg/png/webp/bmp/tif/tiff``): an HWC ``uint8`` array, a CHW
               tensor or a PIL image by ``image=`` (see below)
``gz``         gunzip (at most ``max_sample_bytes``), then decode what is inside by the next
               extension
``pkl``        ``pickle.loads`` -- only with ``allow_pickle=True`` (it runs code)
anything else  ``bytes``, unchanged
=============  ===============================================================

Decoders accept ``bytes`` or a ``memoryview`` into the LMDB map and always return values that own
their memory (the map's buffers die with the read transaction).

Untrusted input is bounded: gzip is decompressed in a stream that stops past
``max_sample_bytes`` (``loader.max_sample_bytes``, default 256 MiB: a gzip bomb costs at most
that), and a ``.npy`` header longer than numpy's 10000-byte limit is refused before it is parsed.

Errors: a sample that cannot be decoded raises [`DecodeError`][epochcache.DecodeError] naming its
key and the codec; a pickle sample without the opt-in raises
[`PickleNotAllowed`][epochcache.PickleNotAllowed] whatever the error policy, because skipping would
silently drop every sample of such a dataset.

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

import ast
import io
import json
import logging
import pickle
import struct
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import DecodeError, MissingImageLibrary, PickleNotAllowed
from ..limits import AST_LOCK, DEFAULT_MAX_SAMPLE_BYTES, NPY_MAX_HEADER_BYTES, gunzip
from ..options import DecodeFn
from ..store.records import Value

log = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview

_NPY_MAGIC = b"\x93NUMPY"
_PICKLE_EXTS = frozenset({"pkl", "pickle"})
_INT_EXTS = frozenset({"cls", "cls2", "index", "idx", "label"})
_TEXT_EXTS = frozenset({"txt", "text"}) | _INT_EXTS
_GZ_EXTS = frozenset({"gz", "gzip"})
_OPT_IN = "set loader.allow_pickle: true (allow_pickle=True) if you trust the data"


class NpyHeader:
    """A parsed ``.npy`` header: where the data starts and how to view it."""

    __slots__ = ("dtype", "shape", "fortran", "offset", "nbytes", "count")

    def __init__(self, dtype: np.dtype[Any], shape: tuple[int, ...], fortran: bool, offset: int):
        self.dtype = dtype
        self.shape = shape
        self.fortran = fortran
        self.offset = offset
        self.count = int(np.prod(shape, dtype=np.int64))
        self.nbytes = self.count * dtype.itemsize


# Headers repeat across a dataset of fixed-shape arrays; parsing one costs ~10 us
# (ast.literal_eval), a dict lookup on its bytes far less. Bounded so odd data cannot grow it.
_header_cache: dict[bytes, NpyHeader] = {}
_HEADER_CACHE_MAX = 256


def parse_npy_header(data: Buffer) -> NpyHeader:
    """Parse the header of a ``.npy`` buffer (versions 1-3) without copying the data.

    Raises:
        ValueError: the buffer is not a ``.npy`` file or its header is malformed.
    """
    view = memoryview(data)
    if len(view) < 10 or bytes(view[:6]) != _NPY_MAGIC:
        raise ValueError("not a .npy file (bad magic)")
    major = view[6]
    if major == 1:
        hlen, start = int.from_bytes(view[8:10], "little"), 10
    elif major in (2, 3):
        hlen, start = int.from_bytes(view[8:12], "little"), 12
    else:
        raise ValueError(f"unsupported .npy version {major}")
    if hlen > NPY_MAX_HEADER_BYTES:
        # numpy's own limit: ast.literal_eval of a huge crafted header costs memory and time
        raise ValueError(f".npy header is {hlen} bytes, over the {NPY_MAX_HEADER_BYTES} numpy "
                         "accepts (a crafted file?)")
    raw = bytes(view[start : start + hlen])
    header = _header_cache.get(raw)
    if header is not None:
        return header
    if len(raw) != hlen:
        raise ValueError("truncated .npy header")
    with AST_LOCK:  # see limits.AST_LOCK
        meta = ast.literal_eval(raw.decode("latin1"))
    if not isinstance(meta, dict) or not {"descr", "fortran_order", "shape"} <= meta.keys():
        raise ValueError(f"malformed .npy header {raw[:80]!r}")
    dtype = np.lib.format.descr_to_dtype(meta["descr"])
    header = NpyHeader(dtype, tuple(int(d) for d in meta["shape"]), bool(meta["fortran_order"]),
                       start + hlen)
    if len(_header_cache) < _HEADER_CACHE_MAX:
        _header_cache[raw] = header
    return header


def npy_view(data: Buffer, header: NpyHeader) -> np.ndarray:
    """A read-only array over ``data`` (no copy); callers copy it out of the LMDB map."""
    if len(data) - header.offset != header.nbytes:
        raise ValueError(
            f"array data is {len(data) - header.offset} bytes, header says {header.nbytes}"
        )
    flat = np.frombuffer(data, dtype=header.dtype, count=header.count, offset=header.offset)
    if header.fortran:
        return flat.reshape(header.shape[::-1]).transpose()
    return flat.reshape(header.shape)


def decode_npy(data: Buffer, allow_pickle: bool = False) -> np.ndarray:
    header = parse_npy_header(data)
    if header.dtype.hasobject:
        if not allow_pickle:
            raise PickleNotAllowed("object arrays need pickle to load")
        with AST_LOCK:  # its header is parsed with ast.literal_eval (see limits.AST_LOCK)
            return np.load(io.BytesIO(bytes(data)), allow_pickle=True)  # type: ignore[no-any-return]
    return npy_view(data, header).copy()  # own the memory: writable, outlives the txn


def decode_torch(data: Buffer) -> Any:
    import torch  # only when a .pt sample shows up

    # weights_only: tensors, containers and primitives only; never arbitrary code.
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def decode_text(data: Buffer, ext: str) -> Any:
    text = str(data, "utf-8")
    if ext in _INT_EXTS:
        stripped = text.strip()
        try:
            return int(stripped)
        except ValueError:
            return stripped
    return text


def extensions(name: str, is_field: bool) -> list[str]:
    """The extension chain of a key (``a/b.npy.gz`` -> ``["npy", "gz"]``) or field name."""
    base = name.rsplit("/", 1)[-1].lower()
    parts = base.split(".")
    return parts if is_field else parts[1:]


def decode_bytes(name: str, data: Buffer, *, is_field: bool = False,
                 allow_pickle: bool = False, image: str = "numpy",
                 max_sample_bytes: int = DEFAULT_MAX_SAMPLE_BYTES) -> Any:
    """Decode one blob by the extensions of ``name`` (a key, or a field name when ``is_field``).

    ``image`` is the form images decode to: ``"numpy"``, ``"torch"`` or ``"pil"``;
    ``max_sample_bytes`` bounds what decompression may produce (a gzip bomb raises).

    Raises:
        PickleNotAllowed: the blob is a pickle and ``allow_pickle`` is False.
        Exception: whatever the codec raises on bad data (callers wrap it in DecodeError).
    """
    exts = extensions(name, is_field)
    while exts:
        ext = exts.pop()
        if ext in _GZ_EXTS:
            data = gunzip(data, max_sample_bytes)
            continue
        if ext == "npy":
            return decode_npy(data, allow_pickle)
        if ext in ("pt", "pth"):
            return decode_torch(data)
        if ext == "json":
            return json.loads(bytes(data))
        if ext in _TEXT_EXTS:
            return decode_text(data, ext)
        if ext in IMAGE_EXTS:
            return decode_image(data, ext, image)
        if ext in _PICKLE_EXTS:
            if not allow_pickle:
                raise PickleNotAllowed("pickle can run arbitrary code")
            return pickle.loads(data)
        break  # an unknown extension: keep the bytes as they are
    return bytes(data)


class AutoDecoder:
    """The ``decode="auto"`` decoder; picklable, so it travels into DataLoader workers.

    Args:
        allow_pickle: decode ``.pkl``/``.pickle`` samples and object ``.npy`` arrays.
        image: the form images decode to: ``"numpy"``, ``"torch"`` or ``"pil"``.
        max_sample_bytes: the most a sample may decompress to.
    """

    def __init__(self, allow_pickle: bool = False, image: str = "numpy",
                 max_sample_bytes: int = DEFAULT_MAX_SAMPLE_BYTES) -> None:
        self.allow_pickle = allow_pickle
        self.image = image
        self.max_sample_bytes = max_sample_bytes

    def __call__(self, key: str, value: Value | memoryview) -> Any:
        if isinstance(value, Mapping):
            return {
                name: decode_bytes(name, data, is_field=True, allow_pickle=self.allow_pickle,
                                   image=self.image, max_sample_bytes=self.max_sample_bytes)
                for name, data in value.items()
            }
        return decode_bytes(key, value, allow_pickle=self.allow_pickle, image=self.image,
                            max_sample_bytes=self.max_sample_bytes)


def raw_decoder(key: str, value: Value | memoryview) -> Any:
    """``decode="raw"``: bytes (or the dict of field bytes) unchanged."""
    return bytes(value) if isinstance(value, memoryview) else value


def make_decoder(decode: str | DecodeFn | None, allow_pickle: bool = False,
                 image: str = "numpy",
                 max_sample_bytes: int = DEFAULT_MAX_SAMPLE_BYTES) -> DecodeFn:
    """Resolve the ``decode`` argument: ``"auto"``, ``"raw"``/None, or ``fn(key, value)``
    (``image`` and ``max_sample_bytes`` as `ReaderOptions` validated them).

    Raises:
        ValueError: an unknown decoder name.
    """
    if decode == "auto":
        return AutoDecoder(allow_pickle, image, max_sample_bytes)
    if decode in ("raw", None):
        return raw_decoder
    if callable(decode):
        return decode
    raise ValueError(f"decode: expected 'auto', 'raw' or a callable fn(key, value), got {decode!r}")


def decode_sample(fn: DecodeFn, key: str, value: Value | memoryview) -> Any:
    """Run ``fn`` and translate its failures into errors that name the sample's key.

    Raises:
        PickleNotAllowed: with the key and how to opt in.
        DecodeError: with the key and the codec's complaint.
    """
    try:
        return fn(key, value)
    except PickleNotAllowed as exc:
        raise PickleNotAllowed(f"sample {key!r}: {exc}; {_OPT_IN}", key=key) from exc
    except DecodeError as exc:  # a MissingImageLibrary stays one (no policy skips it)
        if exc.key:
            raise
        cls = MissingImageLibrary if isinstance(exc, MissingImageLibrary) else DecodeError
        raise cls(f"sample {key!r}: {exc}", key=key) from exc
    except (ValueError, TypeError, EOFError, OSError, zlib.error, pickle.UnpicklingError,
            UnicodeDecodeError, RuntimeError, KeyError, IndexError) as exc:
        codec = "+".join(reversed(extensions(key, False))) or "custom"
        raise DecodeError(
            f"sample {key!r}: cannot decode ({codec}): {type(exc).__name__}: {exc} "
            "(on_error='skip' skips such samples)",
            key=key,
        ) from exc


IMAGE_EXTS = frozenset({"jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff"})
INSTALL_HINT = "pip install 'epochcache[images]'"
#: Pillow's own default, used when Pillow is not installed (simplejpeg alone).
DEFAULT_MAX_PIXELS = 89_478_485

#: Pillow modes kept as they are; the rest convert to RGB (or RGBA when they carry alpha).
_KEEP_MODES = frozenset({"RGB", "L", "RGBA", "I;16"})
_ALPHA_MODES = frozenset({"LA", "La", "RGBa", "PA"})


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
