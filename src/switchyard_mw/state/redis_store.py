"""Account health shared across replicas through Redis.

Keys (``P`` = ``key_prefix``, ``A`` = account; docs/operations.md, "Sharing account health"):
``P:account:{A}`` hash, no TTL (it must outlive any cooling and is never evicted under a
``volatile-*`` policy); ``P:probe:{A}`` the probe slot, ``PX`` = the lease; ``P:pair:{A}:M``
and ``P:pairprobe:{A}:M`` the same for the (account, model M) pair of an account serving
several models (its model faults; one account's keys share a slot); ``P:holds:{A}`` the
throttle holds, TTL = the longest; ``P:trips`` the canary-guard trips (:mod:`._standing`);
channel ``P:events``. Every change of an account runs one Lua script (:mod:`._lua`), every hold
and trip one of :mod:`._standing`. Writes go out from a background task, in order; only the
probe claim is awaited by a request, for at most ``timeout_secs``. Any failure or timeout starts
an outage: logged and counted once (``switchyard.state.degraded``), the pool decides alone, and a
reconnect loop re-subscribes and merges both ways (max) when Redis is back: cooling, holds, trips.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import secrets
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError

from ..core.pool import AccountPool, AccountSpec
from ..core.shared import Change, Shared
from ..telemetry import names as tm
from . import _standing as standing
from ._lua import ACCOUNT, Script, keys, ms, name_of, parse, script_args, unit_of
from ._redis_io import (
    ERRORS,
    Call,
    Client,
    Mode,
    Target,
    close_quietly,
    make_client,
    run_by_key,
    run_pipelined,
    subscriber,
)
from .redis_hedge_budget import SharedHedgeBudget

if TYPE_CHECKING:
    from ..core.shared import TripBoard

_log = logging.getLogger(__name__)
_PROBE_OUTCOMES = frozenset({Change.PROBE_FAULT, Change.PROBE_SUCCESS, Change.PROBE_FREED})
MAX_QUEUED = 10_000
"""Writes waiting for Redis beyond this mean it is too slow to keep up: treated as an outage."""


class RedisStore:
    """A :class:`~switchyard_mw.state.Store` on Redis; bind it to a pool, then ``start()``."""

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
        probe_lease_secs: float = 60.0,
        reconnect_max_secs: float = 2.0,
    ) -> None:
        self._target = Target(mode, url, tuple(sentinels), service)
        self._where = self._target.describe()
        self._prefix = key_prefix
        self._channel = f"{key_prefix}:events"
        self._timeout = timeout_secs
        # Connecting, subscribing and the resync happen off the request path: more room.
        self._connect_timeout = max(1.0, 10 * timeout_secs)
        self._reconnect_max = reconnect_max_secs
        self._lease_ms = max(1, round(probe_lease_secs * 1000))
        self._origin = secrets.token_hex(6)  # tells this replica's own events apart
        self._tokens = itertools.count()
        # (account, model or None) -> token of the probe slot we hold
        self._claims: dict[tuple[str, str | None], str] = {}
        self._pool: AccountPool | None = None
        self._specs: dict[str, AccountSpec] = {}
        self._commands: Client | None = None
        self._pubsub: PubSub | None = None
        self._pubsub_client: Client | None = None
        self._healthy = False
        self._outage = False
        self._closing = False
        self._generation = 0  # one per connection: tells stale failures from current ones
        self._queue: deque[tuple[str, str | None, Change, Shared, str]] = deque()
        # Throttle holds and guard trips to keep in Redis.
        self._pending = standing.Pending()
        # One writer of holds and trips at a time (the write loop, or a resync), so that a
        # reload's clear of the stored trips never lands after a trip of the new config.
        self._standing_lock = asyncio.Lock()
        self._canaries: TripBoard | None = None
        self._trips: dict[tuple[str, str], str] = {}  # (base, variant) -> signature, in force here
        self._clear_trips = False  # a reload ended the stored trips; not yet done in Redis
        self._wake = asyncio.Event()
        self._tasks: dict[str, asyncio.Task[None]] = {}

    @property
    def healthy(self) -> bool:
        """Connected and subscribed: changes are shared as they happen."""
        return self._healthy

    def bind(self, pool: AccountPool) -> None:
        self._pool = pool
        self._specs = {spec.name: spec for spec in pool.specs}
        pool.attach(self)

    async def start(self) -> None:
        if self._closing:
            return
        if "writer" not in self._tasks:
            self._tasks["writer"] = asyncio.create_task(self._write_loop())
        connector = self._tasks.get("connector")
        if connector is None:
            connector = self._tasks["connector"] = asyncio.create_task(self._connect_loop())
        # Wait a little so that the first requests already see shared state, never longer.
        await asyncio.wait({connector}, timeout=self._timeout)

    async def aclose(self) -> None:
        # Last writes, and the probe slots still claimed: left alone, a slot would keep every
        # replica from probing until its lease ran out (the server has finished its requests).
        last = [self._call(a, c.value, token, local, m) for a, m, c, local, token in self._queue]
        last += [
            self._call(a, "probe_freed", token, None, m) for (a, m), token in self._claims.items()
        ]
        if self._healthy and last:
            with contextlib.suppress(*ERRORS):
                await self._run(last, self._timeout)
        self._closing = True  # from here a failed call is no outage: nothing reconnects
        await self._write_standing()  # the last holds and trips
        self._healthy = False
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        await self._close_pubsub()
        await close_quietly(None, self._commands, within=self._timeout)
        self._commands = None

    # --- what the pool tells the store ---------------------------------------------------

    def changed(
        self, account: str, change: Change, local: Shared, *, model: str | None = None
    ) -> None:
        token = self._claims.pop((account, model), "") if change in _PROBE_OUTCOMES else ""
        if not self._healthy or account not in self._specs:
            return  # during an outage the resync merges the local state once Redis is back
        if len(self._queue) >= MAX_QUEUED:
            self._lost(TimeoutError(f"{MAX_QUEUED} writes waiting"), self._generation)
            return
        self._queue.append((account, model, change, local, token))
        self._wake.set()

    def held(self, account: str, model: str, until_unix: float) -> None:
        # It waits with its end in this host's Unix time; what is left of it is what travels.
        if account in self._specs and self._may_keep():
            self._pending.hold(account, model, until_unix)
            self._wake.set()

    def share_trips(self, canaries: TripBoard) -> None:
        if self._canaries is not None:
            # A reload: every guard starts afresh here, so the trips stored go too (or a
            # replica starting later would bring back what the reload ended). Those of the
            # replaced config not yet written never will be.
            self._clear_trips = True
            self._pending.drop_trips()
            self._wake.set()
        self._canaries = canaries
        self._trips = {}

        def tripped(base: str, variant: str) -> None:
            if canaries is not self._canaries:
                return  # the guard of a replaced config (a request still under way on it)
            signature = canaries.signature(base)
            self._trips[(base, variant)] = signature
            if self._may_keep():
                self._pending.trip(base, variant, signature)
                self._wake.set()

        canaries.on_trip = tripped

    def _may_keep(self) -> bool:
        """Whether a hold or a trip is to be written now, in the background. During an outage
        it stays in the pool or here, and the resync writes it; this many waiting is an outage.
        """
        if self._healthy and len(self._pending) >= MAX_QUEUED:
            self._lost(TimeoutError(f"{MAX_QUEUED} holds and trips waiting"), self._generation)
        return self._healthy

    def hedge_budget(
        self, model: str, *, max_ratio: float, window_secs: float, buckets: int
    ) -> SharedHedgeBudget | None:
        """`model`'s hedge budget in Redis while connected (None: not now, the replica's own
        budget decides)."""
        client = self._commands
        if not self._healthy or client is None:
            return None
        return SharedHedgeBudget(
            client,  # type: ignore[arg-type]  # a cluster client runs a one-key script alike
            key_prefix=f"{self._prefix}:",
            model=model,
            max_ratio=max_ratio,
            window_secs=window_secs,
            buckets=buckets,
        )

    async def claim_probe(self, account: str, model: str | None = None) -> Shared | None:
        if not self._healthy or account not in self._specs:
            return None  # nobody to ask: the local decision stands
        token = f"{self._origin}:{next(self._tokens)}"
        generation = self._generation
        call = self._call(account, "claim", token, None, model)
        try:
            (reply,) = await self._run([call], self._timeout)
        except ERRORS as exc:
            self._lost(exc, generation)
            return None
        kind, _, shared = parse(reply)
        if kind == "granted":
            self._claims[(account, model)] = token
            return None
        return shared

    async def snapshot(self, account: str, model: str | None = None) -> Shared:
        """The shared state of ``account`` (with ``model``: of that pair) as Redis holds it
        now (for operators and tests)."""
        call = self._call(account, "merge", "", Shared(0, 0.0), model)
        (reply,) = await self._run([call], 1.0)
        return parse(reply)[2]

    # --- background work -------------------------------------------------------------------

    async def _write_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._write_standing()
            while self._queue and self._healthy:
                batch = list(self._queue)
                self._queue.clear()
                calls = [self._call(a, c.value, token, local, m) for a, m, c, local, token in batch]
                generation = self._generation
                try:
                    replies = await self._run(calls, self._timeout)
                except ERRORS as exc:
                    self._lost(exc, generation)
                    break
                for reply in replies:
                    self._apply(reply, own=True)

    async def _write_standing(self) -> None:
        if not (self._pending or self._clear_trips):
            return  # the usual case: no wait for the lock a resync may hold
        async with self._standing_lock:
            while (self._pending or self._clear_trips) and self._healthy:
                generation = self._generation
                holds = [
                    self._holds_call(account, models, read=False)
                    for account, models in self._pending.take_holds(time.time())
                ]
                trips = self._pending.take_trips()
                try:
                    await self._clear_stored_trips(self._timeout)
                    if holds:
                        await self._run(holds, self._timeout, standing.HOLDS)
                    if trips:
                        call = standing.trips_call(self._prefix, self._channel, self._origin, trips)
                        await self._run([call], self._timeout, standing.TRIPS)
                except ERRORS as exc:
                    self._lost(exc, generation)
                    return

    async def _clear_stored_trips(self, bound: float) -> None:
        """Delete the stored trips if a reload asked to (the lock held)."""
        if self._clear_trips:
            await self._run([standing.clear_trips_call(self._prefix)], bound, standing.TRIPS)
            self._clear_trips = False

    async def _connect_loop(self) -> None:
        delay = 0.1
        while not self._closing:
            try:
                await self._connect()
                return
            except ERRORS as exc:
                self._degrade(exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._reconnect_max)

    async def _connect(self) -> None:
        await self._close_pubsub()
        async with asyncio.timeout(self._connect_timeout):
            if self._commands is None:
                self._commands = make_client(
                    self._target,
                    socket_timeout=self._timeout,
                    connect_timeout=self._connect_timeout,
                )
            # The account script now (every request may need it); the holds' and trips' when
            # first run (NOSCRIPT: loaded then), so that connecting costs no more round trips.
            await self._commands.script_load(ACCOUNT.text)
            # Subscribe before reading the shared keys: no change can fall between the two.
            # On a cluster, classic pub/sub (the script's PUBLISH reaches every node over the
            # cluster bus), not sharded (SPUBLISH, Redis >= 7): one subscription per process
            # whose loss the listener sees (then resubscribe and resync), where sharded needs
            # one per shard that redis-py moves on its own after a failover, unseen by us, and
            # reads by polling the shards in turn. Its saving, 1 bus message per event instead
            # of (nodes - 1), is small at the rate accounts change (docs/performance.md,
            # "Classic pub/sub").
            # No read timeout on the subscription (it is silent when nothing changes); raw
            # bytes, because anyone may publish on the channel and junk must not break decoding.
            self._pubsub_client = make_client(
                self._target,
                socket_timeout=None,
                connect_timeout=self._connect_timeout,
                decode=False,
            )
            self._pubsub = await subscriber(self._pubsub_client)
            await self._pubsub.subscribe(self._channel)
            self._generation += 1
            generation = self._generation
            self._tasks["listener"] = asyncio.create_task(self._listen(self._pubsub, generation))
            self._healthy = True
            await self._resync()
        # Holds and trips with a bound of their own: the accounts' catching up comes first,
        # and takes no less room than before they were kept.
        if self._healthy and generation == self._generation:
            async with asyncio.timeout(self._connect_timeout):
                await self._resync_standing()
        if not self._healthy or generation != self._generation:
            raise ConnectionError("lost again while catching up")  # the loop tries again
        if self._outage:
            self._outage = False
            _log.warning("state store %s is back: cooling is shared again", self._where)

    async def _resync(self) -> None:
        """Merge both ways: what this replica learnt alone goes up, the shared state comes down;
        by max(), so the longer cooling and the larger count win."""
        if self._pool is None or not self._specs:
            return
        pool = self._pool
        calls = [self._call(name, "merge", "", pool.view(name)) for name in self._specs]
        calls += [
            self._call(name, "merge", "", pool.view(name, model=model), model)
            for name, model in self._known_pairs()
        ]
        for reply in await self._run(calls, self._connect_timeout):
            self._apply(reply, own=True)

    def _known_pairs(self) -> list[tuple[str, str]]:
        """The pairs a resync merges: each model every account serving several names (a pair
        another replica cooled comes down), and those that faulted here (a wildcard's too)."""
        assert self._pool is not None
        found = dict.fromkeys(self._pool.pairs())
        for name, spec in self._specs.items():
            named = sorted(m for m in spec.models if m != "*")
            if len(spec.models) > 1:
                found.update(dict.fromkeys((name, m) for m in named))
        return [(name, model) for name, model in found if name in self._specs]

    async def _resync_standing(self) -> None:
        """Holds and trips both ways: those in force here go up (Redis may have restarted
        empty, or they came during the outage), all those in force in Redis come down."""
        async with self._standing_lock:
            await self._clear_stored_trips(self._connect_timeout)
            await self._sync_holds()
            await self._sync_trips()

    async def _sync_holds(self) -> None:
        pool = self._pool
        if pool is None or not self._specs:
            return
        now = pool.clock()
        names = list(self._specs)
        calls = []
        for name in names:
            mine = [(model, ms(end - now)) for model, end in pool.holds_of(name).items()]
            calls.append(self._holds_call(name, mine, read=True))
        replies = await self._run(calls, self._connect_timeout, standing.HOLDS)
        for name, reply in zip(names, replies, strict=True):
            for model, secs in standing.parse_holds(reply):
                pool.merge_hold(name, model, secs)

    async def _sync_trips(self) -> None:
        if self._canaries is None:
            return
        mine = [(base, variant, sig) for (base, variant), sig in self._trips.items()]
        call = standing.trips_call(self._prefix, self._channel, self._origin, mine)
        (reply,) = await self._run([call], self._connect_timeout, standing.TRIPS)
        for base, variant, signature in standing.parse_trips(reply):
            self._learn_trip(base, variant, signature)

    def _learn_trip(self, base: str, variant: str, signature: str | None) -> None:
        """Apply another replica's trip, if this replica's canary is configured as the one that
        tripped (`signature` None: a replica too old to say; the variant's name decides)."""
        board = self._canaries
        if board is None or (key := (base, variant)) in self._trips:
            return
        mine = board.signature(base)
        if not mine or (signature is not None and signature != mine):
            return  # another config of that canary (a rolling change): not ours to apply
        self._trips[key] = mine
        board.trip(base, variant, announce=False)

    async def _listen(self, pubsub: PubSub, generation: int) -> None:
        try:
            async for message in pubsub.listen():
                data = message.get("data")
                if message.get("type") != "message" or not isinstance(data, bytes):
                    continue
                if data.startswith(b'{"t":'):
                    self._take_note(data)
                else:
                    self._apply(data.decode("utf-8", "replace"), own=False)
        except Exception as exc:  # whatever broke the subscription, resubscribe and resync
            self._lost(exc, generation)
            return
        self._lost(ConnectionError("subscription ended"), generation)

    # --- helpers ---------------------------------------------------------------------------

    def _call(
        self,
        account: str,
        op: str,
        token: str,
        local: Shared | None = None,
        model: str | None = None,
    ) -> Call:
        spec = self._specs[account]
        args = script_args(
            op, self._channel, self._origin, spec, token, self._lease_ms, local, model
        )
        return keys(self._prefix, account, model), args

    def _holds_call(self, account: str, holds: list[tuple[str, int]], *, read: bool) -> Call:
        return standing.hold_call(
            self._prefix, self._channel, self._origin, account, holds, read=read
        )

    async def _run(
        self, calls: Sequence[Call], bound: float, script: Script = ACCOUNT
    ) -> list[Any]:
        """Run `script` once for each call (all of one script: a batch runs or fails whole)."""
        commands = self._commands
        if commands is None:
            raise ConnectionError("not connected")
        async with asyncio.timeout(bound):
            if len(calls) == 1 or isinstance(commands, RedisCluster):
                return await run_by_key(commands, script, calls)
            try:
                return await run_pipelined(commands, script, calls)
            except NoScriptError:
                # Redis restarted (its script cache is gone): the script ran for none of the
                # batch, all of which went to this one server. Load it, run them again.
                await commands.script_load(script.text)
                return await run_pipelined(commands, script, calls)

    def _apply(self, reply: Any, *, own: bool) -> None:
        if self._pool is None or not isinstance(reply, str):
            return
        try:
            _, origin, shared = parse(reply)
        except ValueError:
            return  # not ours: anyone may publish on the channel
        if own:
            # Our own probe success already closed the local breaker; by the time the reply
            # lands, newer local faults may have cooled it again, which `closed` would undo.
            shared = dataclasses.replace(shared, closed=False)
        elif origin == self._origin:
            return  # our own change, already applied from the script's reply
        try:
            account, model = unit_of(name_of(reply))
        except (ValueError, TypeError):
            return
        self._pool.merge(account, shared, model=model)

    def _take_note(self, data: bytes) -> None:
        """Another replica's hold or trip. Anyone may publish on the channel: a note that is
        not one of ours in every field is ignored."""
        try:
            note = json.loads(data)
            kind, origin = note["t"], note["o"]
            if origin == self._origin:
                return
            if kind == "hold" and self._pool is not None:
                # What is left of it; "u" (its end in Unix ms) from a replica of an older
                # version, on the wall clocks' word.
                left = note["l"] / 1000 if "l" in note else note["u"] / 1000 - time.time()
                if left > 0:
                    self._pool.merge_hold(str(note["a"]), str(note["m"]), left)
            elif kind == "trip":
                signature = note.get("s")
                self._learn_trip(str(note["b"]), str(note["v"]), _str_or_none(signature))
        except (ValueError, KeyError, TypeError, AttributeError):
            return

    def _lost(self, exc: BaseException, generation: int) -> None:
        """An outage seen outside the connect loop: degrade, and start reconnecting.

        Only a failure on the current connection counts: a call or a subscription left over
        from before a reconnect must not tear down the connection that replaced it.
        """
        if self._closing or generation != self._generation:
            return
        self._degrade(exc)
        connector = self._tasks.get("connector")
        if connector is None or connector.done():
            self._tasks["connector"] = asyncio.create_task(self._connect_loop())

    def _degrade(self, exc: BaseException) -> None:
        self._healthy = False
        self._queue.clear()
        self._pending.clear()  # the resync writes them (holds from the pool, trips kept here)
        listener = self._tasks.pop("listener", None)
        if listener is not None and listener is not asyncio.current_task():
            listener.cancel()
        if not self._outage:
            # Once per outage, not per request: a flapping store must not flood the logs.
            self._outage = True
            tm.state_degraded.add(1)
            _log.warning(
                "state store %s unreachable (%s): each replica cools accounts on its own "
                "until it is back",
                self._where,
                type(exc).__name__,
            )

    async def _close_pubsub(self) -> None:
        listener = self._tasks.pop("listener", None)
        if listener is not None and listener is not asyncio.current_task():
            listener.cancel()
            await asyncio.gather(listener, return_exceptions=True)
        pubsub, client = self._pubsub, self._pubsub_client
        self._pubsub = self._pubsub_client = None
        await close_quietly(pubsub, client, within=self._timeout)


def _str_or_none(value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError("not a signature")
    return value
