"""The run configuration: one validated model for ``epochcache daemon`` and ``epochcache run``.

A YAML file with five sections (and an optional sixth, ``daemon``); only ``source.url``,
``cache.dir`` and ``cache.capacity`` are required::

    source:  {url: "s3://bucket/train/", layout: files, pattern: "*.npy", storage_options: {}}
    cache:   {dir: /nvme/epochcache, capacity: 200GiB}
    sampler: {processes: 2, concurrency: auto, strategy: uniform, seed: 0}
    loader:  {batch_size: 64, num_workers: null, decode: auto, allow_pickle: false}
    train:   {epochs: 10, min_samples: 1000, entrypoint: "epochcache.examples:train_epoch"}

Instead of ``source`` (one), ``sources`` lists several, each with the fields of ``source`` plus
``name``, ``weight`` and ``optional``: the daemon samples them in proportion to their weights, and
their samples are cached under ``<name>/<key>``.

``${VAR}`` and ``${VAR:-default}`` in any string value are replaced from the environment before
validation (``$${`` writes a literal ``${``), so secrets stay out of files. Values interpolated from a
variable whose name contains KEY, SECRET, TOKEN, PASSWORD or CREDENTIAL, every credential-like key
of ``source.storage_options``, and the credentials inside URLs (userinfo, presigned signature and
token parameters, see `epochcache.redact.redact_url`) are masked as ``***`` in ``repr()``,
`EpochcacheConfig.redacted` and error messages. ``model_dump()`` keeps the real values
(samplers need them): never log it. A config handed to another process goes as
`EpochcacheConfig.to_transfer` and comes back with `EpochcacheConfig.from_transfer`,
which keeps what must be masked (``model_validate`` alone would forget it).

Sizes accept ints or strings such as ``200GiB``/``64MB``; durations ints, floats or ``30s``/``5m``.
Every error is a [`ConfigError`][epochcache.ConfigError] whose message names the field path, the bad
value and what is allowed.
"""

from .environment import resolve_node
from .loading import load_config, parse_config
from .schema import (
    CacheConfig,
    Config,
    DaemonConfig,
    EpochcacheConfig,
    LoaderConfig,
    NamedSourceConfig,
    SamplerConfig,
    SourceConfig,
    SourceEntry,
    TrainConfig,
)

__all__ = [
    "CacheConfig",
    "Config",
    "DaemonConfig",
    "EpochcacheConfig",
    "LoaderConfig",
    "NamedSourceConfig",
    "SamplerConfig",
    "SourceConfig",
    "SourceEntry",
    "TrainConfig",
    "load_config",
    "parse_config",
    "resolve_node",
]
