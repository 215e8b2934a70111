"""The edge between the run config and the ingest layer.

Sources and samplers take plain arguments (`SourceSpec`,
numbers); this module is the one place that reads the validated config's sections into them.
"""

from __future__ import annotations

import dataclasses
import os

from ..config import EpochcacheConfig, SourceConfig
from .layouts import Source, SourceSpec, open_source


def manifest_location(manifest: str | None) -> str | None:
    """A config's ``source.manifest`` as a URL or an absolute path: a relative path is read
    from the working directory, as every relative path of a config is (``cache.dir``,
    ``train.run_dir``, a local ``source.url``); a manifest beside the data is named by its
    URL. (`SourceSpec.manifest` also takes a path relative to the source's URL.)"""
    if manifest is None or "://" in manifest or os.path.isabs(manifest):
        return manifest
    return os.path.abspath(manifest)


def source_spec(config: SourceConfig) -> SourceSpec:
    """The `SourceSpec` of a validated ``source`` section."""
    return SourceSpec(
        url=config.url,
        layout=config.layout,
        pattern=config.pattern,
        shards=config.shards,
        manifest=manifest_location(config.manifest),
        manifest_format=config.manifest_format,
        storage_options=dict(config.storage_options),
        timeout_s=config.timeout_s,
        connect_timeout_s=config.connect_timeout_s,
        list_deadline_s=config.list_deadline_s,
        retries=config.retries,
        checks=tuple(config.checks),
        manifest_max_bytes=config.manifest_max_bytes,
        manifest_max_lines=config.manifest_max_lines,
        client=config.client,
    )


def max_sample_bytes(config: EpochcacheConfig) -> int:
    """The largest sample samplers accept: ``loader.max_sample_bytes``, or the cache capacity
    when smaller (a larger sample could never be cached)."""
    return min(config.loader.max_sample_bytes, config.cache.capacity_bytes)


#: Requests in flight of a source opened with ``concurrency: auto`` until a sampler's feed puts
#: its own control in (and the threads of a local source's reader).
AUTO_START_CONCURRENCY = 16


def open_configured_source(config: EpochcacheConfig,
                           section: SourceConfig | None = None) -> Source:
    """A source of a whole config (``section``, default the first), as one sampler process
    opens it: ``sampler.concurrency`` (``auto``: `AUTO_START_CONCURRENCY`; a sampler's
    feed then finds it), checks off when ``sampler.check`` is false, and
    ``sampler.bandwidth_limit`` split evenly among ``sampler.processes`` (a sampler shares its
    limiter among its sources: see ``Sampler``)."""
    sampler = config.sampler
    limit = sampler.bandwidth_limit / sampler.processes if sampler.bandwidth_limit else None
    spec = source_spec(section if section is not None else config.first_source)
    concurrency = sampler.concurrency
    return open_source(
        dataclasses.replace(spec, max_sample_bytes=max_sample_bytes(config),
                            max_range_bytes=sampler.max_bytes_in_flight),
        concurrency=concurrency if isinstance(concurrency, int) else AUTO_START_CONCURRENCY,
        checks=None if sampler.check else (),
        bandwidth_limit=limit,
    )
