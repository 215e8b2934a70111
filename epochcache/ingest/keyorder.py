"""Which key to fetch next: seeded, resumable, partitioned by node and by sampler process.

Pure logic over key *indices* (positions in the sorted listing), held in numpy arrays so that a
listing of millions of keys costs a few bytes per key:

1. **Node partition.** A global permutation seeded by ``seed`` alone (the same on every node, and
   the same every pass) is dealt round-robin: node ``r`` of ``n`` owns the keys at positions
   ``r, r + n, ...`` of it. Partitions are disjoint, cover every key, and differ in size by at most one.
2. **Pass order.** Each pass over the node's keys is a fresh permutation seeded by
   ``(seed, pass_index, node_rank)``: uniform without replacement, so the cache covers the node's
   share before any key repeats. With ``strategy="weighted"`` a pass is instead ``len(node keys)``
   draws with replacement, probability proportional to the weights (zero weight: never drawn).
3. **Process split.** Sampler process ``p`` of ``P`` takes offsets ``p, p + P, ...`` of each pass,
   so processes fetch disjoint keys without talking to each other. With ``uniform`` the keys at a
   process's offsets are the same in every pass (those of pass 0, reshuffled): processes run at
   different speeds, and a process already in pass k+1 must not take a key that another process
   has yet to fetch in pass k (it would be fetched twice).
4. **Position.** ``(pass_index, offset, extra)`` is the next offset this process will take (and
   how many added keys it took in this pass); it is a small JSON-able dict, saved in the cache
   and restored after a restart so the daemon continues its permutation instead of refetching
   the first keys.
5. **Added keys.** Keys a re-list found later (`KeyOrder.add_block`, uniform only) are
   owned by a hash of the key, not by their index: ``h % num_nodes`` picks the node and
   ``h // num_nodes % num_processes`` the process, so nodes that re-listed at different times
   still agree. A process takes its added keys after its share of the original keys, in every
   pass, block after block, each block in a fresh order per pass; a block added mid-pass joins
   the current pass at its end, so nothing already taken moves.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

_NODE_TAG = 0x4E4F4445  # "NODE": keeps the partition stream apart from the pass streams
_PASS_TAG = 0x50415353  # "PASS"
_BLOCK_TAG = 0x424C4B53  # "BLKS"


@dataclass(frozen=True)
class Position:
    """Where a process is in the key order: the next ``offset`` of pass ``pass_index``."""

    pass_index: int = 0
    offset: int = 0
    extra: int = 0

    def to_dict(self) -> dict[str, int]:
        """JSON-able form."""
        return {"pass_index": self.pass_index, "offset": self.offset, "extra": self.extra}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Position:
        """Inverse of `to_dict`.

        Raises:
            ValueError: the dict is not a saved position.
        """
        try:
            pass_index, offset = int(data["pass_index"]), int(data["offset"])
            extra = int(data.get("extra", 0))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(
                f"sampler position: expected pass_index and offset, got {data!r}"
            ) from exc
        if pass_index < 0 or offset < 0 or extra < 0:
            raise ValueError(f"sampler position: must not be negative, got {data!r}")
        return cls(pass_index, offset, extra)


def node_partition(num_keys: int, seed: int, node_rank: int, num_nodes: int) -> np.ndarray:
    """The key indices node ``node_rank`` owns, in the global shuffled order (see module doc)."""
    if num_nodes < 1 or not 0 <= node_rank < num_nodes:
        raise ValueError(f"node_rank {node_rank} must be in [0, num_nodes={num_nodes})")
    dtype = np.int32 if num_keys < 2**31 else np.int64
    if num_nodes == 1:
        return np.arange(num_keys, dtype=dtype)
    rng = np.random.default_rng([_NODE_TAG, seed])
    order = rng.permutation(num_keys).astype(dtype, copy=False)
    return order[node_rank::num_nodes].copy()


def key_hashes(keys: Iterable[str]) -> np.ndarray:
    """A stable 64-bit hash of each key (the owner of an added key is chosen by it)."""
    return np.array(
        [int.from_bytes(hashlib.blake2b(k.encode("utf-8"), digest_size=8).digest(), "big")
         for k in keys],
        dtype=np.uint64,
    )


def node_partition_pass0(node_keys: np.ndarray, seed: int, node_rank: int) -> np.ndarray:
    """The fetch order of pass 0 (uniform strategy): the one that fixes each process's share."""
    rng = np.random.default_rng([_PASS_TAG, seed, 0, node_rank])
    # permutation(array) makes the same swaps as permutation(len): the same order, without an
    # int64 index array of 8 bytes a key
    shuffled: np.ndarray = rng.permutation(node_keys)
    return shuffled


class KeyOrder:
    """The sequence of key indices one sampler process fetches, across passes.

    Args:
        num_keys: keys in the listing (indices are ``0 .. num_keys - 1``).
        seed: non-negative; the same seed gives the same partition and orders.
        node_rank: this node, ``0 .. num_nodes - 1``.
        num_nodes: nodes sharing the dataset.
        strategy: ``uniform`` (without replacement per pass) or ``weighted`` (with replacement).
        weights: one non-negative weight per key, required for ``weighted``; NaN is not allowed.
        process_index: this sampler process, ``0 .. num_processes - 1``.
        num_processes: sampler processes on this node.
        position: where to resume; defaults to the start of pass 0.

    Raises:
        ValueError: an argument is out of range, or this node/process would get no keys.
    """

    def __init__(
        self,
        num_keys: int,
        *,
        seed: int = 0,
        node_rank: int = 0,
        num_nodes: int = 1,
        strategy: Literal["uniform", "weighted"] = "uniform",
        weights: Sequence[float] | np.ndarray | None = None,
        process_index: int = 0,
        num_processes: int = 1,
        position: Position | dict[str, Any] | None = None,
    ) -> None:
        if num_keys < 1:
            raise ValueError(f"num_keys: need at least one key, got {num_keys}")
        if seed < 0:
            raise ValueError(f"seed: must be >= 0, got {seed}")
        if num_processes < 1 or not 0 <= process_index < num_processes:
            raise ValueError(f"process_index {process_index} must be in [0, {num_processes})")
        if strategy not in ("uniform", "weighted"):
            raise ValueError(f"strategy: expected 'uniform' or 'weighted', got {strategy!r}")
        self.num_keys, self.seed, self.strategy = num_keys, seed, strategy
        self.node_rank, self.num_nodes = node_rank, num_nodes
        self.process_index, self.num_processes = process_index, num_processes
        self.node_keys = node_partition(num_keys, seed, node_rank, num_nodes)
        if len(self.node_keys) <= process_index:
            raise ValueError(
                f"node {node_rank}: {len(self.node_keys)} keys cannot feed process {process_index} "
                f"({num_keys} keys over {num_nodes} nodes and {num_processes} processes)"
            )
        self._probabilities: np.ndarray | None = None
        if strategy == "weighted":
            self._probabilities = self._node_probabilities(weights)
        elif weights is not None and len(weights) != num_keys:
            raise ValueError(f"weights: expected {num_keys} values, got {len(weights)}")
        if isinstance(position, dict):
            position = Position.from_dict(position)
        self._position = position or Position(0, process_index)
        if self._position.offset % num_processes != process_index:
            # Saved by a different process count: realign to this process's stride in the same pass.
            offset = self._position.offset
            offset += (process_index - offset) % num_processes
            self._position = Position(self._position.pass_index, offset, self._position.extra)
        self._cached_pass: int | None = None
        self._cached_order = np.empty(0, dtype=self.node_keys.dtype)
        # Added keys this process owns, one array per block, and their order in one pass.
        self._blocks: list[np.ndarray] = []
        self._extras_pass: int | None = None
        self._extras_order = np.empty(0, dtype=np.int64)

    def _node_probabilities(self, weights: Sequence[float] | np.ndarray | None) -> np.ndarray:
        if weights is None:
            raise ValueError(
                "weights: the weighted strategy needs one weight per key (a manifest column)"
            )
        w = np.asarray(weights, dtype=np.float64)
        if w.shape != (self.num_keys,):
            raise ValueError(f"weights: expected {self.num_keys} values, got shape {w.shape}")
        if not np.all(np.isfinite(w)) or np.any(w < 0):
            raise ValueError("weights: every weight must be finite and >= 0")
        node_w = w[self.node_keys]
        total = node_w.sum()
        if total <= 0:
            raise ValueError(f"weights: every key of node {self.node_rank} has weight 0")
        probabilities: np.ndarray = node_w / total
        return probabilities

    # ---------------------------------------------------------------------------------- orders

    @property
    def pass_length(self) -> int:
        """Offsets in one pass (the node's key count)."""
        return len(self.node_keys)

    def pass_order(self, pass_index: int) -> np.ndarray:
        """All key indices of pass ``pass_index`` for this node, in fetch order (all processes)."""
        if pass_index == self._cached_pass:
            return self._cached_order
        rng = np.random.default_rng([_PASS_TAG, self.seed, pass_index, self.node_rank])
        if self._probabilities is None:
            order = rng.permutation(self.node_keys)  # == node_keys[permutation(len)], in place
            if pass_index > 0 and self.num_processes > 1:
                # Each process keeps the keys it had in pass 0 (in a fresh order every pass).
                # Were the split redrawn per pass, a process entering pass k+1 while another is
                # still in pass k would fetch keys the other has not reached yet: both fetch them.
                first = node_partition_pass0(self.node_keys, self.seed, self.node_rank)
                step = self.num_processes
                for p in range(step):
                    order[p::step] = rng.permutation(first[p::step])
        else:
            picks = rng.choice(len(self.node_keys), size=len(self.node_keys), p=self._probabilities)
            order = self.node_keys[picks]
        self._cached_pass, self._cached_order = pass_index, order
        return order

    @property
    def position(self) -> Position:
        """The next position this process will take."""
        return self._position

    def state(self) -> dict[str, int]:
        """JSON-able position to persist (pass it back as ``position`` to resume)."""
        return self._position.to_dict()

    def take(self, count: int) -> np.ndarray:
        """The next ``count`` key indices of this process (crossing into new passes as needed)."""
        if count < 0:
            raise ValueError(f"count: must be >= 0, got {count}")
        chunks: list[np.ndarray] = []
        needed = count
        pass_index, offset = self._position.pass_index, self._position.offset
        extra = self._position.extra
        step = self.num_processes
        while needed > 0:
            if offset < self.pass_length:
                order = self.pass_order(pass_index)
                chunk = order[offset : offset + needed * step : step]
                offset += len(chunk) * step
            elif extra < self.num_added:
                chunk = self._extras(pass_index)[extra : extra + needed]
                extra += len(chunk)
            else:
                pass_index, offset, extra = pass_index + 1, self.process_index, 0
                continue
            chunks.append(chunk)
            needed -= len(chunk)
        self._position = Position(pass_index, offset, extra)
        if not chunks:
            return np.empty(0, dtype=np.int64)
        return np.concatenate([c.astype(np.int64, copy=False) for c in chunks])

    # ------------------------------------------------------------------------------ added keys

    @property
    def num_added(self) -> int:
        """Added keys this process takes in every pass (after its share of the original ones)."""
        return sum(len(block) for block in self._blocks)

    def add_block(self, indices: np.ndarray | Sequence[int], hashes: np.ndarray) -> int:
        """Add keys a re-list found (their listing indices, and `key_hashes` of their
        keys); keep those this node and process own. Returns how many it kept.

        Raises:
            ValueError: the weighted strategy (its weights come from a fixed manifest), or
                ``indices`` and ``hashes`` differ in length.
        """
        if self.strategy != "uniform":
            raise ValueError("added keys: only the uniform strategy takes keys added by a re-list")
        indices = np.asarray(indices, dtype=np.int64)
        hashes = np.asarray(hashes, dtype=np.uint64)
        if indices.shape != hashes.shape:
            raise ValueError(f"add_block: {len(indices)} indices but {len(hashes)} hashes")
        nodes = np.uint64(self.num_nodes)
        mine = (hashes % nodes == self.node_rank) & (
            (hashes // nodes) % np.uint64(self.num_processes) == self.process_index)
        block = indices[mine]
        self._blocks.append(block)
        if self._extras_pass is not None:
            # The pass under way takes the new block after what it already had.
            self._extras_order = np.concatenate(
                [self._extras_order, self._block_order(self._extras_pass, len(self._blocks) - 1)])
        return len(block)

    def _block_order(self, pass_index: int, b: int) -> np.ndarray:
        rng = np.random.default_rng(
            [_BLOCK_TAG, self.seed, pass_index, self.node_rank, self.process_index, b])
        block = self._blocks[b]
        return block[rng.permutation(len(block))]

    def _extras(self, pass_index: int) -> np.ndarray:
        if pass_index != self._extras_pass:
            parts = [self._block_order(pass_index, b) for b in range(len(self._blocks))]
            self._extras_order = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
            self._extras_pass = pass_index
        return self._extras_order

    def __repr__(self) -> str:
        return (
            f"KeyOrder(num_keys={self.num_keys}, node={self.node_rank}/{self.num_nodes}, "
            f"process={self.process_index}/{self.num_processes}, strategy={self.strategy!r}, "
            f"position={self._position})"
        )
