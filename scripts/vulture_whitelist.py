"""Names vulture reports as unused that are used, each with why (scripts/check "dead code").

vulture reads this file and never runs it: naming a name here counts as a use. It checks
epochcache/ alone, so a name only tests or users call is listed with who calls it; code
nothing calls is deleted instead. Pydantic validators are skipped by
``--ignore-decorators`` in scripts/check. Add a line only with its reason.
"""

from logging import LogRecord

from rich.table import Table

from epochcache import __getattr__ as _lazy_attributes
from epochcache.augment import RandomResizedCrop
from epochcache.cache import Cache
from epochcache.config.schema import _Section
from epochcache.daemon import serve
from epochcache.data.dataset import EpochDataset
from epochcache.data.stream import CacheStream
from epochcache.examples import train_epoch, train_image_classifier
from epochcache.ingest.bodies import RawReader
from epochcache.ingest.committer import Committer
from epochcache.ingest.concurrency import AutoConcurrency
from epochcache.ingest.layouts.base import Source
from epochcache.ingest.layouts.files import FilesSource
from epochcache.ingest.layouts.parquet import ParquetSource, _Spans
from epochcache.ingest.layouts.tar import TarSource
from epochcache.ingest.sampler import SamplerHealth
from epochcache.ingest.types import SampleRef
from epochcache.store.eviction import OldestFirst
from epochcache.store.least_recently_read import LeastRecentlyRead
from epochcache.store.origins import Origin
from epochcache.store.reads import Releaser
from epochcache.store.records import RecordFlags, RecordInfo

# Python calls these: a module's lazy attributes (PEP 562), an io.RawIOBase's methods
# (io.BufferedReader and tarfile call readable/readinto), a logging record's message.
_lazy_attributes
RawReader.readable
RawReader.readinto
_Spans.seekable  # pyarrow asks the file object it reads a row group from
LogRecord.msg  # redact.py: the redacting filter rewrites a record's message in place
Table.caption  # status.py: rich prints it under the coverage table
serve  # the daemon process's entry point: Daemon.start runs it as a `python -c` line

# Pydantic reads a model's configuration from this class attribute.
_Section.model_config

# Layouts and eviction policies are named by a "module:Class" string in epochcache/registry.py,
# imported when used.
FilesSource
TarSource
ParquetSource
OldestFirst
LeastRecentlyRead

# Entrypoints named by configs (``run.entrypoint: epochcache.examples:train_image_classifier``
# in configs/*.yaml and the docs), called by `epochcache run`.
train_epoch
train_image_classifier

# Public API for users, documented (docs/reference/python.md) and tested.
RandomResizedCrop  # tests/test_augment.py; docs/howto/decoding.md
Cache.copy_to  # `epochcache copy` in Python: tests/test_copy.py; docs/howto/copy.md
EpochDataset.get_batch  # a map-style dataset's batched read: tests/test_decode.py
CacheStream.set_epoch  # torch's DistributedSampler protocol, called by training loops
Source.list_keys  # the layout contract's convenience: tests/sources/contract.py
SampleRef.to_row  # the pair of SampleRef.from_row (a saved listing's row)

# Fields of documents and records: written whole (the sampler's health document, which
# `epochcache status --json` shows), read by position or by users through `Cache.info()`.
SamplerHealth.fetched_bytes
SamplerHealth.deferred
SamplerHealth.last_failed
SamplerHealth.waiting_for_space
RecordInfo.stored_size
Origin.ref_index
RecordFlags.NONE  # the zero of an IntFlag: a record without flags

# Observed by tests (the count is the behaviour the test checks).
Committer.grouped  # tests/test_sampler.py: batches that rode in one transaction
AutoConcurrency.decreases  # tests/test_concurrency.py: the limit lowered by throttled answers

# Held, never read: keeps the plan part's mapping alive while its position word (a view
# into it) is written.
Releaser._part
