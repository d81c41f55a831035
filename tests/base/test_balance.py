"""Work spread over processes by bytes (``_base/balance.py``)."""

from __future__ import annotations

from modelshard._base import LeastLoaded, assign


def test_pieces_go_largest_first_to_the_least_loaded_process():
    assert assign([10, 40, 30, 20], 2) == [0, 0, 1, 1]  # 40+10 | 30+20
    assert assign([5, 5, 5], 1) == [0, 0, 0]
    assert sorted(assign([1] * 7, 3)) == [0, 0, 0, 1, 1, 2, 2]


def test_a_piece_goes_to_the_least_loaded_of_those_that_can_take_it():
    greedy = LeastLoaded(3)
    assert [greedy.pick(8, [1, 2]), greedy.pick(4, [1, 2]), greedy.pick(1)] == [1, 2, 0]
    assert greedy.load == [1, 8, 4]
