"""The ``files`` layout: one remote object per sample, selected by a glob under the root URL."""

from __future__ import annotations

import logging

from ...errors import CorruptSample
from ...limits import cut_text
from ..types import FetchResult, SampleRef
from .base import Source
from .check import check_object

log = logging.getLogger(__name__)


class FilesSource(Source):
    """Objects under ``source.url`` whose path relative to it matches ``source.pattern``.

    The key of a sample is its path relative to the root, so it stays the same when the bucket is
    mounted elsewhere. With ``source.manifest`` the manifest's keys are used instead of a listing.
    """

    unit = "sample"

    def _unpack(self, ref: SampleRef, url: str, data: bytes) -> list[FetchResult]:
        if len(data) > self.max_sample_bytes:  # not listed, or larger than listed
            exc = self.too_large(ref.key, len(data), url, "is more than")
            log.warning("%s", cut_text(f"{url}: {exc}", keys=(ref.key,)))
            return [(ref, exc)]
        try:
            check_object(ref.key, data, size=ref.size, checksum=ref.checksum, checks=self.checks,
                         url=url, max_bytes=self.max_sample_bytes)
        except CorruptSample as exc:
            log.warning("%s", cut_text(f"{url}: corrupt: {exc}", keys=(ref.key,)))
            return [(ref, exc)]
        return [(ref, data)]
