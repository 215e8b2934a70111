"""The public surface is what it is on purpose (issue 29, item 5).

A name users can import from ``epochcache``, or call on a ``Cache``, is one the docs promise to
keep: adding or removing one must be a decision, made here, not a side effect of a refactor
(``Cache`` used to inherit 42 names from the store, plumbing included). Every exception users
can meet is in errors.py's tree and exported; ``import epochcache`` stays free of torch.
"""

from __future__ import annotations

import inspect
import subprocess
import sys

import epochcache
from epochcache import errors

EXPORTED = {
    # the cache and its daemon
    "Cache", "Daemon", "load_config", "ReaderOptions", "PutResult", "Snapshot",
    # what a cache gives training (these import torch when first used)
    "EpochDataset", "CacheStream", "EpochLoader",
    # the errors (errors.py)
    "EpochcacheError", "ConfigError", "NodeLayoutError", "CheckpointError",
    "MinSamplesUnreachable", "StallError", "PrepareFailed", "PathNotWritable", "SourceError",
    "SourceUnavailable", "Throttled", "RemoteTimeout", "PermanentRemoteError", "SourceRefused",
    "CorruptSample", "CacheError", "CacheCorrupted", "CacheIOError", "CacheFull",
    "CacheUnusable", "SampleRejected", "SampleTooLarge",
    "DaemonAlreadyRunning", "SnapshotClosed", "DecodeError", "PickleNotAllowed",
    "MissingImageLibrary",
    "__version__",
}

CACHE = {
    "path", "capacity_bytes", "headroom_bytes", "effective_capacity", "eviction",
    "put", "put_many", "get", "get_many", "seq_of", "contains_many", "info", "evict",
    "snapshot", "leases", "keep_for_resume", "release_lease",
    "stats", "counters", "coverage", "record_trained", "history", "quarantined",
    "file_bytes", "copy_to", "close",
    "dataset", "epochs", "stream",
}


def test_the_exported_names_are_the_promised_ones() -> None:
    assert set(epochcache.__all__) == EXPORTED
    for name in epochcache.__all__:
        assert getattr(epochcache, name) is not None, name


def test_a_cache_shows_users_what_they_call_and_nothing_of_the_store() -> None:
    public = {name for name in dir(epochcache.Cache) if not name.startswith("_")}
    assert public == CACHE
    for name in ("take_snapshot", "write_plan_part", "dbs", "heartbeat_lease", "tables"):
        assert not hasattr(epochcache.Cache, name), name
    # every public member is documented (the API reference renders these docstrings)
    undocumented = [name for name in sorted(CACHE)
                    if not inspect.getdoc(getattr(epochcache.Cache, name))]
    assert undocumented == []


def test_every_exception_users_meet_is_in_the_tree_and_exported() -> None:
    defined = {name for name, value in vars(errors).items()
               if inspect.isclass(value) and issubclass(value, BaseException)
               and value.__module__ == errors.__name__}
    assert defined <= EXPORTED
    for name in defined:
        assert issubclass(getattr(errors, name), errors.EpochcacheError), name
    exported = {name for name in epochcache.__all__ if name != "__version__"
                and inspect.isclass(getattr(epochcache, name))
                and issubclass(getattr(epochcache, name), BaseException)}
    assert exported == defined  # none defined elsewhere (PrepareFailed was in data/epochs.py)


def test_importing_epochcache_imports_no_torch() -> None:
    code = ("import sys, epochcache\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "assert 'epochcache.config' not in sys.modules, 'the config model imported'\n"
            "epochcache.Cache, epochcache.ReaderOptions, epochcache.StallError\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
