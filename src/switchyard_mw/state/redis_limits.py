"""Tenants' limits shared across replicas through Redis, each replica's share standing in.

Keys (``P`` = ``key_prefix``; docs/operations.md, "Sharing account health"): one hash per
limit, ``P:limit:{tenant:NAME}:MEASURE:PER`` (``:model:M`` appended for a limit of one model),
``P:limit:{deployment}:...`` for `[[limits]]`, its fields as :mod:`._limits_lua` says; it
expires when its window ends. The braces are a Cluster hash tag: one tenant's limits live in
one slot.

Round trips: a reserve is one script (:mod:`._limits_lua`) over every key the request touches,
a settle or release one more. On a Cluster, a request that touches a tenant's limits and the
deployment's touches two slots: two scripts, sent side by side (one round trip of latency,
two calls), and a third, a release, when one of them refuses what the other granted (the
reservation is all or nothing across the two, not atomic: for a moment the granted half holds
what the refused request will not spend, which refuses no more than it should).

Start-up: until Redis has answered once, this replica knows nothing of any window, and its
share would admit from zero as if every window were empty (each replica a whole share). So its
first call (connecting, loading the scripts) is no ordinary call: `start` (the server's
lifespan startup; else the first reserve) makes it once, shared by every request that comes
meanwhile, and waits up to the start-up time, ``max(1 s, 10 x timeout_secs)``, not
``timeout_secs``. Only a Redis that does not answer within it starts an outage.

Degraded mode: a call that fails or takes longer than ``timeout_secs`` starts an outage,
logged and counted once (``switchyard.state.degraded``); a reserve that timed out may still
run on the server, and then holds its ask until the window ends (on the side of the limit).
Until a background ping finds Redis
again, every reserve goes to this process's share of each limit (``amount / replicas_hint``,
:mod:`._limit_shares`), without a round trip; its first use in a window starts from its share
of what Redis last said the window held. When Redis answers again, this replica merges (one
script per slot) what it last read there (a floor: Redis may have restarted empty) and what its
share reserved during the outage; then new reserves go to Redis again, and what the share
reserved while the merge was under way follows in a second merge. A reservation settles
where it was made: one made locally, locally. A settle
of a Redis reservation that fails, or comes during an outage, is dropped: whether it ran is
unknown (a time-out may come after the server ran it), so running it again might give back
twice; dropped, the worst case reserved stays counted until its window ends, which errs on the
side of the limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..core.limits import (
    Granted,
    LimitKey,
    Measure,
    Refused,
    Reservation,
    Status,
    WallClock,
)
from ..telemetry import names as tm
from ._limit_shares import Shares
from ._limits_lua import MERGE, RESERVE, SETTLE
from ._redis_io import ERRORS, Call, Client, Mode, Target, close_quietly, make_client, run_by_key

_log = logging.getLogger(__name__)


def limit_key(prefix: str, limit: LimitKey) -> str:
    """The Redis key counting `limit` (its amount is no part of it: a reload that changes an
    amount keeps what the window holds)."""
    tag = f"{{tenant:{limit.scope}}}" if limit.scope else "{deployment}"
    name = f"{prefix}:limit:{tag}:{limit.measure.value}:{limit.per}"
    return name if limit.model is None else f"{name}:model:{limit.model}"


@dataclass(frozen=True, slots=True)
class _Local:
    """Where a reservation made during an outage is held: this replica's shares, under the
    shares' own reservation."""

    reservation: Reservation


@dataclass(frozen=True, slots=True)
class _Read:
    """What Redis last said of a limit's window."""

    value: float
    """What the window held."""
    start_ms: int
    """The window's start (Redis time)."""
    ends: float
    """When it ends (this host's monotonic clock)."""
    born: str
    """When its hash was made (the scripts' ``c``)."""


_NOTHING_READ = _Read(0.0, -1, 0.0, "-")

_RETRY_SECS = 0.02
"""Between two tries of the first contact (a refused connection fails at once)."""

_SHARED = "shared"
"""A reservation Redis holds (its windows and amounts are in the outward reservation)."""


class RedisLimits:
    """A :class:`~switchyard_mw.state.limit_stores.LimitStore` on Redis."""

    name = "redis"

    def __init__(
        self,
        url: str | None,
        *,
        mode: Mode = "standalone",
        sentinels: Sequence[tuple[str, int]] = (),
        service: str = "mymaster",
        key_prefix: str = "switchyard",
        timeout_secs: float = 0.1,
        replicas_hint: int = 1,
        reconnect_max_secs: float = 2.0,
        clock: WallClock = time.time,
    ) -> None:
        if replicas_hint < 1:
            raise ValueError("replicas_hint must be at least 1")
        self._target = Target(mode, url, tuple(sentinels), service)
        self._where = self._target.describe()
        self._prefix = key_prefix
        self._timeout = timeout_secs
        self._connect_timeout = max(1.0, 10 * timeout_secs)
        self._reconnect_max = reconnect_max_secs
        self._shares = Shares(replicas_hint=replicas_hint, clock=clock)
        self._commands: Client | None = None
        self._healthy = True  # until a call says otherwise: the first request tries Redis
        self._closing = False
        self._tickets = itertools.count(1)
        self._open: dict[int, _Local | str] = {}
        self._seen: dict[LimitKey, _Read] = {}
        """Per limit: what Redis last said of its window."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._reconnect: asyncio.Task[None] | None = None
        self._warm_up: asyncio.Future[None] | None = None
        """The first connection and script load (done: Redis answered once, or gave up)."""
        self._outages = 0
        self.dropped_settles = 0
        """Settles of Redis reservations given up (failed, or during an outage)."""

    @property
    def healthy(self) -> bool:
        """Whether reserves go to Redis (else to this replica's share)."""
        return self._healthy

    # --- the LimitStore interface ----------------------------------------------------------

    async def start(self) -> None:
        """Connect and load the scripts before the first request, waiting at most the
        start-up time; Redis silent that long: an outage (this replica's share)."""
        if self._warm_up is None:
            self._warm_up = asyncio.ensure_future(self._first_contact())
        # Shielded: a request given up while it waits must not cancel the others' wait.
        await asyncio.shield(self._warm_up)

    async def reserve(self, asks: Mapping[LimitKey, float]) -> Granted | Refused:
        if self._warm_up is None or not self._warm_up.done():
            await self.start()
        if asks and self._healthy:
            try:
                async with asyncio.timeout(self._timeout):
                    return await self._reserve_shared(asks)
            except ERRORS as exc:
                self._lost(exc)
        return await self._reserve_local(asks)

    async def settle(self, reservation: Reservation, used: Mapping[Measure, float]) -> None:
        await self._undo(reservation, used)

    def on_share(self, reservation: Reservation) -> bool:
        """Whether `reservation` (not yet settled or released) was made on this replica's
        share during an outage, not in Redis: told by where it is held, not by whether Redis
        is reachable now, which another request may have changed since."""
        return isinstance(self._open.get(reservation.ticket), _Local)

    async def release(self, reservation: Reservation) -> None:
        await self._undo(reservation, None)

    def used(self, limit: LimitKey) -> float:
        """What the limit's window holds as Redis last said it; during an outage, what this
        replica's share holds."""
        if not self._healthy:
            return self._shares.used(limit)
        return self._last_read(limit).value

    async def aclose(self) -> None:
        """Stop reconnecting and close the connections (the server's shutdown)."""
        self._closing = True
        tasks = [*self._tasks, *(t for t in (self._reconnect, self._warm_up) if t is not None)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close_quietly(None, self._commands, within=self._timeout)
        self._commands = None

    # --- Redis -----------------------------------------------------------------------------

    async def _reserve_shared(self, asks: Mapping[LimitKey, float]) -> Granted | Refused:
        limits = list(asks)
        groups = self._groups(limits)
        calls = [self._reserve_call([limits[i] for i in group], asks) for group in groups]
        replies = await run_by_key(self._client(), RESERVE, calls)
        refusals: list[tuple[int, Refused]] = []
        held: dict[LimitKey, float] = {}
        statuses: dict[LimitKey, Status] = {}
        for group, reply in zip(groups, replies, strict=True):
            picked = [limits[i] for i in group]
            if reply[0] == "refused":
                index = int(reply[1]) - 1
                refusals.append((group[index], _refusal(picked[index], reply)))
                continue
            for j, limit in enumerate(picked):
                start_ms, remaining, reset_ms, born = reply[1 + 4 * j : 5 + 4 * j]
                held[limit] = int(start_ms) / 1000
                statuses[limit] = Status(limit.amount, float(remaining), int(reset_ms) / 1000)
                used = limit.amount - float(remaining)
                self._note(limit, used, int(start_ms), int(reset_ms), born)
        if refusals:
            if held:  # a Cluster's other slot granted its half: give it back
                self._spawn(self._run_settle(_reservation(held, asks, 0), None))
            return min(refusals, key=lambda pair: pair[0])[1]
        ticket = next(self._tickets)
        self._open[ticket] = _SHARED
        return Granted(_reservation(held, asks, ticket), statuses)

    async def _run_settle(
        self, reservation: Reservation, used: Mapping[Measure, float] | None
    ) -> None:
        """`used` None: a release (nothing charged)."""
        limits = [limit for limit, _, _ in reservation.held]
        by_limit = {limit: (start, amount) for limit, start, amount in reservation.held}
        calls = []
        for group in self._groups(limits):
            picked = [limits[i] for i in group]
            args: list[str | int] = []
            for limit in picked:
                start, amount = by_limit[limit]
                charge = 0.0 if used is None else used.get(limit.measure, 0.0)
                args += [limit.per, round(start * 1000), repr(float(amount)), repr(float(charge))]
            calls.append((tuple(limit_key(self._prefix, limit) for limit in picked), args))
        async with asyncio.timeout(self._timeout):
            replies = await run_by_key(self._client(), SETTLE, calls)
        self._note_all(limits, replies)

    def _note_all(self, limits: Sequence[LimitKey], replies: Sequence[Any]) -> None:
        """Take note of SETTLE's or MERGE's replies."""
        for group, reply in zip(self._groups(limits), replies, strict=True):
            for j, i in enumerate(group):
                value, start_ms, reset_ms, born = reply[4 * j : 4 * j + 4]
                self._note(limits[i], float(value), int(start_ms), int(reset_ms), born)

    def _groups(self, limits: Sequence[LimitKey]) -> list[list[int]]:
        """Indexes of `limits` by the script call that runs them: one call, except on a
        Cluster, where each scope (hash slot) is a call of its own."""
        if self._target.mode != "cluster":
            return [list(range(len(limits)))]
        by_scope: dict[str, list[int]] = {}
        for i, limit in enumerate(limits):
            by_scope.setdefault(limit.scope, []).append(i)
        return list(by_scope.values())

    def _reserve_call(self, limits: Sequence[LimitKey], asks: Mapping[LimitKey, float]) -> Call:
        args: list[str | int] = []
        for limit in limits:
            args += [limit.per, repr(float(limit.amount)), repr(float(asks[limit]))]
        return tuple(limit_key(self._prefix, limit) for limit in limits), args

    def _client(self) -> Client:
        if self._commands is None:
            self._commands = make_client(
                self._target, socket_timeout=self._timeout, connect_timeout=self._timeout
            )
        return self._commands

    def _note(self, limit: LimitKey, value: float, start_ms: int, reset_ms: int, born: str) -> None:
        self._seen[limit] = _Read(value, start_ms, time.monotonic() + reset_ms / 1000, born)

    def _last_read(self, limit: LimitKey) -> _Read:
        """What Redis last said of the limit's window, if that window is not over."""
        read = self._seen.get(limit)
        return read if read is not None and time.monotonic() < read.ends else _NOTHING_READ

    # --- settling --------------------------------------------------------------------------

    async def _undo(self, reservation: Reservation, used: Mapping[Measure, float] | None) -> None:
        where = self._open.pop(reservation.ticket, None)
        if isinstance(where, _Local):
            await self._shares.settle(where.reservation, used)
            return
        if where is None:
            return  # settled or released already, or never granted here
        if not self._healthy:
            self.dropped_settles += 1
            return
        try:
            await self._run_settle(reservation, used)
        except ERRORS as exc:
            self.dropped_settles += 1
            self._lost(exc)

    # --- this replica's share --------------------------------------------------------------

    async def _reserve_local(self, asks: Mapping[LimitKey, float]) -> Granted | Refused:
        last_read = {limit: self._last_read(limit).value for limit in asks}
        outcome, local = await self._shares.reserve(asks, last_read, self._outages)
        if isinstance(outcome, Refused) or local is None:
            return outcome
        ticket = next(self._tickets)
        self._open[ticket] = _Local(local)
        return dataclasses.replace(
            outcome, reservation=dataclasses.replace(outcome.reservation, ticket=ticket)
        )

    async def _merge(self) -> None:
        """Up to Redis: the most this replica last read there, and what its shares reserved
        on their own since (one script per slot)."""
        limits = list(dict.fromkeys([*self._shares.known(), *self._open_reads()]))
        if not limits:
            return
        pushes: dict[LimitKey, tuple[float, float]] = {}
        calls = []
        for group in self._groups(limits):
            picked = [limits[i] for i in group]
            args: list[str | int] = []
            for limit in picked:
                read = self._last_read(limit)
                start, add = pushes[limit] = self._shares.unshared(limit)
                args += [limit.per, read.born, read.start_ms, repr(read.value)]
                args += [round(start * 1000), repr(add)]
            calls.append((tuple(limit_key(self._prefix, limit) for limit in picked), args))
        async with asyncio.timeout(self._connect_timeout):
            replies = await run_by_key(self._client(), MERGE, calls)
        for limit, (start, add) in pushes.items():
            self._shares.pushed(limit, start, add)
        self._note_all(limits, replies)

    def _open_reads(self) -> list[LimitKey]:
        """The limits whose window, as Redis last said, is not over."""
        now = time.monotonic()
        return [limit for limit, read in self._seen.items() if now < read.ends]

    # --- outages ---------------------------------------------------------------------------

    def _lost(self, exc: BaseException) -> None:
        if self._closing:
            return
        if self._healthy:
            # Once per outage, not per request: a flapping store must not flood the logs.
            self._healthy = False
            self._outages += 1
            tm.state_degraded.add(1)
            _log.warning(
                "limits store %s unreachable (%s): each replica enforces 1/%d of every limit "
                "on its own until it is back",
                self._where,
                type(exc).__name__,
                self._shares.hint,
            )
        if self._reconnect is None or self._reconnect.done():
            self._reconnect = asyncio.create_task(self._reconnect_loop())

    async def _first_contact(self) -> None:
        """Try until the start-up time is over: each call times out after `timeout_secs` (the
        client's socket timeout), which a loaded Redis may take to connect once."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._connect_timeout
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    await self._load_scripts()
                return
            except ERRORS as exc:
                if self._closing or loop.time() + _RETRY_SECS >= deadline:
                    self._lost(exc)
                    return
            await asyncio.sleep(_RETRY_SECS)

    async def _load_scripts(self) -> None:
        """Connect, and have the scripts in Redis's cache (a restarted server lost them)."""
        for script in (RESERVE, SETTLE, MERGE):
            await self._client().script_load(script.text)

    async def _reconnect_loop(self) -> None:
        delay = 0.05
        while not self._closing:
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._reconnect_max)
            with contextlib.suppress(*ERRORS):
                async with asyncio.timeout(self._connect_timeout):
                    await self._load_scripts()
                    await self._merge()
                self._healthy = True
                _log.warning("limits store %s is back: limits are shared again", self._where)
                # The floors are in (a second pass skips them: the hashes are those read);
                # what the shares reserved during the merge goes up now.
                self._spawn(self._merge())
                return

    def _spawn(self, work: Any) -> None:
        async def quietly() -> None:
            with contextlib.suppress(*ERRORS):
                await work

        task = asyncio.create_task(quietly())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _reservation(
    held: Mapping[LimitKey, float], asks: Mapping[LimitKey, float], ticket: int
) -> Reservation:
    return Reservation(tuple((limit, start, asks[limit]) for limit, start in held.items()), ticket)


def _refusal(limit: LimitKey, reply: list[Any]) -> Refused:
    _, _, never, remaining, reset_ms = reply
    reset = int(reset_ms) / 1000
    status = Status(limit.amount, float(remaining), reset)
    return Refused(limit, reset, never=never == "1", status=status)
