"""The options of the training side as values, each default written once: how samples are read
([`ReaderOptions`][epochcache.ReaderOptions]), how an epoch is ordered and released
(`EpochOptions`), and what epochs()' DataLoaders are (`LoaderOptions`).

``cache.dataset()``, ``cache.epochs()``, ``cache.stream()`` and a run's ``loader:`` section all
read samples the same way: decode them, maybe transform them, pick fields, bound what a sample
may inflate to, and watch for stalls. Those options are one frozen value with one set of
defaults (as httpx's ``Timeout`` and ``Limits`` are), given whole (``options=``) or as
keyword arguments, which override it::

    opts = ec.ReaderOptions(fields=("jpg;png", "cls"), image="torch", stall_s=600)
    for epoch, loader in cache.epochs(10, batch_size=64, options=opts): ...
    stream = cache.stream(seed=0, fields=("npy", "cls"))      # the same, as keywords

A run's config maps onto them once (`epochcache.config.LoaderConfig.reader_options`,
`EpochcacheConfig.epoch_options`, `EpochcacheConfig.loader_options`), and the keyword
signatures of ``epochs()`` and ``stream()`` take their defaults from the fields here;
`resolve_options` sends each keyword to the value with a field of its name. No torch here: the
values travel to DataLoader workers and sampler-free tools as they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

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

#: DataLoader arguments epochs() sets itself (the sampler is its own; shuffling is per epoch).
RESERVED = ("dataset", "sampler", "batch_sampler", "shuffle", "generator")


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
        if self.on_error not in ("raise", "skip"):
            raise ValueError(f"on_error: expected 'raise' or 'skip', got {self.on_error!r}")
        if self.stall_action not in ("raise", "warn"):
            raise ValueError(f"stall_action: expected 'raise' or 'warn', got "
                             f"{self.stall_action!r}")
        if self.image not in ("numpy", "torch", "pil"):
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


@dataclasses.dataclass(frozen=True)
class EpochOptions:
    """How an epoch is ordered and released: ``epochs()``, ``stream()`` and a run.

    Each attribute is the keyword of its name of [`epochs`][epochcache.data.epochs.epochs]
    and [`CacheStream`][epochcache.data.stream.CacheStream], documented there; its default is
    written here only.
    """

    seed: int = 0
    shuffle: bool = True
    samples_per_epoch: int | None = None
    release: str = "progressive"
    resume_grace_s: float = RESUME_GRACE_S

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int):
            raise ValueError(f"seed: expected an int, got {self.seed!r}")
        if self.samples_per_epoch is not None and (not isinstance(self.samples_per_epoch, int)
                                                   or self.samples_per_epoch < 1):
            raise ValueError(f"samples_per_epoch: expected None or an int >= 1, "
                             f"got {self.samples_per_epoch!r}")
        if self.release not in ("progressive", "epoch"):
            raise ValueError(f"release: expected 'progressive' or 'epoch', got {self.release!r}")

    @property
    def progressive(self) -> bool:
        """Whether read batches are released during the epoch."""
        return self.release == "progressive"


@dataclasses.dataclass(frozen=True)
class LoaderOptions:
    """epochs()' DataLoaders: batches, workers and the wait for a first sample.

    Each attribute but ``dataloader`` is the keyword of its name of
    [`epochs`][epochcache.data.epochs.epochs], documented there; its default is written here
    only. ``dataloader``: the rest of each DataLoader's arguments (``pin_memory``, ...).
    """

    batch_size: int = 64
    num_workers: int | None = None
    drop_last: bool = False
    persistent_workers: bool | None = None
    collate_fn: Callable[[Any], Any] | None = None
    worker_init_fn: Callable[[int], None] | None = None
    min_samples: int = 1
    wait_timeout_s: float | None = None
    dataloader: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size: expected an int >= 1, got {self.batch_size!r}")
        if not isinstance(self.min_samples, int) or self.min_samples < 0:
            raise ValueError(f"min_samples: expected an int >= 0, got {self.min_samples!r}")
        if self.num_workers is not None and (not isinstance(self.num_workers, int)
                                             or self.num_workers < 0):
            raise ValueError(f"num_workers: expected an int >= 0, got {self.num_workers!r}")
        bad = [name for name in RESERVED if name in self.dataloader]
        if bad:
            raise ValueError(f"epochs() sets {', '.join(bad)} itself; use shuffle=/seed= of "
                             "epochs() instead")


def _names(cls: type[Any]) -> frozenset[str]:
    return frozenset(field.name for field in dataclasses.fields(cls))


#: The option names of each value, for the keyword form.
NAMES, EPOCH_NAMES = _names(ReaderOptions), _names(EpochOptions)
LOADER_NAMES = _names(LoaderOptions) - {"dataloader"}


def resolve_options(where: str, options: ReaderOptions | None, keywords: Mapping[str, Any], *,
            epoch: bool = True, loader: bool = False,
            ) -> tuple[ReaderOptions, EpochOptions, LoaderOptions]:
    """The values the keyword form of a call names: each keyword goes to the value with a
    field of its name, reader options overriding ``options`` (default: the defaults).

    ``where`` names the call in errors. ``epoch``: the call takes epoch options
    (``dataset()`` does not); ``loader``: it makes DataLoaders (``epochs()``), which take
    loader options and any other keyword; otherwise an unknown keyword is a TypeError.
    """
    if options is not None and not isinstance(options, ReaderOptions):
        raise TypeError(f"{where}: options: expected an epochcache.ReaderOptions, got "
                        f"{type(options).__name__}")
    known = (NAMES | (EPOCH_NAMES if epoch else frozenset())
             | (LOADER_NAMES if loader else frozenset()))
    unknown = sorted(set(keywords) - known)
    if unknown and not loader:
        raise TypeError(f"{where}: unexpected keyword argument(s) {', '.join(unknown)} "
                        f"(reader options are {', '.join(sorted(NAMES))})")
    overrides = {name: value for name, value in keywords.items() if name in NAMES}
    base = options if options is not None else ReaderOptions()
    return (base.replace(**overrides) if overrides else base,
            EpochOptions(**{k: v for k, v in keywords.items() if k in EPOCH_NAMES}),
            LoaderOptions(**{k: v for k, v in keywords.items() if k in LOADER_NAMES},
                          dataloader={k: keywords[k] for k in unknown}))
