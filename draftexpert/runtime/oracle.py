"""Belady's MIN on a run's recorded expert trace: the fewest loads any cache of the same size could
have made (an oracle that knows every future request), beside what the run's cache, round working
set and prefetcher moved.

The trace is, in order, each layer's request of every forward (drafts and verifications alike;
prefetches are loads, not requests): a group of experts the layer computes with together, so all of
a group are on the accelerator at once. MIN evicts the held expert (outside the group being served)
whose next request is farthest away; that minimises the loads for a given capacity, and no policy
that loads early (prefetch) does with fewer loads at that capacity — it only moves them off the
critical path. So `moved loads − oracle loads` is what a better predictor or cache of the same
memory could still remove.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

Key = tuple[int, int]
NEVER = float("inf")


def belady_loads(
    groups: Sequence[Sequence[Key]],
    capacity: int,
    counted: Sequence[bool] | None = None,
    initial: Iterable[Key] = (),
) -> int:
    """Loads MIN makes serving `groups` in order with room for `capacity` experts (at least one
    group's), holding `initial` at the start (a cache kept from an earlier sequence; the soonest
    needed of them if more than fit). `counted[g]`: whether group g's loads count (decode requests
    do; a prefill's only warm the cache)."""
    n = len(groups)
    counted = [True] * n if counted is None else counted
    groups = [tuple(dict.fromkeys(g)) for g in groups]
    capacity = max(capacity, max((len(g) for g in groups), default=0))
    if capacity <= 0:
        return 0
    nxt: list[dict[Key, float]] = [{} for _ in range(n)]  # nxt[g][k]: the next group after g asking for k
    last: dict[Key, float] = {}
    for g in range(n - 1, -1, -1):
        for k in groups[g]:
            nxt[g][k] = last.get(k, NEVER)
        for k in groups[g]:
            last[k] = g
    resident: dict[Key, float] = {}  # key → its next request
    heap: list[tuple[float, Key]] = []  # (−next request, key); stale entries skipped on pop

    def hold(k: Key, when: float) -> None:
        resident[k] = when
        heapq.heappush(heap, (-when, k))

    for k in sorted(set(initial), key=lambda k: last.get(k, NEVER))[:capacity]:
        hold(k, last.get(k, NEVER))  # after the backward pass `last` is each key's first request
    loads = 0
    for g, group in enumerate(groups):
        here = set(group)
        for k in group:
            if k in resident:
                continue
            loads += counted[g]
            if len(resident) >= capacity:
                kept = []
                while True:
                    neg, victim = heapq.heappop(heap)
                    if resident.get(victim) != -neg:
                        continue  # stale
                    if victim in here:
                        kept.append((neg, victim))  # this group's: computed with now
                        continue
                    del resident[victim]
                    break
                for item in kept:
                    heapq.heappush(heap, item)
            hold(k, g)  # provisional: the group's own requests come next
        for k in group:
            hold(k, nxt[g][k])
    return loads
