"""Admission rules on plain lists: the queue bound, a request's k cap, joining and merging
micro-batches at block boundaries. (The requests are stand-ins: these only move them.)"""

from types import SimpleNamespace

import pytest

from specray.engine_core.admission import admit, merge_unless_split_pays, queue_full, request_max_k
from specray.engine_core.coordinator import CoordinatorConfig
from specray.errors import InvalidRequestError


def _requests(count: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(name=f"r{i}", batch_index=None) for i in range(count)]


def test_free_slots_count_toward_the_queue_bound():
    """max_queue 4, max_running 8: with 6 running, 6 may wait (4 + 2 free slots)."""
    config = CoordinatorConfig(max_queue=4, max_running=8)
    assert not queue_full(5, 6, config)
    assert queue_full(6, 6, config)
    assert queue_full(4, 8, config) and not queue_full(3, 8, config)


def test_a_requests_k_cap_is_below_the_groups():
    assert request_max_k(None, 8) == 8
    assert request_max_k(3, 8) == 3
    assert request_max_k(12, 8) == 8
    assert request_max_k(0, 8) == 0
    for bad in (-1, 2.0, True):
        with pytest.raises(InvalidRequestError, match="num_speculative_tokens"):
            request_max_k(bad, 8)


def test_admission_balances_the_micro_batches_while_a_split_pays():
    waiting, batches = _requests(5), [[], []]
    first = admit(waiting, batches, 0, max_running=8, split_pays=lambda total: True)
    assert [r.name for r in first] == ["r0", "r1", "r2"] and batches[0] == first
    second = admit(waiting, batches, 1, max_running=8, split_pays=lambda total: True)
    assert [r.name for r in second] == ["r3", "r4"] and not waiting
    assert [r.batch_index for r in first + second] == [0, 0, 0, 1, 1]


def test_without_a_split_the_first_micro_batch_takes_everyone_up_to_max_running():
    waiting, batches = _requests(5), [[], []]
    totals = []

    def no_split(total: int) -> bool:
        totals.append(total)
        return False

    assert admit(waiting, batches, 1, max_running=4, split_pays=no_split) == []
    joined = admit(waiting, batches, 0, max_running=4, split_pays=no_split)
    assert [r.name for r in joined] == ["r0", "r1", "r2", "r3"]
    assert [r.name for r in waiting] == ["r4"] and totals == [4, 4]


def test_a_later_micro_batch_merges_into_the_first_when_the_split_stops_paying():
    batches = [_requests(2), _requests(3)]
    assert not merge_unless_split_pays(batches, 1, total=5, split_pays=lambda total: True)
    assert not merge_unless_split_pays(batches, 0, total=5, split_pays=lambda total: False)
    assert merge_unless_split_pays(batches, 1, total=5, split_pays=lambda total: False)
    assert [len(batch) for batch in batches] == [5, 0]
