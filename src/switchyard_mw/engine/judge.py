"""The judge consultation, for any transport: the ASGI middleware and the ext_proc servicer.

One `asyncio.timeout` spans the whole consultation (connect, headers, every body byte, parsing),
so a judge that trickles bytes cannot stretch it the way httpx's per-operation timeouts would.
Every way the judge can fail ends in the route's fail-open model (its `fallback` key) and one
count of `switchyard.classifier_fail_open` with its reason.

A conversation carrying signed thinking is pinned: its thinking blocks bind it to the model
that wrote them, so neither a fresh verdict nor a fail-open may move it. `Judge` remembers the
model each conversation (route, first-turn hash) was last routed to, in a bounded LRU, and a
pinned turn reuses that verdict without consulting the judge.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import httpx
from opentelemetry import propagate, trace

from ..accounts import Account
from ..clients.outbound import make_http_client, map_exceptions
from ..config import Route
from ..core.judge_verdicts import build_judge_request, parse_verdict
from ..errors import BadVerdict
from ..errors import JudgeHTTPError as JudgeHTTPError  # its home before errors.py
from ..telemetry import names as tm
from ..wire import RequestView, last_user_text

MAX_VERDICT_BYTES = 64 * 1024
"""A verdict is a label; a reply larger than this is not one, and reading it would cost time."""

JUDGE_PATH = "/v1/chat/completions"
PIN_CACHE_SIZE = 10_000
"""Conversations whose verdict is remembered; about 200 bytes each."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """Where a route sends one request, and why.

    `route_header` is the `x-switchyard-route` value: `judge:<label>` or `fail_open:<reason>`.
    `cached`: a pinned conversation's remembered verdict, reused without asking the judge
    (its `route_header` is the one that verdict was given with).
    """

    model: str
    route_header: str
    label: str | None = None
    reason: str | None = None
    cached: bool = False


class Judge:
    """Asks a route's judge which model to call; owns the judge's connection pool.

    `routes` maps a requested model name to its `Route`; `accounts` holds every account a route's
    `judge` names. Pass `http_client` to share a connection pool (whoever passes it closes it);
    otherwise one is built on first use and closed by `aclose()`.

    The pin cache lives in this process only: another replica, a restart or an eviction (past
    `pin_cache_size` conversations) forgets a conversation, and its next pinned turn is judged
    afresh like any other. Keep the route's choices stable while conversations are running.
    """

    def __init__(
        self,
        *,
        routes: Mapping[str, Route],
        accounts: Mapping[str, Account],
        http_client: httpx.AsyncClient | None = None,
        pin_cache_size: int = PIN_CACHE_SIZE,
    ) -> None:
        missing = sorted({r.judge for r in routes.values()} - set(accounts))
        if missing:
            raise ValueError(f"no client for judge(s): {', '.join(missing)}")
        self.routes = dict(routes)
        self._accounts = dict(accounts)
        self.http = http_client
        self.owns_http = http_client is None
        self._pins: OrderedDict[tuple[str, str], Decision] = OrderedDict()
        self._pin_cache_size = pin_cache_size

    def _http_client(self) -> httpx.AsyncClient:
        # Built lazily (and rebuilt after a shutdown, should the app be served again) so that
        # one pool serves every request rather than one pool per request.
        if self.http is None or self.http.is_closed:
            if not self.owns_http:
                raise RuntimeError("the http_client passed to the judge was closed")
            self.http = make_http_client()
        return self.http

    def applies(self, view: RequestView | None) -> bool:
        """Whether a request's model names a route: only then is there a choice to make."""
        return view is not None and view.model in self.routes

    def take_over(self, old: Judge) -> None:
        """Continue `old`'s work after a config reload (call before this judge is used).

        One connection pool across reloads: `old` keeps using it for the requests it is still
        deciding, and this judge closes it. Pinned conversations keep their verdict where the
        route still offers its model, so a reload never moves one off the model its thinking
        binds it to.
        """
        if old.owns_http and self.owns_http:
            # Built now if need be: `old` may still be asked, and must not build its own.
            self.http = old._http_client() if old.routes else old.http
            old.owns_http = False
        for (name, turn), decision in old._pins.items():
            route = self.routes.get(name)
            if route is not None and (
                decision.model == route.fallback or decision.model in route.choices.values()
            ):
                self._remember((name, turn), decision)

    async def aclose(self) -> None:
        """Close the judge's connection pool if this judge built it."""
        if self.owns_http and self.http is not None:
            await self.http.aclose()
            self.http = None

    async def decide(
        self,
        route_name: str,
        view: RequestView,
        body: bytes,
        budget_at: float | None,
        *,
        gone: Callable[[], bool] = lambda: False,
    ) -> Decision:
        """The model for a request whose model names route `route_name`.

        `budget_at` (monotonic time) caps the consultation; `gone()` says, when the caller is
        cancelled, whether its client left (counted as a `disconnect` fail-open).
        """
        route = self.routes[route_name]
        key = (route_name, view.first_turn_hash) if view.first_turn_hash else None
        pinned = view.has_thinking and key is not None
        if pinned and key is not None and (cached := self._recall(key)) is not None:
            with tm.tracer.start_as_current_span(
                tm.SPAN_JUDGE, attributes={tm.JUDGE_ROUTE: route_name, tm.JUDGE_OUTCOME: "pinned"}
            ):
                return Decision(
                    model=cached.model,
                    route_header=cached.route_header,
                    label=cached.label,
                    reason=cached.reason,
                    cached=True,
                )
        decision = await self._consult_traced(route_name, route, view, body, budget_at, gone, key)
        if key is not None:
            self._remember(key, decision)
        return decision

    async def _consult_traced(
        self,
        name: str,
        route: Route,
        view: RequestView,
        body: bytes,
        budget_at: float | None,
        gone: Callable[[], bool],
        key: tuple[str, str] | None,
    ) -> Decision:
        started = time.monotonic()
        attributes = {tm.JUDGE_ROUTE: name, tm.REQUEST_MODEL: route.judge_model}
        with tm.tracer.start_as_current_span(
            tm.SPAN_JUDGE,
            kind=trace.SpanKind.CLIENT,
            attributes=attributes,
            record_exception=False,  # an exception's text could quote the judge's reply
            set_status_on_exception=False,
        ) as span:
            try:
                label, reason = await self._consult(route, view, body, budget_at)
            except asyncio.CancelledError:
                if gone():
                    self._fail_open(name, route, "disconnect", span, started, None)
                raise
            if label is None:
                # A pinned turn judged afresh (its verdict was forgotten) may have been
                # remembered by a concurrent turn meanwhile: that beats the fail-open model.
                pin = self._recall(key) if view.has_thinking and key is not None else None
                return self._fail_open(name, route, reason, span, started, pin)
            span.set_attributes({tm.JUDGE_OUTCOME: "ok", tm.JUDGE_LABEL: label})
            tm.judge_duration.record(time.monotonic() - started, {"route": name, "outcome": "ok"})
            return Decision(model=route.choices[label], route_header=f"judge:{label}", label=label)

    async def _consult(
        self, route: Route, view: RequestView, body: bytes, budget_at: float | None
    ) -> tuple[str | None, str]:
        """(label, "") when the judge answered in time, else (None, fail-open reason)."""
        # The judge's account, bound to the judge model: its own name for it, and its path.
        account = self._accounts[route.judge].for_model(route.judge_model)
        request = build_judge_request(
            judge_model=account.provider_model or route.judge_model,
            labels=list(route.choices),
            user_text=last_user_text(view.wire, body),
            max_chars=route.judge_input_max_chars,
        )
        timer = asyncio.timeout(bound_secs(route, account, budget_at))
        try:
            async with timer:
                # Inside the timer: its own TimeoutError is not the network's. Not an
                # attempt's call: a failure is the judge's fail-open (each attempt starts
                # with a clean `ctx.transport_error` all the same).
                with map_exceptions(report=False):
                    reply = await self._call(account, request)
                return parse_verdict(reply, list(route.choices)), ""
        except TimeoutError:
            return None, "deadline" if timer.expired() else "transport_error"
        except JudgeHTTPError:
            return None, "http_error"
        except (BadVerdict, httpx.DecodingError):
            return None, "bad_verdict"
        except httpx.HTTPError:  # a mapped TransportError, or one of httpx's own refusals
            return None, "transport_error"

    async def _call(self, account: Account, body: bytes) -> bytes:
        headers = [
            *account.auth_headers(),
            ("content-type", "application/json"),
            ("accept", "application/json"),
        ]
        if tm.tracing():
            # The judge's own traces join the request's: it runs under the judge span.
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            headers.extend(carrier.items())
        # `timeout=None`: the consultation's one deadline is ours; per-operation httpx timeouts
        # would fire apart from it and be counted as transport errors.
        async with self._http_client().stream(
            "POST", account.url(JUDGE_PATH), content=body, headers=headers, timeout=None
        ) as response:
            # Leaving this block (error, timeout or cancellation) closes the response, so a
            # judge we stopped waiting for is hung up on instead of finishing unread.
            if not 200 <= response.status_code < 300:
                raise JudgeHTTPError(response.status_code)
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > MAX_VERDICT_BYTES:
                    raise BadVerdict(f"the judge's reply exceeds {MAX_VERDICT_BYTES} bytes")
                chunks.append(chunk)
            return b"".join(chunks)

    @staticmethod
    def _fail_open(
        name: str,
        route: Route,
        reason: str,
        span: trace.Span,
        started: float,
        pin: Decision | None,
    ) -> Decision:
        tm.classifier_fail_open.add(1, {"route": name, "reason": reason})
        tm.judge_duration.record(time.monotonic() - started, {"route": name, "outcome": reason})
        span.set_attributes({tm.JUDGE_OUTCOME: "fail_open", tm.JUDGE_REASON: reason})
        span.set_status(trace.StatusCode.ERROR, reason)
        model = pin.model if pin is not None else route.fallback
        return Decision(model=model, route_header=f"fail_open:{reason}", reason=reason)

    def _recall(self, key: tuple[str, str]) -> Decision | None:
        decision = self._pins.get(key)
        if decision is not None:
            self._pins.move_to_end(key)
        return decision

    def _remember(self, key: tuple[str, str], decision: Decision) -> None:
        """The model this conversation was routed to: where its next turn's thinking comes from."""
        self._pins[key] = decision
        self._pins.move_to_end(key)
        while len(self._pins) > self._pin_cache_size:
            self._pins.popitem(last=False)


def bound_secs(route: Route, account: Account, budget_at: float | None) -> float:
    """How long the consultation may take: its own deadline, capped by the request's budget.

    Without `judge_deadline_ms` the judge client's `timeout_secs` still caps it, so a judge
    that never answers cannot hold a request that has no budget forever.
    """
    if route.judge_deadline_ms is not None:
        bound = route.judge_deadline_ms / 1000
    else:
        bound = account.spec.timeout_secs
    if budget_at is not None:
        bound = min(bound, budget_at - time.monotonic())
    return max(bound, 0.0)
