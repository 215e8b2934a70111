"""How the rest of an interrupted epoch is dealt to the ranks that resume it (issue 28, item 1):
the lanes of any chain of resumes on any layouts cover the epoch once, and every rank reads
the same number of batches, none empty (epochcache.data.resume)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epochcache.data.resume import Deal, deal, rank_lane
from epochcache.data.states import check_groups, group_states, parse_states
from epochcache.placement import Placement

WANTED = {"seed": 0, "shuffle": True, "samples_per_epoch": None}


def _state(rank: int, size: int, lane: int, position: int,
           resumed: dict[str, Any] | None = None, lease: str = "ab" * 16) -> dict[str, Any]:
    state = {"kind": "epochcache.epochs", "version": 1, "epoch": 3, "lease": lease,
             "position": position, "lane": lane, "batches": 0, **WANTED,
             "local_rank": rank, "local_world_size": size}
    if resumed is not None:
        state["resumed"] = resumed
    return state


def _world(rank: int, size: int) -> Placement:
    return Placement(rank=rank, world_size=size, local_rank=rank, local_world_size=size)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 120), layouts=st.lists(st.integers(1, 5), min_size=2, max_size=4),
       data=st.data())
def test_a_chain_of_resumes_on_any_layouts_reads_the_epoch_once(
        n: int, layouts: list[int], data: st.DataObject) -> None:
    order = np.arange(1000, 1000 + n, dtype=np.uint64)  # the node's epoch order
    # The epoch as planned on the first layout: lane r is order[r::W] (none cut here).
    size = layouts[0]
    lanes = [order[r::size] for r in range(size)]
    read: list[int] = []
    states = []
    for rank, lane in enumerate(lanes):
        position = data.draw(st.integers(0, len(lane)))
        read.extend(int(v) for v in lane[:position])
        states.append(_state(rank, size, len(lane), position))
    # Interrupted; resumed on each next layout, interrupted again anywhere, ...
    for size in layouts[1:]:
        (group,) = group_states(states)
        states = []
        for rank in range(size):
            mine = rank_lane(order, group, _world(rank, size))
            assert mine.position <= len(mine.lane)
            position = data.draw(st.integers(mine.position, len(mine.lane)))
            read.extend(int(v) for v in mine.lane[mine.position : position])
            states.append(_state(rank, size, len(mine.lane), position, mine.resumed))
    # ... and the last one read to its end: every sample once, none twice, none skipped.
    (group,) = group_states(states)
    for rank in range(layouts[-1]):
        mine = rank_lane(order, group, _world(rank, layouts[-1]))
        read.extend(int(v) for v in mine.lane[mine.position :])
    assert sorted(read) == order.tolist()


def test_the_same_layout_continues_each_rank_on_its_own_lane() -> None:
    order = np.arange(100, dtype=np.uint64)
    (group,) = group_states([_state(0, 2, 50, 20), _state(1, 2, 50, 20)])
    for rank in (0, 1):
        mine = rank_lane(order, group, _world(rank, 2))
        assert not mine.regrouped and mine.resumed is None
        assert mine.lane.tolist() == order[rank::2].tolist() and mine.position == 20


def test_two_ranks_to_one_reads_both_rests_in_rank_order() -> None:
    order = np.arange(100, dtype=np.uint64)
    (group,) = group_states([_state(0, 2, 50, 20), _state(1, 2, 50, 30)])
    mine = rank_lane(order, group, _world(0, 1))
    assert mine.regrouped and mine.position == 0
    assert mine.lane.tolist() == order[0::2][20:].tolist() + order[1::2][30:].tolist()
    assert mine.resumed == {"local_world_size": 2, "lanes": [50, 50], "positions": [20, 30],
                            "resumed": None}


@pytest.mark.parametrize(("counts", "resumed", "drop_last", "batches"), [
    ([45, 45], [False, False], False, 5),  # an ordinary epoch: the MIN, as always
    ([45, 90], [False, False], False, 5),
    ([40, 25], [True, True], False, 4),  # resumed: the MAX, the smaller rank spreads
    ([40, 3], [True, True], False, 1),  # 3 samples cannot fill 4 batches: the MIN
    ([40, 500], [True, False], False, 4),  # a fresh rank (a new node) reads 4 batches too
    ([45, 25], [True, True], True, 2),  # drop_last: whole batches only, the MIN
    ([40, 0], [True, True], False, 0),  # a rank without samples: no batches at all
])
def test_every_rank_reads_the_same_number_of_batches(counts: list[int], resumed: list[bool],
                                                     drop_last: bool, batches: int) -> None:
    agreed = deal(counts, resumed, 10, drop_last)
    assert agreed.batches == batches
    for count in counts:
        bounds = agreed.bounds(count)
        sizes = np.diff(bounds)
        assert len(sizes) == batches
        assert all(1 <= s <= 10 for s in sizes)  # never empty, never over batch_size
        assert bounds[-1] == agreed.take(count) == min(count, batches * 10)
        if drop_last:
            assert all(s == 10 for s in sizes)


def test_a_rank_with_fewer_samples_spreads_them_evenly() -> None:
    assert np.diff(Deal(4, 10, False).bounds(25)).tolist() == [7, 6, 6, 6]
    # enough for the batches: whole ones, the last one short (as an epoch's always is)
    assert np.diff(Deal(4, 10, False).bounds(35)).tolist() == [10, 10, 10, 5]


def test_states_are_accepted_alone_in_a_list_or_by_rank_and_checked() -> None:
    states = [_state(0, 2, 50, 20), _state(1, 2, 50, 20)]
    for given_ in (states, {"0": states[0], "1": states[1]}):
        (group,) = group_states(parse_states(given_))
        assert group.complete
        check_groups([group], WANTED, _world(0, 3))  # any layout: the rest is dealt anew
    alone = group_states(parse_states(states[1]))
    check_groups(alone, WANTED, _world(1, 2))  # its own rank, the same layout: as always
    with pytest.raises(ValueError, match="pass every rank's state"):
        check_groups(alone, WANTED, _world(0, 1))
    with pytest.raises(ValueError, match=r"lack local ranks \[1\]"):
        check_groups(group_states([states[0], _state(0, 2, 50, 9, lease="cd" * 16)]),
                     WANTED, _world(0, 1))
    with pytest.raises(ValueError, match="seed"):
        check_groups(group_states(states), {**WANTED, "seed": 1}, _world(0, 2))
    with pytest.raises(ValueError, match="EpochLoader.state_dict"):
        parse_states([{"kind": "something else"}])
    with pytest.raises(ValueError, match="different epochs"):
        parse_states([states[0], {**states[1], "epoch": 4}])
