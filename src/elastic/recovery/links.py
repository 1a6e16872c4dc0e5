"""Which members of a generation cannot connect to each other, agreed by all, and the wait of those left out.

`elastic.run` checks the links of a generation's members before it forms the group (and again when a
failure left every member present and every heartbeat fresh, the signature of a link that went silent):

1. `Links.find`: every member probes every other (`elastic.recovery.reach.probe`, bounded), posts what
   it could not reach under the generation's store prefix (``reach/<tag>/bad``, JSON lines) and counts
   itself in (``reach/<tag>/n``, one ``add``); then it polls that counter (one operation per poll) until
   every expected member posted, one of them is gone (its heartbeat expired, its process exited), or the
   wait ends. Every member then reads the same findings: a `Cut` (possibly empty) and whether it is
   complete. Findings are symmetric once posted: a pair that only one side could not probe is known to
   both.
2. With a non-empty cut the group is not formed. Each member reports the pairs it found itself to the
   next round (`Rendezvous.unreachable`, ``xa|b,`` events), whose decision keeps the largest set of
   candidates with no such pair (`elastic.recovery.partition.largest_reachable`, ties to the previous
   members in their rank order, the same choice on every proposer).
3. A member that the same rule leaves out of its generation's members does not join (it would be a
   newcomer at once, the others would regroup for it and fail again): `Links.wait` re-probes the peers it
   could not reach about once a second and returns once it reaches them, once they are gone, or once the
   rule no longer leaves it out; after `join_timeout` it raises an `ElasticError` naming the pairs and
   their addresses.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import attrs

from elastic._util.errors import ElasticError
from elastic.recovery.partition import largest_reachable
from elastic.recovery.reach import Listener, lookup, probe, publish

__all__ = ["Cut", "Found", "Links", "probe_seconds"]

log = logging.getLogger("elastic")

#: `Links.find`'s count of members that posted, in the low bits; members that found a bad pair, above.
_SHIFT = 32
#: Seconds between two probes of a participant waiting for a link to heal.
RETRY = 1.0
_STORE_ERRORS = (RuntimeError, OSError, ValueError)


def probe_seconds(timeout: float) -> float:
    """How long a connection to a peer may take before it counts as impossible: `timeout`/10 within 1-2
    s (a lost SYN is resent after 1 s), never above `timeout`."""
    return min(timeout, 2.0, max(1.0, timeout / 10))


@attrs.frozen
class Cut:
    """Pairs of participants that cannot connect: ``(a, b) -> why`` (a could not reach b, and how), with
    the listener addresses that were probed."""

    found: Mapping[tuple[str, str], str] = attrs.field(factory=dict)
    addresses: Mapping[str, str] = attrs.field(factory=dict)

    def __bool__(self) -> bool:
        return bool(self.found)

    @property
    def pairs(self) -> frozenset[frozenset[str]]:
        """The unordered pairs (two-element frozensets)."""
        return frozenset(frozenset(p) for p in self.found if p[0] != p[1])

    def found_by(self, participant: str) -> list[tuple[str, str]]:
        """The pairs `participant` found itself, ``(participant, peer)``."""
        return [p for p in self.found if p[0] == participant]

    def peers_of(self, participant: str) -> set[str]:
        """The participants `participant` is paired with."""
        return {q for pair in self.pairs if participant in pair for q in pair if q != participant}

    def named(self, p: str, members: Sequence[str] = ()) -> str:
        rank = f", rank {members.index(p)}" if p in members else ""
        return f"{p!r} ({self.addresses.get(p, 'address unknown')}{rank})"

    def describe(self, members: Sequence[str] = (), only: Iterable[frozenset[str]] | None = None) -> str:
        """The pairs in words, one clause per pair: who, where (listener address, rank in `members`), and
        why as each side saw it (`only`: these pairs)."""
        keep = None if only is None else set(only)
        clauses = []
        for a, b in sorted({tuple(sorted(p)) for p in self.found}):
            if keep is not None and frozenset((a, b)) not in keep:
                continue
            there, back = self.found.get((a, b)), self.found.get((b, a))
            if there is not None and back is not None:
                why = f"{there}, both ways" if there == back else f"{there}; the other way: {back}"
                pair = f"{self.named(a, members)} and {self.named(b, members)}"
                clauses.append(f"{pair} cannot connect to each other ({why})")
            else:
                src, dst = (a, b) if there is not None else (b, a)
                pair = f"{self.named(src, members)} cannot connect to {self.named(dst, members)}"
                clauses.append(f"{pair} ({there or back})")
        return "; ".join(clauses)


@attrs.frozen
class Found:
    """What `Links.find` found: the cut (empty: every pair connects) and whether every expected member
    posted (False: one is gone or too slow; the cut is then what the others found)."""

    cut: Cut
    complete: bool
    missing: tuple[int, ...] = ()


def _holds(pair: Iterable[str], names: Collection[str]) -> bool:
    return all(p in names for p in pair)


class Links:
    """This participant's side of the link checks of one `run`: its listener, published in the store, the
    peers' addresses (read once each), the checks of a generation and the wait of a participant left out.

    Args:
        store: the rendezvous store (a torch Store), or a callable giving its client now (the rendezvous'
            `client`, renewed after the store restarted: the address is published again there).
        run_id: the run's name in the store.
        participant: this participant's id.
        timeout: how long one probe of a peer may take, in seconds (`probe_seconds`).
        host: the address to listen on (default: the one gloo binds to).

    Raises:
        OSError: no listener could be bound.
    """

    def __init__(
        self, store: Any, run_id: str, participant: str, timeout: float, host: str | None = None
    ) -> None:
        self._client: Any = store if callable(store) else (lambda: store)
        self._published: Any = None
        self.run_id = run_id
        self.participant = participant
        self.timeout = timeout
        self.listener = Listener(participant, host)
        self._addresses: dict[str, str] = {participant: self.listener.address}
        try:
            self.store  # noqa: B018  (publishes the address)
        except BaseException:
            self.listener.close()
            raise

    @property
    def store(self) -> Any:
        """The store's client now; the listener's address is published again on a new client (a store
        restarted empty has lost it, and the peers' addresses are read again)."""
        client = self._client()
        if client is not self._published:
            publish(client, self.run_id, self.participant, self.listener.address)
            if self._published is not None:
                self._addresses = {self.participant: self.listener.address}
            self._published = client
        return client

    def close(self) -> None:
        self.listener.close()

    def addresses(self, names: Iterable[str]) -> dict[str, str]:
        """The listener addresses of `names` that are known (cached; one store read for the new ones)."""
        names = list(dict.fromkeys(names))
        new = [p for p in names if p not in self._addresses]
        if new:
            try:
                self._addresses.update(lookup(self.store, self.run_id, new))
            except _STORE_ERRORS as exc:
                log.debug("links: reading the listener addresses of %s failed: %s", new, exc)
        return {p: self._addresses[p] for p in names if p in self._addresses}

    def probe(self, names: Iterable[str]) -> dict[str, str]:
        """Probe the peers among `names` that published an address: those not reached, with why."""
        peers = self.addresses(p for p in names if p != self.participant)
        return probe(peers, self.timeout)

    def find(
        self,
        store: Any,
        tag: str,
        members: Sequence[str],
        rank: int,
        expect: Collection[int],
        *,
        rdzv: Any,
        wait: float,
    ) -> Found:
        """Probe every other member, post the result under `store` (the generation's prefix), and read
        what every member in `expect` (ranks) posted.

        Args:
            store: the generation's store prefix; `tag` names this check in it (one per check).
            members: the generation's members in rank order; `rank` is this participant's.
            expect: the ranks whose results to wait for (this rank included).
            rdzv: the rendezvous (`progress` is called while waiting; `exited` and `expired` tell who is
                gone).
            wait: how long to wait for the others' results after this participant's own, in seconds.

        Returns:
            The findings (`Found`); an incomplete one when the store failed.
        """
        me = members[rank]
        unreached = self.probe(p for p in members if p != me)
        count, bad = f"reach/{tag}/n", f"reach/{tag}/bad"
        try:
            if unreached:
                store.append(bad, "".join(json.dumps([me, q, why]) + "\n" for q, why in unreached.items()))
            n = store.add(count, 1 + ((1 if unreached else 0) << _SHIFT))
            deadline = time.monotonic() + wait
            pause = 0.002
            within = float(getattr(rdzv, "grace", wait))  # the generation starts: stalls are likely
            while (n & ((1 << _SHIFT) - 1)) < len(expect):
                rdzv.progress()
                gone = set(getattr(rdzv, "exited", set)())
                gone.update(getattr(rdzv, "expired", lambda _within: [])(within))
                missing = tuple(r for r in sorted(expect) if members[r] in gone)
                if missing or time.monotonic() >= deadline:
                    return Found(self._cut(store, bad, members), complete=False, missing=missing)
                time.sleep(pause)
                pause = min(0.02, 2 * pause)
                n = store.add(count, 0)
            return Found(self._cut(store, bad, members) if n >> _SHIFT else Cut(), complete=True)
        except _STORE_ERRORS as exc:
            log.warning("links: the store failed while the members compared their connections: %s", exc)
            found = {(me, q): why for q, why in unreached.items()}
            return Found(Cut(found, self.addresses(members)), complete=False)

    def _cut(self, store: Any, key: str, members: Sequence[str]) -> Cut:
        raw = store.compare_set(key, "", "").decode()
        found: dict[tuple[str, str], str] = {}
        for line in raw.splitlines():
            with contextlib.suppress(ValueError, TypeError):
                a, b, why = json.loads(line)
                found[(str(a), str(b))] = str(why)
        return Cut(found, self.addresses(members))

    def wait(
        self,
        cut: Cut,
        members: Sequence[str],
        *,
        rdzv: Any,
        join_timeout: float,
        finished: Callable[[], bool],
    ) -> None:
        """Wait outside the rendezvous while the largest set of `members` with no pair of `cut` leaves this
        participant out: re-probe its unreached peers every `RETRY` seconds; return once it reaches them,
        they are gone (their heartbeat stopped), the rule keeps it, or the run `finished`.

        Raises:
            ElasticError: `join_timeout` seconds passed first; names the pairs, their addresses and the fix.
        """
        me = self.participant
        began = time.monotonic()
        pairs = set(cut.pairs)
        while True:
            rdzv.progress()
            if finished():
                return
            try:
                # the peers' own counters: this participant's generation has ended for its peers, and its
                # monitor's summary no longer moves once the monitor went on (judging by it: a loop)
                beating = getattr(rdzv, "beating", None)
                alive = set(beating(members) if beating is not None else rdzv.alive()) | {me}
            except ElasticError:
                alive = set(members)
            live = [p for p in members if p in alive]
            pairs = {pair for pair in pairs if _holds(pair, live)}
            mine = {q for pair in pairs if me in pair for q in pair if q != me}
            if mine:
                unreached = self.probe(mine)
                pairs -= {frozenset((me, q)) for q in mine if q not in unreached}
            if me in largest_reachable(live, pairs, prefer=members):
                return
            waited = time.monotonic() - began
            if waited >= join_timeout:
                raise ElasticError(self._wait_message(cut, members, pairs, join_timeout))
            time.sleep(max(0.0, min(RETRY, join_timeout - waited)))

    def _wait_message(
        self, cut: Cut, members: Sequence[str], pairs: set[frozenset[str]], join_timeout: float
    ) -> str:
        me = self.participant
        own = {pair for pair in pairs if me in pair} or pairs
        return (
            f"elastic: participant {cut.named(me, members)} is left out of the generation: "
            f"{cut.describe(members, own)}, and the link did not heal within "
            f"join_timeout={join_timeout:g} s; the others train on without it (the largest set of workers "
            f"that all reach each other). Fix the network between these hosts (a firewall or security group "
            f"between them, a route, or GLOO_SOCKET_IFNAME naming an interface the other host cannot reach: "
            f"gloo and this check both use its address), then start this worker again; or raise "
            f"join_timeout to wait longer"
        )
