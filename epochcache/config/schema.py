"""The config's model: its sections and fields, their validation, and what a config masks.

Field descriptions are the reference (``scripts/gen_reference.py`` renders
docs/reference/config.md from them); see `epochcache.config` for the format.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, NamedTuple

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ..limits import (
    DEFAULT_MANIFEST_MAX_BYTES,
    DEFAULT_MANIFEST_MAX_LINES,
    DEFAULT_MAX_BYTES_IN_FLIGHT,
)
from ..options import EpochOptions, LoaderOptions, ReaderOptions
from ..redact import REDACTED, is_secret_key, redact_options, redact_tree
from ..registry import LAYOUTS, check_policy, missing_requirement
from ..units import headroom_bytes, parse_duration, parse_headroom, parse_size
from .environment import found_secrets, pyarrow_available, resolve_node, set_path

log = logging.getLogger("epochcache.config")

_ENTRYPOINT = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
#: A source name is the first component of its samples' cache keys: no "/", short.
_SOURCE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def _size(value: Any) -> Any:
    return value if value is None else parse_size(value, name="size")


def _rate(value: Any) -> Any:
    if isinstance(value, str) and value.strip().lower().endswith("/s"):
        value = value.strip()[:-2]
    return _size(value)


def _resume(value: Any) -> Any:
    """``true``, ``false`` or ``auto`` (one message for all three)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("auto", "true", "false"):
        return {"auto": "auto", "true": True, "false": False}[value.strip().lower()]
    raise ValueError(f"expected true, false or auto, got {value!r}")


def _concurrency(value: Any) -> Any:
    """``auto``, or a number of requests from 1 to 1024 (one message for both)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    number = value
    if isinstance(value, str) and value.strip().isdigit():
        number = int(value)
    if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= 1024:
        raise ValueError(f"expected auto, or a number of requests in flight from 1 to 1024, "
                         f"got {value!r}")
    return number


def _duration(value: Any) -> Any:
    return value if value is None else parse_duration(value, name="duration")


def _headroom(value: Any) -> Any:
    """A fraction of capacity (``0.1``, ``"10%"``) stays a float; a size becomes int bytes."""
    if isinstance(value, int) and not isinstance(value, bool) and value == 0:
        return 0.0
    return parse_headroom(value)


def _eviction(value: Any) -> Any:
    """A registered eviction policy's name (`epochcache.registry`)."""
    return value if value is None else check_policy(str(value))


Check = Literal["size", "checksum", "format"]
_ALL_CHECKS: tuple[Check, ...] = ("size", "checksum", "format")
Duration = Annotated[float, BeforeValidator(_duration), Field(gt=0)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


if TYPE_CHECKING:
    LayoutName = str
else:  # the registry's names: validated (and listed in the reference pages) from there
    LayoutName = Literal[tuple(sorted(LAYOUTS))]
_SHARD_LAYOUTS = " or ".join(name for name, entry in sorted(LAYOUTS.items()) if entry.shards)


class SourceConfig(_Section):
    """Where the dataset lives and how to read it (section ``source``)."""

    url: str = Field(min_length=1, description="root URL of the dataset (any fsspec URL)")
    layout: LayoutName = Field(
        default="files",
        description="; ".join(f"{name}: {entry.help}" for name, entry in sorted(LAYOUTS.items())),
    )
    pattern: str | None = Field(
        default=None, description="glob under url; default: " + ", ".join(
            f'"{entry.pattern}" ({name})' for name, entry in sorted(LAYOUTS.items())),
    )
    shards: str | None = Field(
        default=None, description=f"{_SHARD_LAYOUTS} shards as a brace pattern, e.g. "
                                  "x-{000..009}.tar"
    )
    manifest: str | None = Field(
        default=None, description="URL or path of a key manifest instead of listing (a "
                                  "relative path is read from the working directory, as every "
                                  "path of a config; a manifest beside the data: its URL)"
    )
    manifest_format: Literal["auto", "txt", "csv", "jsonl", "parquet"] = Field(
        default="auto",
        description="the manifest's format; auto: from its extension",
    )
    manifest_max_bytes: Annotated[int, BeforeValidator(_size), Field(gt=0)] = Field(
        default=DEFAULT_MANIFEST_MAX_BYTES,
        description="the most memory the keys a manifest lists may take (keys, checksums and 16 "
                    "bytes a key); more fail the start. A manifest is read as a stream: a line "
                    "over 64 KiB fails it too, whatever its size or what it gunzips to",
    )
    manifest_max_lines: int = Field(
        default=DEFAULT_MANIFEST_MAX_LINES, gt=0,
        description="the most lines read from a manifest (blank and comment lines too); more "
                    "fail the start",
    )
    sample_while_listing: bool = Field(
        default=True,
        description="start sampling from the first keys of a large bucket while the rest is "
                    "listed (false: wait for the whole listing; see docs/guide/samplers.md)",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="passed to the fsspec filesystem (s3fs: key, secret, endpoint_url, ...); "
                    "credential-like values are masked everywhere; an empty one (`${VAR:-}` "
                    "unset) is left out, so the filesystem's own credential chain applies "
                    "(environment, ~/.aws, instance role)",
    )
    client: Literal["auto", "s3fs", "obstore"] = Field(
        default="auto",
        description="who reads an s3:// source's objects: obstore costs a fraction of s3fs's "
                    "CPU per request; auto: obstore where installed and its storage_options "
                    "map onto it, else s3fs (listing is s3fs's either way)",
    )
    timeout_s: Duration = Field(
        default=30.0,
        description="timeout of every remote call (of every page of a listing)",
    )
    connect_timeout_s: Duration = Field(default=5.0, description="timeout to connect to the remote")
    list_deadline_s: Duration = Field(
        default=6.0,
        description="an unreachable source fails the start within this (exit 2)",
    )
    retries: int = Field(
        default=5, ge=1, le=100,
        description="attempts per remote call, with exponential backoff and jitter",
    )
    checks: list[Check] = Field(
        default_factory=lambda: list(_ALL_CHECKS),
        description="checks on ingest: a manifest's size and checksum, and formats (gzip, tar, "
                    ".npy, .json, .zip/.npz); failing objects are quarantined",
    )
    listing_ttl_s: Duration | None = Field(
        default=None,
        description="re-list the source in the background this long after the last listing; "
                    "new keys join the sampling order (default: list once, reuse the saved listing)",
    )
    demo_samples: int | None = Field(
        default=None, ge=1,
        description="write a synthetic demo dataset of this many samples at url when none is there",
    )
    demo_kind: Literal["npy", "jpg"] = Field(
        default="npy", description="the demo dataset's samples: npy arrays or jpg images of shapes"
    )

    _secret_values: set[str] = PrivateAttr(default_factory=set)

    @field_validator("storage_options")
    @classmethod
    def _drop_empty_credentials(cls, options: dict[str, Any]) -> dict[str, Any]:
        # `key: ${MY_KEY:-}` with the variable unset: an empty key would be sent and refused
        # (403); left out, the filesystem finds credentials its usual way (environment,
        # ~/.aws, the instance role).
        return {name: value for name, value in options.items()
                if not (value == "" and is_secret_key(str(name)))}

    @field_validator("layout")
    @classmethod
    def _layout_installed(cls, name: str) -> str:
        missing = missing_requirement(name)
        if missing is not None:
            raise ValueError(missing)
        return name

    @property
    def effective_pattern(self) -> str:
        """The glob used for listing when no manifest or shard pattern is given."""
        return self.pattern if self.pattern is not None else LAYOUTS[self.layout].pattern

    @model_validator(mode="after")
    def _check_combination(self) -> SourceConfig:
        if self.shards is not None and not LAYOUTS[self.layout].shards:
            raise ValueError(f"shards is only used with layout: {_SHARD_LAYOUTS} (remove it or "
                             f"set layout: {_SHARD_LAYOUTS})")

        if self.manifest is not None:
            fmt = self.manifest_format
            name = self.manifest.lower().removesuffix(".gz")
            parquet = fmt == "parquet" or (fmt == "auto" and name.endswith(".parquet"))
            if parquet and not pyarrow_available():
                raise ValueError(
                    "a Parquet manifest needs pyarrow (pip install pyarrow); or use .csv/.jsonl/.txt"
                )
        return self

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        # pydantic's __repr__, __str__ and __rich_repr__ all go through here.
        for name, value in super().__repr_args__():
            if name == "storage_options":  # credentials masked by name, then by value
                value = redact_options(self.storage_options)
            yield name, redact_tree(value, self._secret_values)


class NamedSourceConfig(SourceConfig):
    """One entry of ``sources``: the fields of ``source``, plus its name, weight and whether
    the daemon may start without it."""

    name: str = Field(description="the source's samples are cached under '<name>/<key>'")
    weight: float = Field(default=1.0, gt=0, description="share of the samples ingested")
    optional: bool = Field(
        default=False,
        description="an unreachable source at start is left out (with a warning) instead of "
                    "failing the start",
    )

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not _SOURCE_NAME.match(value):
            raise ValueError(
                f"expected 1-64 letters, digits, '_', '-' or '.' (no '/': it prefixes the cache "
                f"keys), got {value!r}"
            )
        return value


class SourceEntry(NamedTuple):
    """A source the daemon samples: ``name`` is "" for a single ``source`` (keys are not
    namespaced), else the entry's name (keys are ``<name>/<key>``)."""

    name: str
    config: SourceConfig
    weight: float = 1.0
    optional: bool = False

    @property
    def key_prefix(self) -> str:
        """What this source's cache keys start with."""
        return f"{self.name}/" if self.name else ""


class CacheConfig(_Section):
    """The local cache (section ``cache``)."""

    dir: Path = Field(
        description="the cache directory, on local disk; created private to your user",
    )
    capacity: Annotated[int, BeforeValidator(_size), Field(gt=0)] = Field(
        description="stored bytes to keep; samples no epoch needs are evicted beyond it, "
                    "the oldest first unless `cache.eviction` says otherwise",
    )
    headroom: Annotated[float | int, BeforeValidator(_headroom)] = Field(
        default=0.1,
        description="extra bytes writers may use while epochs hold samples: a fraction of "
                    "capacity or a size",
    )
    compression: Literal["zstd", "none"] = Field(
        default="zstd",
        description="zstd-compress samples that shrink (incompressible ones are stored raw "
                    "either way)",
    )
    eviction: Annotated[str | None, BeforeValidator(_eviction)] = Field(
        default=None,
        description="what eviction takes first, among the samples no epoch needs: a policy "
                    "name, stored in the cache so that every process evicts alike (null keeps "
                    "the stored one; a new cache gets `oldest`)",
    )
    level: int = Field(default=3, ge=-7, le=22, description="the zstd level")
    sync: bool = Field(
        default=True,
        description="fsync every commit: survives power loss; false keeps kill -9 safety only",
    )
    resume_grace_s: Duration = Field(
        default=EpochOptions.resume_grace_s,
        description="a dead run's epoch lease that a checkpoint names is kept this long past "
                    "its last heartbeat, for `run --resume` to continue the epoch; then it is "
                    "reclaimed",
    )

    @property
    def headroom_bytes(self) -> int:
        """Headroom in bytes: a fraction of capacity, or the size given."""
        return headroom_bytes(self.headroom, self.capacity)


class SamplerConfig(_Section):
    """The background samplers (section ``sampler``).

    Timeouts and retries of remote calls are ``source.timeout_s`` and ``source.retries``.
    ``node_rank``/``num_nodes`` default to the torchrun environment, read by `node`.
    """

    processes: int = Field(default=2, ge=1, le=256, description="sampler subprocesses")
    concurrency: Annotated[Annotated[int, Field(ge=1, le=1024)] | Literal["auto"],
                           BeforeValidator(_concurrency)] = Field(
        default="auto",
        description="requests in flight per sampler and source: auto finds it (grows while "
                    "throughput grows, backs off on throttling and timeouts), a number fixes it "
                    "(local files: one reader while reads are quick)",
    )
    max_requests_per_s: Annotated[float, Field(gt=0)] | None = Field(
        default=None,
        description="requests per second the node's samplers may send in all, retries "
                    "included (null: no budget; a throttling remote is adapted to either way)",
    )
    strategy: Literal["uniform", "weighted"] = Field(
        default="uniform",
        description="uniform without replacement per pass, or weighted by a manifest's weight "
                    "column",
    )
    seed: int = Field(default=0, ge=0, description="seeds the sampling order")
    node_rank: int | None = Field(
        default=None, ge=0,
        description="this node (default: torchrun's GROUP_RANK, Slurm's SLURM_NODEID; else 0): "
                    "nodes pull disjoint partitions",
    )
    num_nodes: int | None = Field(
        default=None, ge=1,
        description="nodes in the job (default: from the launcher's environment; else 1)",
    )
    batch_size: int = Field(default=64, ge=1, description="samples per cache commit")
    bandwidth_limit: Annotated[int, BeforeValidator(_rate), Field(gt=0)] | None = Field(
        default=None,
        description="bytes per second the node's samplers may fetch in all (null: no limit)",
    )
    max_bytes_in_flight: Annotated[int, BeforeValidator(_size), Field(gt=0)] = Field(
        default=DEFAULT_MAX_BYTES_IN_FLIGHT,
        description="bytes one sampler process holds between fetch and commit (listed sizes "
                    "count before the fetch); an object larger than this is fetched alone",
    )
    check: bool = Field(default=True, description="run the source's checks on ingest (false: none)")

    @model_validator(mode="after")
    def _check_node(self) -> SamplerConfig:
        rank, count = self.node_rank, self.num_nodes
        if rank is not None and count is not None and rank >= count:
            raise ValueError(f"node_rank {rank} must be below num_nodes {count}")
        return self

    def node(self, environ: Mapping[str, str] | None = None) -> tuple[int, int]:
        """``(node_rank, num_nodes)``: the configured values, else torchrun's environment, else (0, 1).

        Read at call time from ``EPOCHCACHE_NODE_RANK``/``EPOCHCACHE_NUM_NODES``, then ``GROUP_RANK``
        and ``GROUP_WORLD_SIZE`` (or ``WORLD_SIZE // LOCAL_WORLD_SIZE``), then, in a distributed
        launch, Slurm's ``SLURM_NODEID``/``SLURM_NNODES``; never guessed.

        Raises:
            ConfigError: the environment gives an invalid pair.
        """
        return resolve_node(
            self.node_rank, self.num_nodes, os.environ if environ is None else environ
        )


#: The API's reader defaults, for the config's (their types are wider than the config's Literals).
_READER: Any = ReaderOptions()


class LoaderConfig(_Section):
    """The per-epoch DataLoader (section ``loader``)."""

    # The defaults shared with the API are the option values' (epochcache.options).
    batch_size: int = Field(default=LoaderOptions.batch_size, ge=1, description="samples per batch")
    num_workers: int | None = Field(
        default=LoaderOptions.num_workers, ge=0,
        description="DataLoader workers; null: epochs()' default (0 without a transform)",
    )
    decode: Literal["auto", "raw"] = Field(
        default=_READER.decode,
        description="auto: by extension (.npy, .cls, .json, images, ...); raw: bytes",
    )
    allow_pickle: bool = Field(
        default=_READER.allow_pickle,
        description="decode .pkl/.pickle samples (runs code: only for data you trust)",
    )
    max_sample_bytes: Annotated[int, BeforeValidator(_size), Field(gt=0)] = Field(
        default=_READER.max_sample_bytes,
        description="the largest sample: objects listed larger are quarantined before download, "
                    "decompression (gzip) stops past it on ingest and in the loader",
    )
    pin_memory: bool = Field(
        default=False,
        description="pinned batches for asynchronous copies to a GPU (unset: true when the run "
                    "trains on a GPU)",
    )
    prefetch_factor: int | None = Field(
        default=2, ge=1,
        description="batches each worker reads ahead",
    )
    persistent_workers: bool | None = Field(
        default=LoaderOptions.persistent_workers,
        description="keep workers across epochs; null: true with workers",
    )
    stall_s: Duration = Field(
        default=_READER.stall_s,
        description="a batch slower than this is a stall: the stacks of the trainer and its "
                    "DataLoader workers are dumped, the sample key and worker named",
    )
    stall_action: Literal["raise", "warn"] = Field(
        default=_READER.stall_action,
        description="after a stall's report: raise ends the run with StallError (a "
                    "scheduler's restart and --resume recover it); warn only reports",
    )
    timeout: Annotated[float, BeforeValidator(_duration), Field(ge=0)] = Field(
        default=0.0,
        description="DataLoader's timeout for a batch from a worker (0: none; needs "
                    "num_workers > 0)",
    )
    fields: list[str] | None = Field(
        default=_READER.fields,
        description='samples as tuples of these fields, e.g. ["jpg;png", "cls"] (WebDataset to_tuple)',
    )
    image: Literal["numpy", "torch", "pil"] = Field(
        default=_READER.image,
        description="images decode to HWC uint8 arrays, CHW uint8 tensors, or PIL images",
    )

    def reader_options(self) -> ReaderOptions:
        """How a run's loaders read samples: this section's reader options, as one
        [`ReaderOptions`][epochcache.ReaderOptions] (the API's defaults for the rest)."""
        return ReaderOptions(decode=self.decode, allow_pickle=self.allow_pickle,
                             max_sample_bytes=self.max_sample_bytes,
                             fields=None if self.fields is None else tuple(self.fields),
                             image=self.image, stall_s=self.stall_s,
                             stall_action=self.stall_action)

    @field_validator("timeout")
    @classmethod
    def _check_timeout(cls, value: float, info: ValidationInfo) -> float:
        # torch applies it to batches from worker processes only: without workers it fails
        # epoch 0 where batches are pinned (a GPU run) and was ignored on the CPU.
        if value > 0 and "num_workers" in info.data and not info.data["num_workers"]:
            raise ValueError(
                "needs DataLoader workers: torch's timeout applies to batches from worker "
                "processes, and loader.num_workers is 0 (null means 0 in a run); set "
                "loader.num_workers > 0, or remove loader.timeout (loader.stall_s reports a "
                "slow batch either way)")
        return value

    @field_validator("fields", mode="before")
    @classmethod
    def _split_fields(cls, value: Any) -> Any:
        if isinstance(value, str):  # "jpg;png cls", as WebDataset's to_tuple takes it
            value = value.split()
        return value

    @field_validator("fields")
    @classmethod
    def _check_fields(cls, value: list[str] | None) -> list[str] | None:
        if value is not None:
            if not value:
                raise ValueError("expected at least one field name, or null for whole samples")
            for item in value:
                if not [name for name in item.split(";") if name.strip()]:
                    raise ValueError(f"empty field name in {item!r}; use names like 'jpg;png'")
        return value


Port = Annotated[int, Field(ge=0, le=65535)]


class DaemonConfig(_Section):
    """The daemon process (section ``daemon``): its Prometheus ``/metrics`` endpoint."""

    metrics_port: Port | None = Field(
        default=None, description="serve Prometheus /metrics on this port (0: any free port)")
    metrics_host: str = Field(default="127.0.0.1", min_length=1,
                              description="address /metrics listens on")


class TrainConfig(_Section):
    """A YAML-configured training run (section ``train``); ``options`` go to the entrypoint."""

    epochs: int = Field(default=10, ge=1, description="epochs to train")
    min_samples: int = Field(
        default=1000, ge=0,
        description="wait until the cache holds this many samples (never forever: an unreachable "
                    "number fails, naming it)",
    )
    samples_per_epoch: int | None = Field(
        default=EpochOptions.samples_per_epoch, ge=1,
        description="a fixed epoch length per node, resampling a small cache (null: the whole "
                    "snapshot)",
    )
    entrypoint: str = Field(
        default="epochcache.examples:train_epoch",
        description="package.module:function called once per epoch as fn(run, epoch, loader)",
    )
    run_dir: Path = Field(
        default=Path("runs/default"),
        description="where the config, metrics.jsonl, checkpoints and plots go",
    )
    allow_other_sources: bool = Field(
        default=False,
        description="train on cache.dir even when it holds samples of other sources than this "
                    "run's, or a daemon fills it from others (false: the run refuses to start, "
                    "naming both)",
    )
    seed: int = Field(
        default=EpochOptions.seed, ge=0,
        description="seeds the epochs' order and the workers' random state",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="passed to the trainer as run.options",
    )
    metrics_port: Port | None = Field(
        default=None, description="serve the training side's Prometheus /metrics on this port")
    metrics_host: str = Field(default="127.0.0.1", min_length=1,
                              description="the address train.metrics_port listens on")
    checkpoint_every_s: Duration | None = Field(
        default=None,
        description="also checkpoint mid-epoch this often (and on SIGTERM): model, optimizer "
                    "and the epoch's position; `run --resume` then continues the interrupted "
                    "epoch exactly where its last checkpoint was (null: at epoch ends only)",
    )
    resume: Annotated[bool | Literal["auto"], BeforeValidator(_resume)] = Field(
        default=False,
        description="continue from run_dir's checkpoint: auto when there is one, else start "
                    "at epoch 0 (a requeued Slurm job resumes by itself); true always, as "
                    "`run --resume`; false never (`--resume` overrides it)",
    )
    manifests: bool = Field(
        default=True,
        description="write the sample keys each epoch trains on, per rank and in order, to "
                    "run_dir/manifests/ (zstd, a few bytes a sample; `epochcache manifest` "
                    "prints them, ready to feed back as source.manifest)",
    )
    plot: bool = Field(
        default=True,
        description="write run_dir/run.png (loss, data wait, fill, turnover, coverage) when the "
                    "run ends, if matplotlib is installed (about a second of CPU)",
    )

    @field_validator("entrypoint")
    @classmethod
    def _check_entrypoint(cls, value: str) -> str:
        if not _ENTRYPOINT.match(value):
            raise ValueError(
                f"expected 'package.module:function' (e.g. epochcache.examples:train_epoch), got {value!r}"
            )
        return value


class EpochcacheConfig(_Section):
    """The whole configuration; see the module docstring."""

    source: SourceConfig | None = None
    sources: list[NamedSourceConfig] | None = Field(
        default=None, min_length=1,
        description="instead of source: several sources, each with a name and a weight")
    cache: CacheConfig
    sampler: SamplerConfig = Field(default_factory=lambda: SamplerConfig())
    loader: LoaderConfig = Field(default_factory=lambda: LoaderConfig())
    train: TrainConfig = Field(default_factory=lambda: TrainConfig())
    daemon: DaemonConfig = Field(default_factory=lambda: DaemonConfig())

    _secret_paths: set[str] = PrivateAttr(default_factory=set)
    _secret_values: set[str] = PrivateAttr(default_factory=set)
    _origin: str = PrivateAttr(default="<dict>")

    def epoch_options(self) -> EpochOptions:
        """How a run's epochs are ordered and released (``train.seed``,
        ``train.samples_per_epoch``, ``cache.resume_grace_s``) as one `EpochOptions`."""
        return EpochOptions(seed=self.train.seed, samples_per_epoch=self.train.samples_per_epoch,
                            resume_grace_s=self.cache.resume_grace_s)

    def loader_options(self, *, cuda: bool = False) -> LoaderOptions:
        """A run's DataLoaders (section ``loader``, ``train.min_samples``) as one
        `LoaderOptions`; ``cuda``: the run trains on a GPU."""
        loader = self.loader
        # Pinned batches copy to the GPU asynchronously (non_blocking); on the CPU pinning is a
        # copy for nothing. A pin_memory written in the config is what it says.
        pin = loader.pin_memory if "pin_memory" in loader.model_fields_set else cuda
        dataloader: dict[str, Any] = {"pin_memory": pin, "timeout": loader.timeout}
        if loader.prefetch_factor is not None:  # dropped by epochs() without workers
            dataloader["prefetch_factor"] = loader.prefetch_factor
        # num_workers and persistent_workers None leave the choice to epochs() (one default).
        return LoaderOptions(batch_size=loader.batch_size, num_workers=loader.num_workers,
                             persistent_workers=loader.persistent_workers,
                             min_samples=self.train.min_samples, dataloader=dataloader)

    @model_validator(mode="after")
    def _check_sources(self) -> EpochcacheConfig:
        if (self.source is None) == (self.sources is None):
            raise ValueError(
                "give exactly one of source (one source) and sources (a list of sources, each "
                "with a name and a weight), not " + ("both" if self.source else "neither")
            )
        names = [entry.name for entry in self.sources or ()]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"sources: names must be unique, {', '.join(twice)} appear twice")
        return self

    @model_validator(mode="after")
    def _check_relisting(self) -> EpochcacheConfig:
        for entry in self.source_entries():
            if entry.config.listing_ttl_s is not None and self.sampler.strategy == "weighted":
                field = f"sources.{entry.name}" if entry.name else "source"
                raise ValueError(
                    f"{field}.listing_ttl_s: re-listing adds keys without weights, so it cannot "
                    "be used with sampler.strategy: weighted (remove one of them)"
                )
        return self

    def source_entries(self) -> list[SourceEntry]:
        """Every source the daemon samples: ``source`` as one un-namespaced entry, or the
        entries of ``sources``."""
        if self.sources is not None:
            return [SourceEntry(s.name, s, s.weight, s.optional) for s in self.sources]
        return [] if self.source is None else [SourceEntry("", self.source)]

    @property
    def first_source(self) -> SourceConfig:
        """``source``, or the first entry of ``sources`` (the demo data is written there)."""
        return self.source_entries()[0].config

    @property
    def origin(self) -> str:
        """The file the config was read from (``<dict>`` when built from a mapping)."""
        return self._origin

    def redacted(self) -> dict[str, Any]:
        """The resolved config as plain data, with every secret replaced by ``***``."""
        data = self.model_dump(mode="json")
        for name in ("source", "sources"):
            if data[name] is None:
                del data[name]
        for section in [data["source"]] if "source" in data else data["sources"]:
            section["storage_options"] = redact_options(section["storage_options"])
        for path in self._secret_paths:
            set_path(data, path.split("."), REDACTED)
        return redact_tree(data, self._secret_values)  # type: ignore[no-any-return]

    @property
    def secrets(self) -> frozenset[str]:
        """The secret strings this config masks (to scrub them from log lines too)."""
        return frozenset(self._secret_values)

    def to_transfer(self) -> dict[str, Any]:
        """This config as plain data for another process (a sampler), with what must be masked
        there too. It holds the real secrets, like ``model_dump()``: never log it."""
        return {
            "config": self.model_dump(mode="json"),  # JSON-able: it may go through a pipe
            "secret_paths": sorted(self._secret_paths),
            "secret_values": sorted(self._secret_values),
            "origin": self._origin,
        }

    @classmethod
    def from_transfer(cls, data: Mapping[str, Any]) -> EpochcacheConfig:
        """The config `to_transfer` gave, masking what the original masked (a plain
        ``model_dump()`` is accepted too: then what can be found in it is masked)."""
        if "config" not in data:
            data = {"config": data}
        config = cls.model_validate(data["config"])
        config.set_secrets(set(data.get("secret_paths", ())),
                           set(data.get("secret_values", ())) | found_secrets(data["config"]),
                           str(data.get("origin", "<dict>")))
        return config

    def set_secrets(self, paths: set[str], values: set[str], origin: str) -> None:
        """Mask ``values`` (and the settings at ``paths``) in this config and its sources;
        ``origin`` is the file it was read from."""
        self._secret_paths, self._secret_values, self._origin = paths, values, origin
        for entry in self.source_entries():
            entry.config._secret_values = values

    def redacted_yaml(self) -> str:
        """`redacted` as YAML (what ``epochcache config`` prints and runs save)."""
        text: str = yaml.safe_dump(self.redacted(), sort_keys=False)
        return text

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        yield from self.redacted().items()
