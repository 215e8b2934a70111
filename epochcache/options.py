"""How a cache's samples are read: one [`ReaderOptions`][epochcache.ReaderOptions] value for every reader.

``cache.dataset()``, ``cache.epochs()``, ``cache.stream()`` and a run's ``loader:`` section all
read samples the same way: decode them, maybe transform them, pick fields, bound what a sample
may inflate to, and watch for stalls. Those options are one frozen value with one set of
defaults (as httpx's ``Timeout`` and ``Limits`` are), given whole (``options=``) or as
keyword arguments, which override it::

    opts = ec.ReaderOptions(fields=("jpg;png", "cls"), image="torch", stall_s=600)
    for epoch, loader in cache.epochs(10, batch_size=64, options=opts): ...
    stream = cache.stream(seed=0, fields=("npy", "cls"))      # the same, as keywords

A run's config maps onto it once (`epochcache.config.LoaderConfig.reader_options`). No
torch here: the value travels to DataLoader workers and sampler-free tools as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict

from .limits import DEFAULT_MAX_SAMPLE_BYTES

#: A decode function: ``fn(key, value)`` -> the sample.
DecodeFn = Callable[[str, Any], Any]

#: The stall limit, seconds: a batch slower than this is a stall (reported, then by default
#: the job ends). Batches are milliseconds; 5 minutes is a stuck read, not a slow one.
DEFAULT_STALL_S = 300.0

#: How long past its last heartbeat a dead run's epoch lease that a checkpoint names is kept,
#: seconds, for a resume to continue the epoch (``cache.resume_grace_s``, ``epochs()``,
#: ``stream()``): the one place this default is written.
RESUME_GRACE_S = 1800.0

ON_ERROR = ("raise", "skip")
STALL_ACTIONS = ("raise", "warn")
IMAGE_FORMS = ("numpy", "torch", "pil")


@dataclasses.dataclass(frozen=True)
class ReaderOptions:
    """How samples are read, decoded and watched (see the module docstring).

    Attributes:
        decode: ``"auto"`` (by extension: ``.npy``, images, ``.json``, ``.cls``, ... and
            gzip), ``"raw"`` (bytes as stored), None (the same as raw) or ``fn(key, value)``.
        transform: applied to each decoded sample (in the DataLoader workers, if any).
        allow_pickle: let ``decode="auto"`` unpickle ``.pkl`` samples. Pickle runs code:
            only for data you trust.
        max_sample_bytes: the most a sample may decompress to (a gzip bomb raises a
            ``DecodeError`` naming its key). Default 256 MiB.
        on_error: ``"raise"`` a ``DecodeError`` naming the key, or ``"skip"`` the sample
            (logged with its key and counted).
        fields: each sample as a tuple of these fields, WebDataset's ``to_tuple``
            (``("jpg;png", "cls")``: the first of jpg or png, then cls); None keeps samples
            as they are.
        image: what images decode to: ``"numpy"`` (HWC uint8), ``"torch"`` (CHW uint8) or
            ``"pil"``.
        stall_s: a batch slower than this is a stall: its report (the stacks of the reading
            process and of its DataLoader workers, the sample key, the worker that owes the
            batch) goes to ``stall_file``, then ``stall_action`` applies. None: no watchdog.
        stall_action: ``"raise"`` (the default): after the report the reader fails with a
            ``StallError`` naming the epoch, batch, key and worker, so the job ends instead of
            hanging and a restart resumes it; ``"warn"``: report and keep waiting.
        stall_file: where stall reports go (default: stderr).
    """

    decode: str | DecodeFn | None = "auto"
    transform: Callable[[Any], Any] | None = None
    allow_pickle: bool = False
    max_sample_bytes: int = DEFAULT_MAX_SAMPLE_BYTES
    on_error: str = "raise"
    fields: str | Sequence[str] | None = None
    image: str = "numpy"
    stall_s: float | None = DEFAULT_STALL_S
    stall_action: str = "raise"
    stall_file: str | None = None

    def __post_init__(self) -> None:
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error: expected 'raise' or 'skip', got {self.on_error!r}")
        if self.stall_action not in STALL_ACTIONS:
            raise ValueError(f"stall_action: expected 'raise' or 'warn', got "
                             f"{self.stall_action!r}")
        if self.image not in IMAGE_FORMS:
            raise ValueError(f"image: expected 'numpy', 'torch' or 'pil', got {self.image!r}")
        if self.transform is not None and not callable(self.transform):
            raise TypeError(f"transform: expected a callable, got {self.transform!r}")
        if not (isinstance(self.decode, str) or self.decode is None or callable(self.decode)):
            raise TypeError(f"decode: expected 'auto', 'raw', None or a callable, got "
                            f"{self.decode!r}")
        if isinstance(self.max_sample_bytes, bool) or not isinstance(self.max_sample_bytes, int) \
                or self.max_sample_bytes <= 0:
            raise ValueError(f"max_sample_bytes: expected an int > 0, got "
                             f"{self.max_sample_bytes!r}")
        if self.stall_s is not None and (isinstance(self.stall_s, bool)
                                         or not isinstance(self.stall_s, (int, float))
                                         or self.stall_s <= 0):
            raise ValueError(f"stall_s: expected None or seconds > 0, got {self.stall_s!r}")

    def replace(self, **changes: Any) -> ReaderOptions:
        """A copy with ``changes`` (keyword names as the attributes)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def resolve(cls, options: ReaderOptions | None, overrides: Mapping[str, Any],
                where: str) -> ReaderOptions:
        """``options`` (default: the defaults) with the keyword ``overrides`` applied.

        Raises:
            TypeError: an override that is no reader option; ``where`` names the call.
        """
        if options is not None and not isinstance(options, ReaderOptions):
            raise TypeError(f"{where}: options: expected an epochcache.ReaderOptions, got "
                            f"{type(options).__name__}")
        unknown = sorted(set(overrides) - NAMES)
        if unknown:
            raise TypeError(f"{where}: unexpected keyword argument(s) {', '.join(unknown)} "
                            f"(reader options are {', '.join(sorted(NAMES))})")
        base = options if options is not None else cls()
        return base.replace(**overrides) if overrides else base


#: The option names, for the keyword form.
NAMES = frozenset(field.name for field in dataclasses.fields(ReaderOptions))


class ReaderKwargs(TypedDict, total=False):
    """The keyword form of [`ReaderOptions`][epochcache.ReaderOptions] (for type checkers: ``**reader``)."""

    decode: str | DecodeFn | None
    transform: Callable[[Any], Any] | None
    allow_pickle: bool
    max_sample_bytes: int
    on_error: str
    fields: str | Sequence[str] | None
    image: str
    stall_s: float | None
    stall_action: str
    stall_file: str | None
