"""The data layer: what the training process and its DataLoader workers run (its modules are
listed in docs/contributing.md's layer map). It reads the cache through the store layer only;
it never imports ``ingest``, the config or the face.
"""
