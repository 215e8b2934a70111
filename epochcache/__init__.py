"""epochcache: a growing local sample cache for remote training datasets, for PyTorch.

Importing the package does not import torch (``Cache.dataset`` and ``Cache.epochs`` do) nor the
config model (``Daemon`` and ``load_config`` do).
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
    CheckpointError,
    ConfigError,
    CorruptSample,
    DaemonAlreadyRunning,
    DecodeError,
    EpochcacheError,
    MinSamplesUnreachable,
    NodeLayoutError,
    PermanentRemoteError,
    PickleNotAllowed,
    RemoteTimeout,
    SampleRejected,
    SampleTooLarge,
    SnapshotClosed,
    SourceError,
    SourceUnavailable,
    StallError,
)
from .store import PutResult, Snapshot

__version__ = "0.1.0"

if TYPE_CHECKING:
    from .config import EpochcacheConfig as Config


def load_config(path: str) -> Config:
    """Read and validate a YAML run config (see ``epochcache.config``)."""
    from .config import load_config as _load

    return _load(path)


def __getattr__(name: str) -> Any:
    # EpochDataset and CacheStream import torch: load them only when asked for.
    if name == "EpochDataset":
        from .data.dataset import EpochDataset

        return EpochDataset
    if name == "CacheStream":
        from .data.stream import CacheStream

        return CacheStream
    raise AttributeError(f"module 'epochcache' has no attribute {name!r}")


__all__ = [
    "Cache",
    "CacheCorrupted",
    "CacheError",
    "CacheFull",
    "CacheIOError",
    "CacheStream",
    "CheckpointError",
    "ConfigError",
    "CorruptSample",
    "Daemon",
    "DaemonAlreadyRunning",
    "DecodeError",
    "EpochDataset",
    "EpochcacheError",
    "MinSamplesUnreachable",
    "NodeLayoutError",
    "PermanentRemoteError",
    "PickleNotAllowed",
    "PutResult",
    "RemoteTimeout",
    "SampleRejected",
    "SampleTooLarge",
    "Snapshot",
    "SnapshotClosed",
    "SourceError",
    "SourceUnavailable",
    "StallError",
    "__version__",
    "load_config",
]
