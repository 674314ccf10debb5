"""Belady's MIN on expert traces: hand-checked traces, an exhaustive optimum on small ones, and the
ledger's oracle against what a real torch-engine run moved."""

from __future__ import annotations

import itertools
import random
from collections import OrderedDict
from functools import lru_cache

import pytest

from draftexpert.runtime.oracle import belady_loads


def keys(seq):
    """One expert per request: the textbook paging problem."""
    return [((0, x),) for x in seq]


def optimum(groups, capacity, initial=()):
    """The fewest loads over every choice of what to keep (exhaustive; tiny traces only)."""
    groups = [frozenset(g) for g in groups]
    capacity = max(capacity, *(len(g) for g in groups))

    @lru_cache(maxsize=None)
    def best(i, held):
        if i == len(groups):
            return 0
        g = groups[i]
        extra = held - g
        room = capacity - len(g)
        keeps = itertools.combinations(sorted(extra), min(room, len(extra)))
        return len(g - held) + min(best(i + 1, g | frozenset(k)) for k in keeps)

    init = sorted(set(initial))
    return min(best(0, frozenset(c)) for c in itertools.combinations(init, min(capacity, len(init))))


def lru_loads(groups, capacity):
    """The store's policy: a group takes what is cached, then loads the rest (LRU out)."""
    cache, loads = OrderedDict(), 0
    for g in groups:
        for k in g:
            if k in cache:
                cache.move_to_end(k)
        for k in g:
            if k not in cache:
                loads += 1
                cache[k] = None
                while len(cache) > max(capacity, len(g)):
                    cache.popitem(last=False)
    return loads


def test_the_textbook_trace():
    # 1 2 3 4 1 2 5 1 2 3 4 5: 7 faults with 3 frames, 6 with 4 (LRU: 10 and 8)
    t = keys([1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5])
    assert belady_loads(t, 3) == 7 and belady_loads(t, 4) == 6
    assert lru_loads(t, 3) == 10 and lru_loads(t, 4) == 8


def test_no_room_loads_every_request_and_room_for_all_loads_each_once():
    t = keys([1, 2, 1, 3, 2, 1])
    assert belady_loads(t, 0) == belady_loads(t, 1) == 6
    assert belady_loads(t, 3) == belady_loads(t, 10) == 3
    # a group is held whole, whatever the capacity: two layers' top-2, alternating
    g = [((1, 0), (1, 1)), ((2, 0), (2, 1))] * 3
    assert belady_loads(g, 0) == 12 and belady_loads(g, 3) == 2 + 2 + 1 + 1 + 1 + 1 and belady_loads(g, 4) == 4


def test_only_counted_requests_count_and_the_initial_set_is_free():
    t = keys([1, 2, 3, 1, 2, 3])
    assert belady_loads(t, 3, counted=[False] * 3 + [True] * 3) == 0  # a prefill warmed them
    assert belady_loads(t, 3, initial=[(0, 1), (0, 2)]) == 1
    assert belady_loads(t, 2, initial=[(0, 4), (0, 5)]) == optimum(t, 2, [(0, 4), (0, 5)]) == 4


@pytest.mark.parametrize("seed", range(60))
def test_min_is_the_optimum_and_never_above_the_stores_lru(seed):
    rng = random.Random(seed)
    universe = [(layer, e) for layer in range(2) for e in range(3)]
    groups = [tuple(rng.sample(universe, rng.randrange(1, 3))) for _ in range(rng.randrange(3, 9))]
    cap = rng.randrange(1, 5)
    init = rng.sample(universe, rng.randrange(0, 3))
    assert belady_loads(groups, cap, initial=init) == optimum(groups, cap, init)
    assert belady_loads(groups, cap) <= lru_loads(groups, cap)
