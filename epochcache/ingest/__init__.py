"""The ingest layer: sampling a remote dataset into the cache.

``remote`` reaches any fsspec URL with timeouts, retries and error translation; ``layouts``
enumerate and fetch a dataset's samples by layout; ``keyorder`` decides which key comes next;
``sampler`` is one sampler process's loop and ``supervisor`` supervises them. This layer imports
the layers below it (store, coverage) and the base modules (errors, units, limits, redact,
config, ...) only, and never torch: sampler processes stay small and start fast.
"""
