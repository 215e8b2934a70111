"""Key order: permutations per pass, node partitions, process split, resumable positions, weights."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epochcache.ingest.keyorder import KeyOrder, Position, node_partition


@settings(max_examples=60, deadline=None)
@given(num_keys=st.integers(1, 300), seed=st.integers(0, 2**32), passes=st.integers(1, 3))
def test_every_key_once_per_pass(num_keys: int, seed: int, passes: int) -> None:
    order = KeyOrder(num_keys, seed=seed)
    taken = order.take(num_keys * passes)
    for p in range(passes):
        chunk = taken[p * num_keys : (p + 1) * num_keys]
        assert sorted(chunk.tolist()) == list(range(num_keys))
    assert order.position == Position(passes, 0) or order.position == Position(passes - 1, num_keys)


def test_new_permutation_each_pass_and_deterministic() -> None:
    a = KeyOrder(1000, seed=7)
    first, second = a.take(1000), a.take(1000)
    assert not np.array_equal(first, second)
    b = KeyOrder(1000, seed=7)
    assert np.array_equal(b.take(2000), np.concatenate([first, second]))
    assert not np.array_equal(KeyOrder(1000, seed=8).take(1000), first)


@settings(max_examples=60, deadline=None)
@given(num_keys=st.integers(1, 500), num_nodes=st.integers(1, 8), seed=st.integers(0, 1000))
def test_node_partitions_disjoint_and_covering(num_keys: int, num_nodes: int, seed: int) -> None:
    parts = [node_partition(num_keys, seed, r, num_nodes) for r in range(num_nodes)]
    merged = np.concatenate(parts)
    assert sorted(merged.tolist()) == list(range(num_keys))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


def test_nodes_stay_in_their_partition_across_passes() -> None:
    orders = [KeyOrder(101, seed=3, node_rank=r, num_nodes=3) for r in range(3)]
    seen = [set(o.take(len(o.node_keys) * 3).tolist()) for o in orders]
    assert (
        seen[0].isdisjoint(seen[1]) and seen[1].isdisjoint(seen[2]) and seen[0].isdisjoint(seen[2])
    )
    assert set().union(*seen) == set(range(101))


@settings(max_examples=40, deadline=None)
@given(num_keys=st.integers(4, 200), processes=st.integers(1, 4), batch=st.integers(1, 17))
def test_processes_fetch_disjoint_keys_and_cover_the_pass(
    num_keys: int, processes: int, batch: int
) -> None:
    taken: list[list[int]] = []
    for p in range(processes):
        order = KeyOrder(num_keys, seed=1, process_index=p, num_processes=processes)
        share = len(range(p, num_keys, processes))  # offsets p, p + P, ... of pass 0
        mine: list[int] = []
        while len(mine) < share:
            mine.extend(order.take(min(batch, share - len(mine))).tolist())
        assert order.position.pass_index == 0 or order.position.offset >= num_keys
        taken.append(mine)
    merged = [k for mine in taken for k in mine]
    assert sorted(merged) == list(range(num_keys))  # disjoint (no duplicates) and covering


@settings(max_examples=60, deadline=None)
@given(
    num_keys=st.integers(1, 200),
    first=st.integers(0, 500),
    rest=st.integers(0, 500),
    strategy=st.sampled_from(["uniform", "weighted"]),
)
def test_position_save_restore_continues_exactly(
    num_keys: int, first: int, rest: int, strategy: str
) -> None:
    weights = np.linspace(0.0, 1.0, num_keys) + 0.1 if strategy == "weighted" else None
    kwargs = {
        "seed": 5,
        "strategy": strategy,
        "weights": weights,
        "process_index": 1 if num_keys > 1 else 0,
        "num_processes": 2 if num_keys > 1 else 1,
    }
    uninterrupted = KeyOrder(num_keys, **kwargs)  # type: ignore[arg-type]
    expected = uninterrupted.take(first + rest)
    before = KeyOrder(num_keys, **kwargs)  # type: ignore[arg-type]
    head = before.take(first)
    saved = json.loads(json.dumps(before.state()))
    after = KeyOrder(num_keys, position=saved, **kwargs)  # type: ignore[arg-type]
    tail = after.take(rest)
    assert np.array_equal(np.concatenate([head, tail]), expected)


def test_weighted_respects_zero_weights_and_proportions() -> None:
    weights = np.array([0.0, 1.0, 3.0, 0.0])
    order = KeyOrder(4, strategy="weighted", weights=weights, seed=0)
    draws = order.take(8000)
    counts = np.bincount(draws, minlength=4)
    assert counts[0] == 0 and counts[3] == 0
    assert 2.6 < counts[2] / counts[1] < 3.4


def test_invalid_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="weights"):
        KeyOrder(3, strategy="weighted")
    with pytest.raises(ValueError, match="weight 0"):
        KeyOrder(3, strategy="weighted", weights=[0, 0, 0])
    with pytest.raises(ValueError, match="finite"):
        KeyOrder(2, strategy="weighted", weights=[1, float("nan")])
    with pytest.raises(ValueError, match="node_rank"):
        KeyOrder(10, node_rank=2, num_nodes=2)
    with pytest.raises(ValueError, match="num_keys"):
        KeyOrder(0)
    with pytest.raises(ValueError, match="position"):
        Position.from_dict({"pass": 1})


def test_index_is_compact() -> None:
    order = KeyOrder(1_000_000, seed=1, num_nodes=2)
    assert order.node_keys.dtype == np.int32
    assert order.pass_order(0).nbytes <= 4 * 500_000


@pytest.mark.parametrize("processes", [2, 3])
def test_a_process_ahead_by_a_pass_never_takes_another_process_keys(processes: int) -> None:
    """Processes run at different speeds: one in pass 1 while another is still in pass 0 must not
    take keys the other has yet to fetch (the daemon fetched them twice)."""
    orders = [KeyOrder(101, seed=2, process_index=p, num_processes=processes) for p in range(processes)]
    shares = [set(o.pass_order(0)[p::processes].tolist()) for p, o in enumerate(orders)]
    for p, order in enumerate(orders):
        for pass_index in (1, 2, 7):
            this_pass = order.pass_order(pass_index)
            assert set(this_pass[p::processes].tolist()) == shares[p]
            assert sorted(this_pass.tolist()) == list(range(101))
    assert not np.array_equal(orders[0].pass_order(1), orders[0].pass_order(2))


# -- keys added by a re-list (source.listing_ttl_s) ----------------------------------------------


def _grown(num_keys: int, added: int) -> tuple[np.ndarray, np.ndarray]:
    from epochcache.ingest.keyorder import key_hashes

    indices = np.arange(num_keys, num_keys + added)
    return indices, key_hashes(f"new-{i}" for i in indices)


@settings(max_examples=30, deadline=None)
@given(num_keys=st.integers(9, 120), added=st.integers(1, 80), nodes=st.integers(1, 3),
       processes=st.integers(1, 3), seed=st.integers(0, 1000))
def test_added_keys_are_split_disjointly_and_taken_once_per_pass(
    num_keys: int, added: int, nodes: int, processes: int, seed: int
) -> None:
    indices, hashes = _grown(num_keys, added)
    per_pass: list[list[int]] = [[], []]
    for node in range(nodes):
        for p in range(processes):
            order = KeyOrder(num_keys, seed=seed, node_rank=node, num_nodes=nodes,
                             process_index=p, num_processes=processes)
            order.add_block(indices, hashes)
            share = len(order.node_keys[p::processes]) + order.num_added
            for pass_taken in per_pass:
                pass_taken.extend(order.take(share).tolist())
    for pass_taken in per_pass:
        # Every added key is taken exactly once per pass, by exactly one node and process.
        assert sorted(k for k in pass_taken if k >= num_keys) == indices.tolist()


def test_a_block_added_mid_pass_joins_that_pass_and_keeps_what_was_taken() -> None:
    order = KeyOrder(100, seed=1)
    first = order.take(60).tolist()
    indices, hashes = _grown(100, 30)
    assert order.add_block(indices, hashes) == 30
    rest = order.take(70).tolist()  # the rest of pass 0: 40 original keys, then the 30 new ones
    assert sorted(first + rest) == list(range(130))
    assert order.position == Position(0, 100, 30)
    nxt = order.take(130).tolist()  # pass 1 takes every key again, in a new order
    assert sorted(nxt) == list(range(130)) and nxt != first + rest
    # Added mid-pass (after some added keys were taken): the new block follows them.
    more_indices, more_hashes = _grown(130, 10)
    order.add_block(more_indices, more_hashes)
    assert sorted(order.take(140).tolist()) == list(range(140))


def test_position_with_added_keys_resumes_exactly() -> None:
    indices, hashes = _grown(50, 20)
    a = KeyOrder(50, seed=4, process_index=1, num_processes=2)
    a.add_block(indices, hashes)
    head = a.take(33).tolist()
    saved = json.loads(json.dumps(a.state()))
    assert saved["extra"] > 0
    b = KeyOrder(50, seed=4, process_index=1, num_processes=2, position=saved)
    b.add_block(indices, hashes)
    assert b.take(40).tolist() == a.take(40).tolist()
    assert head  # (the first 33 are not taken again by the resumed order)
    old = KeyOrder(50, seed=4, position={"pass_index": 1, "offset": 3})  # saved before "extra"
    assert old.position == Position(1, 3, 0)


def test_weighted_order_takes_no_added_keys() -> None:
    order = KeyOrder(10, strategy="weighted", weights=[1.0] * 10)
    with pytest.raises(ValueError, match="uniform"):
        order.add_block(*_grown(10, 3))
