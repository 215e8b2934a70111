"""The listings a cache's samples were picked from, by a small id (what origin rows name).

A sampler registers the listing it samples (its source's fingerprint and identity, which a run
compares its sources with: `epochcache.ingest.lineage`, and the listing's
*generation*: indices into a listing keep their meaning only within one generation, see
``ingest/listing.py``) before it commits a sample picked from it, and gets back a
listing id (a ``u16``). Each registration also records what coverage needs to know about the
listing as it stands: the source's name and URL, its layout's unit (``sample`` or ``shard``),
how many refs it holds and how many of them the last re-list did not find (``gone``), and the
node's share (``node_rank`` of ``num_nodes``: each node's daemon samples its own partition).
A listing that grows (a re-list, a listing under way) keeps its id; the document is updated.

The registry is one JSON document in ``meta`` (a handful of entries: one per source and
generation), written in a write transaction, so concurrent samplers agree on ids.
"""

from __future__ import annotations

import json
import time
from typing import Any

import lmdb

from .env import Env
from .origins import UNKNOWN
from .records import DB_META

#: ``meta`` key of the registry.
M_LISTINGS = b"coverage_listings"
#: Fields of a registration (what the sampler knows about its listing).
FIELDS = ("source", "fingerprint", "generation", "url", "unit", "listed", "gone", "complete",
          "node_rank", "num_nodes", "identity")


def _load(txn: lmdb.Transaction, meta: lmdb._Database) -> dict[str, Any]:
    raw = txn.get(M_LISTINGS, db=meta)
    doc: dict[str, Any] = {"next": 0, "listings": {}} if raw is None else json.loads(bytes(raw))
    return doc


def register_listing(env: Env, info: dict[str, Any]) -> int:
    """The id of the listing ``info`` describes (its fingerprint and generation), registered
    now if it is new; its document is brought up to date either way.

    Raises:
        ValueError: the registry is full (65,535 listings; not expected in a cache's life).
    """
    meta = env.dbs[DB_META]

    def run(txn: lmdb.Transaction) -> int:
        doc = _load(txn, meta)
        listings: dict[str, dict[str, Any]] = doc["listings"]
        lid = next((int(k) for k, v in listings.items()
                    if v.get("fingerprint") == info["fingerprint"]
                    and v.get("generation") == info["generation"]), None)
        entry = {name: info.get(name) for name in FIELDS}
        if lid is None:
            lid = int(doc["next"])
            if lid >= UNKNOWN:
                raise ValueError(f"{env.path}: the cache has registered {lid} listings; "
                                 "no id is left for another")
            doc["next"] = lid + 1
            entry["registered"] = time.time()
        else:
            old = listings[str(lid)]
            if all(old.get(name) == entry[name] for name in FIELDS):
                return lid  # unchanged: nothing to write
            entry["registered"] = old.get("registered", time.time())
        entry["updated"] = time.time()
        listings[str(lid)] = entry
        txn.put(M_LISTINGS, json.dumps(doc, separators=(",", ":")).encode(), db=meta)
        return lid

    return env.write(run)


def listings(env: Env) -> dict[int, dict[str, Any]]:
    """Every registered listing, by id."""
    with env.read() as txn:
        doc = _load(txn, env.dbs[DB_META])
    return {int(k): v for k, v in doc["listings"].items()}
