"""What training saw of each source: the coverage layer.

Per listed key, how many epochs trained on it (the per-source ``ledger``), what a checkpoint
covers, counted once it is written (``staged``), what an epoch trained, in order (the epoch
``manifests``, and ``trained``, which writes both as a run goes), and the report `status`,
`Cache.coverage` and the plot show (``report``). Above the store, below ``ingest``, ``data``,
``run`` and the face: it imports the store and base modules only, never fsspec or torch.
"""
