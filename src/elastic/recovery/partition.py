"""Who goes on when some pairs of participants cannot connect: the largest set with no such pair.

An asymmetric partition (every participant reaches the store, some pairs not each other) leaves no
generation that can form with everyone: a process group needs every pair connected. The rendezvous
keeps the largest set of candidates that contains no pair known not to connect (a maximum independent
set of the conflict graph whose edges are those pairs); the others wait outside. Every proposer must
choose alike from the same evidence, so the choice is deterministic: among the largest sets, the one
with the most preferred participants (the previous generation's members), then the one that keeps the
earliest participants in the canonical order (the preferred ones in their given order, then the others
in theirs).

The search is exact while the participants involved in conflicts are few (`EXACT_LIMIT`): it branches on
the two ends of a conflict (one of them must go) and keeps the best set. Past that a deterministic greedy
drops the participant with the most conflicts (the latest in the canonical order among equals) until
none is left: still a set with no bad pair, perhaps not the largest.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable

__all__ = ["EXACT_LIMIT", "largest_reachable"]

#: The most participants involved in conflicts for which the exact search runs (2^k leaves at worst).
EXACT_LIMIT = 16


def largest_reachable(
    participants: Iterable[str], unreachable: Collection[frozenset[str]], prefer: Iterable[str] = ()
) -> tuple[str, ...]:
    """The largest subset of `participants` that contains no pair of `unreachable`.

    Args:
        participants: the candidates, in their given order (duplicates count once).
        unreachable: unordered pairs (two-element frozensets) that cannot connect; pairs with a member
            outside `participants`, or fewer than two members, are ignored.
        prefer: participants to keep first among equally large sets (the previous generation's members),
            in their order, which takes precedence over the given order among them.

    Returns:
        The chosen participants, in the given order of `participants`. The same for the same arguments
        whatever the order of `unreachable`.
    """
    given = tuple(dict.fromkeys(participants))
    present = set(given)
    pairs = frozenset(p for p in unreachable if len(p) == 2 and p <= present)
    if not pairs:
        return given
    preferred = tuple(p for p in dict.fromkeys(prefer) if p in present)
    kept = _solve(given, pairs, preferred)
    return tuple(p for p in given if p in kept)


@functools.lru_cache(maxsize=256)
def _solve(
    given: tuple[str, ...], pairs: frozenset[frozenset[str]], preferred: tuple[str, ...]
) -> frozenset[str]:
    """The chosen set (cached: every poll of a round asks again with the same evidence)."""
    canonical = preferred + tuple(p for p in given if p not in preferred)
    position = {p: i for i, p in enumerate(canonical)}
    edges: list[tuple[str, str]] = []
    for pair in pairs:
        a, b = sorted(pair, key=position.__getitem__)
        edges.append((a, b))
    edges.sort(key=lambda e: (position[e[0]], position[e[1]]))
    involved = {p for edge in edges for p in edge}
    if len(involved) <= EXACT_LIMIT:
        return _exact(canonical, edges, position, len(preferred))
    return _greedy(canonical, edges, position)


def _key(
    kept: frozenset[str], position: dict[str, int], n_preferred: int
) -> tuple[int, int, tuple[int, ...]]:
    """Larger is better: the size, the preferred participants kept, then the earliest positions kept
    (a set that keeps an earlier participant instead of a later one wins: positions negated)."""
    places = sorted(position[p] for p in kept)
    return len(kept), sum(i < n_preferred for i in places), tuple(-i for i in places)


def _exact(
    canonical: tuple[str, ...], edges: list[tuple[str, str]], position: dict[str, int], n_preferred: int
) -> frozenset[str]:
    best: list[frozenset[str]] = []

    def branch(kept: frozenset[str]) -> None:
        if best and len(kept) < len(best[0]):
            return  # cannot become larger: every branch only drops participants
        edge = next((e for e in edges if e[0] in kept and e[1] in kept), None)
        if edge is None:
            if not best or _key(kept, position, n_preferred) > _key(best[0], position, n_preferred):
                best[:] = [kept]
            return
        # one end must go: drop the later one first, which finds the preferred answer early (better pruning)
        branch(kept - {edge[1]})
        branch(kept - {edge[0]})

    branch(frozenset(canonical))
    return best[0]


def _greedy(
    canonical: tuple[str, ...], edges: list[tuple[str, str]], position: dict[str, int]
) -> frozenset[str]:
    kept = set(canonical)
    while True:
        degree: dict[str, int] = {}
        for a, b in edges:
            if a in kept and b in kept:
                degree[a] = degree.get(a, 0) + 1
                degree[b] = degree.get(b, 0) + 1
        if not degree:
            return frozenset(kept)
        kept.discard(max(degree, key=lambda p: (degree[p], position[p])))
