"""Exceptions raised by epochcache.

Every error subclasses [`EpochcacheError`][epochcache.EpochcacheError] and, where one fits, the matching builtin, so
callers can catch either::

    EpochcacheError
    ├─ ConfigError(EpochcacheError, ValueError)       field path + reason; CLI exit 2
    ├─ NodeLayoutError(EpochcacheError, ValueError)   which ranks share a node is unknown or
    │                                                 contradictory; names the variables to set
    ├─ CheckpointError(EpochcacheError, RuntimeError) a run's checkpoint cannot be resumed from
    ├─ MinSamplesUnreachable(EpochcacheError, ValueError)  the cache cannot reach min_samples:
    │                                                 names the setting and the cause
    ├─ StallError(EpochcacheError, TimeoutError)      a batch took longer than stall_s: names the
    │                                                 epoch, batch, sample key and worker
    ├─ PrepareFailed(EpochcacheError, RuntimeError)   epochs() could not prepare an epoch (its
    │                                                 snapshot, DataLoader or workers); chained
    ├─ PathNotWritable(EpochcacheError, OSError)      a directory or file to write cannot be (a
    │                                                 read-only mount, a file in the way, /proc,
    │                                                 no permission): names the path; CLI exit 2
    ├─ SourceError                                    always carries the URL
    │  ├─ SourceUnavailable                           unreachable endpoint, missing bucket, empty prefix
    │  │  └─ Throttled                                HTTP 503 SlowDown / 429: a rate to adapt to
    │  ├─ RemoteTimeout(SourceError, TimeoutError)    a remote call exceeded its timeout
    │  ├─ PermanentRemoteError                        404, a key the client cannot name: retrying
    │  │  │                                           will not help; the sampler quarantines the key
    │  │  └─ SourceRefused                            401/403, a region or scheme refused: every key
    │  │                                              would fail; the sampler stops the source
    │  └─ CorruptSample                               key; quarantined by the sampler
    ├─ CacheError
    │  ├─ CacheUnusable                               no cache this version can open (missing,
    │  │                                              cut short, not LMDB, a newer format, a copy
    │  │                                              killed part-way): names the path and what
    │  │                                              to do; CLI exit 2
    │  ├─ CacheCorrupted                              a record or counter failed its check
    │  ├─ CacheIOError(CacheError, OSError)           the disk failed a write (EIO); the writer stops
    │  ├─ CacheFull                                   back-pressure: wait, the cache is at capacity + headroom
    │  ├─ SampleRejected(CacheError, ValueError)      one sample can never be stored; samplers quarantine it
    │  │  └─ SampleTooLarge                           larger than the capacity
    │  ├─ DaemonAlreadyRunning                        a second daemon on the same cache
    │  └─ SnapshotClosed(CacheError, RuntimeError)    lifecycle misuse
    └─ DecodeError(EpochcacheError, ValueError)       key + codec
       ├─ PickleNotAllowed                            how to opt in
       └─ MissingImageLibrary(DecodeError, ImportError)  the images extra is not installed
"""

from __future__ import annotations


class EpochcacheError(Exception):
    """Base class of every error epochcache raises."""


class ConfigError(EpochcacheError, ValueError):
    """A configuration value is invalid; the message names the field path."""


class NodeLayoutError(EpochcacheError, ValueError):
    """Which ranks of a distributed job share a node (and its cache) cannot be known from the
    launcher's environment, or the ranks contradict each other. Never guessed: ranks treated as
    one node that are not would read one node's snapshot from another node's cache."""


class CheckpointError(EpochcacheError, RuntimeError):
    """A run's checkpoint cannot be read (``--resume``); the message names the file."""


class MinSamplesUnreachable(EpochcacheError, ValueError):
    """Waiting for ``min_samples`` cannot end: the cache is full, the daemon is gone, or every
    fetch fails. The message names the setting and the cause."""


class StallError(EpochcacheError, TimeoutError):
    """A batch took longer than ``stall_s`` (``loader.stall_action: raise``, the default): the
    stall report (stacks of the stalled process and of its DataLoader workers) was written
    first, and the message names the epoch, batch, sample key and worker. The job ends
    instead of hanging, so that a scheduler's restart and ``--resume`` recover it.

    Constructed from its message alone (DataLoader re-raises a worker's error that way).
    """


class SourceError(EpochcacheError):
    """A remote source failed. ``url`` names the source or object."""

    def __init__(self, message: str, url: str = "") -> None:
        super().__init__(message)
        self.url = url


class SourceUnavailable(SourceError):
    """The remote cannot be reached, does not exist, or holds no matching keys."""


class Throttled(SourceUnavailable):
    """The remote refused a request for its rate (S3's ``503 SlowDown``, HTTP 429 or 503):
    samplers lower their concurrency and ask for the same object again, never quarantine it."""


class RemoteTimeout(SourceError, TimeoutError):
    """A remote call did not finish within its timeout."""


class PermanentRemoteError(SourceError):
    """A remote error that retrying will not fix (not found, a key the client cannot name):
    the sampler quarantines the key."""


class SourceRefused(PermanentRemoteError):
    """The remote refuses the source's requests whatever the key: access denied (401/403),
    the bucket in another region than the one signed for (301, or 400 naming the region), a
    scheme the client refuses. The message names the URL, the setting and what to do; a
    sampler whose whole batch meets it stops the source (checked again now and then)
    instead of retrying every key."""


class CorruptSample(SourceError):
    """A remote object failed a content check; it is quarantined, never cached."""

    def __init__(self, message: str, url: str = "", key: str = "") -> None:
        super().__init__(message, url)
        self.key = key


class CacheError(EpochcacheError):
    """The local cache cannot do what was asked."""


class CacheUnusable(CacheError):
    """The directory handed over holds no cache this version can open: none at all, a data file
    cut short or not LMDB's, a newer format, the leftover of a copy killed part-way. Raised
    before LMDB maps the file (a map past a file's end is a SIGBUS); the message names the path
    and what to do. The CLI exits 2."""


class CacheCorrupted(CacheError):
    """A stored record or counter failed its consistency check."""


class CacheIOError(CacheError, OSError):
    """The disk failed a write with an I/O error (EIO): not a full disk, a failing one.

    The write was not committed (LMDB transactions), so nothing committed is lost, but a writer
    that meets this stops: retrying against a failing disk cannot help.
    """


class CacheFull(CacheError):
    """The cache is at capacity plus headroom and nothing can be evicted yet.

    Writers should wait and retry: space returns when a lease is released. ``result`` holds
    what the interrupted ``put_many`` did commit.
    """

    result: object = None


class SampleRejected(CacheError, ValueError):
    """One sample can never be stored (``key`` names it); the rest of its batch can."""

    def __init__(self, message: str, key: str = "") -> None:
        super().__init__(message)
        self.key = key


class SampleTooLarge(SampleRejected):
    """A single sample is larger than the cache could ever hold."""


class DaemonAlreadyRunning(CacheError):
    """Another live daemon already fills this cache."""


class SnapshotClosed(CacheError, RuntimeError):
    """A snapshot or dataset was used after its lease was released."""


class PrepareFailed(EpochcacheError, RuntimeError):
    """Preparing an epoch of ``epochs()`` (its snapshot, DataLoader and workers, made in the
    background while the previous epoch trains) failed; the cause is chained."""


class PathNotWritable(EpochcacheError, OSError):
    """A path epochcache must write (a cache directory, a run directory, a copy's destination,
    an output file) cannot be written: a read-only filesystem, a file where a directory should
    be, a filesystem such as /proc, no permission. The message names the path, what it is for
    and the cause; ``path`` holds the path. Raised before anything is changed where it can be
    known at start."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path

    def __reduce__(self) -> tuple[type[PathNotWritable], tuple[str, str]]:
        return type(self), (str(self), self.path)


class DecodeError(EpochcacheError, ValueError):
    """A cached sample could not be decoded; the message names its key and codec."""

    def __init__(self, message: str, key: str = "") -> None:
        super().__init__(message)
        self.key = key


class PickleNotAllowed(DecodeError):
    """A sample would need pickle to decode and the config did not opt in."""


class MissingImageLibrary(DecodeError, ImportError):
    """Decoding an image needs the ``images`` extra (``pip install 'epochcache[images]'``);
    never skipped by ``on_error='skip'``."""
