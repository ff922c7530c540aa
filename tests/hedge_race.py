"""Envoy's hedge route played against the processor (the two-front comparisons of hedged first
tokens, tests/engine/test_two_fronts_hedge.py and test_two_fronts_clouds.py): each try's
upstream-level streams, its call to the provider, and the race between the tries.

A try's call to the provider is a `Call` (`plain`: straight to it; the cloud comparison's goes
through the cloud filter's stream, nearest the codec), so the same race runs on any cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

import httpx

from extproc_helpers import (
    Pushed,
    Stream,
    request_body,
    response_body,
    response_headers,
    sets,
    upstream_headers,
)
from switchyard_mw.extproc import ExtProcServicer
from two_fronts import Answer, Outgoing, refusal_matched

RETRY_FILTER = [("x-switchyard-filter", "upstream")]
REFUSAL_FILTER = [("x-switchyard-filter", "upstream-hedged")]
"""The hedged variant of the refusal filter (it sees each try's request headers)."""


@dataclass
class Call:
    """A try's call to the provider, as the filters nearest the codec pass its answer on: its
    status and headers, and its body piece by piece (`pieces`, read once)."""

    answer: Answer
    pieces: AsyncIterator[bytes]

    async def whole(self) -> bytes:
        return b"".join([piece async for piece in self.pieces])


Calls = Callable[[Outgoing, int], AbstractAsyncContextManager[Call]]
"""The call of try `number` (`Outgoing`: its request as the filters before made it)."""


def plain(upstream: httpx.AsyncClient) -> Calls:
    """Each try sent straight to the provider `upstream` reaches."""

    @contextlib.asynccontextmanager
    async def call(out: Outgoing, number: int) -> AsyncIterator[Call]:
        headers = {k: v for k, v in out.headers.items() if not k.startswith(":")}
        async with upstream.stream(
            "POST", out.headers[":path"], content=out.body, headers=headers
        ) as reply:
            yield Call(Answer(reply.status_code, dict(reply.headers), b""), reply.aiter_raw())

    return call


@dataclass
class Try:
    """One of Envoy's tries of the request: its upstream-level streams and its fate."""

    number: int
    refusal: Stream
    first_token: Pushed
    answer: Answer | None = None
    retry: bool = False
    """Its answer asks Envoy for a retry (`x-switchyard-retry`)."""
    reply: Any = None
    """The processor's own answer in its place (an immediate response), if it made one."""

    async def reset(self) -> None:
        """Envoy resets the try: its filters' streams end."""
        await self.first_token.close()
        await self.refusal.close()


@dataclass(frozen=True)
class Route:
    """What every try of one request shares."""

    servicer: ExtProcServicer
    calls: Calls
    routed: Outgoing
    """The request as the router-level stream let it go (Envoy replays it for each try)."""
    order: tuple[str, ...]
    """The clusters of Envoy's tries in turn (more than one: an aggregate)."""
    request_id: str
    hedged: bool
    """On the hedge route, whose refusal and first-token filters see each try's request
    headers too."""


async def _try(route: Route, number: int, tries: list[Try]) -> Try:
    """Try `number`: its request through the upstream chain, sent to the provider, and its
    answer back through it; it returns when its headers reach the router (it never does when
    the processor holds them: Envoy resets it for the other try)."""
    servicer, hedged = route.servicer, route.hedged
    named = {"x-request-id": route.request_id}
    out = Outgoing(dict(route.routed.headers), route.routed.body)
    refusal = Stream(servicer, REFUSAL_FILTER if hedged else RETRY_FILTER)
    if hedged:
        await refusal.send(upstream_headers(named, attempt=number))
    if number > 1:  # the retry filter: the hedge's account, its credential and body
        retry = Stream(servicer, RETRY_FILTER)
        # Its endpoint names the cluster an aggregate sent it to (envoy.yaml's metadata).
        order = route.order
        cluster = order[(number - 1) % len(order)] if len(order) > 1 else None
        out.apply(await retry.send(upstream_headers(named, attempt=number, cluster=cluster)))
        out.apply(await retry.send(request_body(out.body)))
        await retry.close()
    first_token = Pushed(servicer)
    if hedged:
        await first_token.inbox.put(upstream_headers(named, attempt=number))
        await first_token.next()
    this = Try(number, refusal, first_token)
    tries.append(this)
    async with route.calls(out, number) as call:
        answer = this.answer = call.answer
        if answer.status < 300 and _streams(answer):
            await _held(this, call, route.request_id)
            return this
        if hedged and 200 <= answer.status < 300:
            # A 2xx JSON answer on the hedge route: the hedged refusal filter sees its
            # headers (envoy.yaml's matcher), the first to come wins the race.
            held = await refusal.send(
                response_headers(answer.status, {}, request_id=route.request_id)
            )
            if held.HasField("override_message_timeout"):  # it lost: held until reset
                await asyncio.Event().wait()
        answer.body = await call.whole()
    if refusal_matched(answer.status):
        extra = {k: v for k, v in answer.headers.items() if k == "retry-after"}
        reply = await refusal.send(
            response_headers(answer.status, extra, request_id=route.request_id)
        )
        if reply.HasField("override_message_timeout"):  # held until Envoy resets it
            await asyncio.Event().wait()
        if reply.HasField("mode_override"):  # a 400 or 429 to read
            reply = await refusal.send(response_body(answer.body, end=True))
        this.retry = sets(reply).get("x-switchyard-retry") == b"1"
    return this


def _streams(answer: Answer) -> bool:
    return answer.headers.get("content-type", "").startswith("text/event-stream")


async def _held(this: Try, call: Call, request_id: str) -> None:
    """A 2xx stream through the first-token filter (`FULL_DUPLEX_STREAMED`): its headers,
    then each piece as the provider sends it, while the processor holds the headers' answer
    to the first content event (or to its first-token bound: a retry mark); it returns when
    the answer goes to the router, never while the try loses its race. Envoy's per-try
    timeout of a stream not hedged is due with the processor's bound: docs/envoy.md says
    either one ends the try alike, and the processor's answer is the one played here."""
    answer, first_token = this.answer, this.first_token
    assert answer is not None
    await first_token.inbox.put(response_headers(200, answer.headers, request_id=request_id))

    async def pieces() -> None:
        async for piece in call.pieces:
            answer.body += piece
            await first_token.inbox.put(response_body(piece))
        await first_token.inbox.put(response_body(b"", end=True))

    reading = asyncio.ensure_future(pieces())
    try:
        released = await first_token.next(within=30.0)
        if released.WhichOneof("response") == "immediate_response":
            this.reply = released  # the machine's answer (no account left): the client's
            return
        this.retry = sets(released).get("x-switchyard-retry") == b"1"
        if not this.retry:
            await reading  # the rest of the stream goes on to the client
    finally:
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reading


async def race(route: Route, per_try: float) -> tuple[Try, list[Try]]:
    """Envoy's tries of a request: the first; on the hedge route, at its per-try timeout
    without headers, the hedge beside it; the first try whose headers reach the router is the
    answer, the other is reset. A retry mark with no try beside it starts the next try (a
    first try refused before the hedge time, a first token late). Off the hedge route the
    per-try timeout, read once for every try, resets a try whose headers have not reached
    the router by then and starts the next (`cut`)."""
    hedge_at: float | None = per_try if route.hedged else None
    cut: float | None = None if route.hedged else per_try

    def start(number: int) -> asyncio.Future[Try]:
        return asyncio.ensure_future(_try(route, number, tries))

    tries: list[Try] = []
    running = {start(1)}
    started = 1
    try:
        while True:
            done, running = await asyncio.wait(
                running, timeout=hedge_at or cut, return_when=asyncio.FIRST_COMPLETED
            )
            if not done and hedge_at is not None:  # the per-try timeout, no headers: the hedge
                started, hedge_at = started + 1, None
                running.add(start(started))
                continue
            if not done:  # the per-try timeout off the hedge route: the try is reset, retried
                assert started < 3, "the route's two retries are spent"
                for task in running:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                await tries[-1].reset()
                started += 1
                running = {start(started)}
                continue
            first = done.pop().result()
            if first.retry and started == 1:  # a retry, before any hedge
                started, hedge_at = 2, None
                running.add(start(started))
                continue
            return first, tries
    finally:
        for task in running:  # Envoy resets the other try
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for each in tries:
            await each.reset()
