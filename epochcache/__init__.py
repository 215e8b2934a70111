"""epochcache: a growing local sample cache for remote training datasets, for PyTorch.

Importing the package does not import torch (``Cache.dataset``, ``Cache.epochs`` and
``Cache.stream`` do, and so does the first use of ``EpochDataset``, ``CacheStream`` or
``EpochLoader``) nor the config model (``Daemon`` and ``load_config`` do).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .cache import Cache
from .daemon import Daemon
from .errors import (
    CacheCorrupted,
    CacheError,
    CacheFull,
    CacheIOError,
    CacheUnusable,
    CheckpointError,
    ConfigError,
    CorruptSample,
    DaemonAlreadyRunning,
    DecodeError,
    EpochcacheError,
    MinSamplesUnreachable,
    MissingImageLibrary,
    NodeLayoutError,
    PathNotWritable,
    PermanentRemoteError,
    PickleNotAllowed,
    PrepareFailed,
    RemoteTimeout,
    SampleRejected,
    SampleTooLarge,
    SnapshotClosed,
    SourceError,
    SourceRefused,
    SourceUnavailable,
    StallError,
    Throttled,
)
from .options import ReaderOptions
from .store import PutResult, Snapshot

__version__ = "0.1.0"

if TYPE_CHECKING:
    from .config import EpochcacheConfig as Config


def load_config(path: str) -> Config:
    """Read and validate a YAML run config (see ``epochcache.config``)."""
    from .config import load_config as _load

    return _load(path)


#: Public names that import torch, and where they live: loaded when first asked for.
_TORCH_NAMES = {
    "EpochDataset": "epochcache.data.dataset",
    "CacheStream": "epochcache.data.stream",
    "EpochLoader": "epochcache.data.epoch_loader",
}


def __getattr__(name: str) -> Any:
    module = _TORCH_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'epochcache' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "Cache",
    "CacheCorrupted",
    "CacheError",
    "CacheFull",
    "CacheIOError",
    "CacheStream",
    "CacheUnusable",
    "CheckpointError",
    "ConfigError",
    "CorruptSample",
    "Daemon",
    "DaemonAlreadyRunning",
    "DecodeError",
    "EpochDataset",
    "EpochLoader",
    "EpochcacheError",
    "MinSamplesUnreachable",
    "MissingImageLibrary",
    "NodeLayoutError",
    "PathNotWritable",
    "PermanentRemoteError",
    "PickleNotAllowed",
    "PrepareFailed",
    "PutResult",
    "ReaderOptions",
    "RemoteTimeout",
    "SampleRejected",
    "SampleTooLarge",
    "Snapshot",
    "SnapshotClosed",
    "SourceError",
    "SourceRefused",
    "SourceUnavailable",
    "StallError",
    "Throttled",
    "__version__",
    "load_config",
]
