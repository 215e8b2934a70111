"""The data layer: what the training process and its DataLoader workers run.

Decoding by extension (``decode``, images included; ``fields`` for field selection,
``raw`` for the raw ``.npy`` and multi-field fast paths, ``collate``), the
per-epoch map-style dataset (``reader``, ``dataset``), epoch schedules and the ``epochs()``
loader (``schedule``, ``epoch_loader``, ``epochs``), DDP (``distributed``; a process's place
is the base ``epochcache.placement``), the stall watchdog (``stall``) and waiting for the cache
to fill (``wait``). This layer reads the cache through the store layer only; it never imports
``ingest`` or the face.
"""
