"""The ingest layer: sampling a remote dataset into the cache.

``remote`` reaches any fsspec URL with timeouts, retries and error translation; ``sources``
enumerate and fetch a dataset's samples by layout; ``keyorder`` decides which key comes next;
``sampler`` is one sampler process's loop and ``daemon`` supervises them. This layer imports the
store and the base modules (errors, units, redact, config) only, and never torch: sampler
processes stay small and start fast.
"""
