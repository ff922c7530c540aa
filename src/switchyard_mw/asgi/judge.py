"""JudgeMiddleware: an LLM judge picks the model of a route, and never makes a request wait long.

One `asyncio.timeout` spans the whole consultation (connect, headers, every body byte, parsing),
so a judge that trickles bytes cannot stretch it the way httpx's per-operation timeouts would.
Every way the judge can fail ends in the route's fallback model and one count of
`switchyard.classifier_fail_open` with its reason.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

import httpx
from opentelemetry import trace

from .. import telemetry as tm
from ..clients import UpstreamClient
from ..config import Route, Server
from ..context import RequestContext
from ..core.judge import BadVerdict, build_judge_request, parse_verdict
from ..outbound import make_http_client
from ..wire import last_user_text
from ._base import PolicyMiddleware
from ._types import ASGIApp, Message, Receive, Scope, Send

MAX_VERDICT_BYTES = 64 * 1024
"""A verdict is a label; a reply larger than this is not one, and reading it would cost time."""

JUDGE_PATH = "/v1/chat/completions"


class _JudgeHTTPError(Exception):
    """The judge answered with a non-2xx status."""


class JudgeMiddleware(PolicyMiddleware):
    """For requests whose model names a route, asks the route's judge which model to call.

    `routes` maps a requested model name to its `Route`; `clients` holds every client a route's
    `judge` names. Pass `http_client` to share a connection pool; otherwise the middleware
    builds its own on first use and closes it on ASGI lifespan shutdown or `aclose()` (whoever
    passes a client closes it). Requests for any other model pass straight through.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        routes: Mapping[str, Route],
        clients: Mapping[str, UpstreamClient],
        http_client: httpx.AsyncClient | None = None,
        server: Server | None = None,
    ) -> None:
        super().__init__(app, server=server)
        missing = sorted({r.judge for r in routes.values()} - set(clients))
        if missing:
            raise ValueError(f"no client for judge(s): {', '.join(missing)}")
        self._routes = dict(routes)
        self._clients = dict(clients)
        self._http = http_client
        self._owns_http = http_client is None

    def _http_client(self) -> httpx.AsyncClient:
        # Built lazily (and rebuilt after a lifespan shutdown, should the app be served again)
        # so that one pool serves every request rather than one client per request.
        if self._http is None or self._http.is_closed:
            if not self._owns_http:
                raise RuntimeError("the http_client passed to JudgeMiddleware was closed")
            self._http = make_http_client()
        return self._http

    async def aclose(self) -> None:
        """Close the judge's connection pool if this middleware built it."""
        if self._owns_http and self._http is not None:
            await self._http.aclose()
            self._http = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" and self._owns_http:
            # The messages pass unchanged; the pool closes just before shutdown completes.
            async def send_closing(message: Message) -> None:
                if message["type"] == "lifespan.shutdown.complete":
                    await self.aclose()
                await send(message)

            return await self.app(scope, receive, send_closing)
        await super().__call__(scope, receive, send)

    async def handle(self, ctx: RequestContext, scope: Scope, receive: Receive, send: Send) -> None:
        name = ctx.requested_model
        route = self._routes.get(name) if name is not None else None
        if route is not None and name is not None and ctx.view is not None:
            await self._decide(ctx, name, route)
        await self.app(scope, receive, send)

    async def _decide(self, ctx: RequestContext, name: str, route: Route) -> None:
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
                label, reason = await self._consult(ctx, route)
            except asyncio.CancelledError:
                if ctx.disconnected:
                    self._fail_open(ctx, name, route, "disconnect", span, started)
                raise
            if label is not None:
                ctx.resolved_model = route.choices[label]
                ctx.route = f"judge:{label}"
                span.set_attributes({tm.JUDGE_OUTCOME: "ok", tm.JUDGE_LABEL: label})
                tm.judge_duration.record(
                    time.monotonic() - started, {"route": name, "outcome": "ok"}
                )
            else:
                self._fail_open(ctx, name, route, reason, span, started)

    async def _consult(self, ctx: RequestContext, route: Route) -> tuple[str | None, str]:
        """(label, "") when the judge answered in time, else (None, fail-open reason)."""
        client = self._clients[route.judge]
        body = build_judge_request(
            judge_model=route.judge_model,
            labels=list(route.choices),
            user_text=last_user_text(ctx.view.wire, ctx.body or b"") if ctx.view else "",
            max_chars=route.judge_input_max_chars,
        )
        timer = asyncio.timeout(_bound_secs(ctx, route, client))
        try:
            async with timer:
                reply = await self._call(client, body)
                return parse_verdict(reply, list(route.choices)), ""
        except TimeoutError:
            # Only our timer means `deadline`; a TimeoutError from elsewhere is the network's.
            return None, "deadline" if timer.expired() else "transport_error"
        except _JudgeHTTPError:
            return None, "http_error"
        except (BadVerdict, httpx.DecodingError):
            return None, "bad_verdict"
        except (httpx.HTTPError, OSError):
            return None, "transport_error"

    async def _call(self, client: UpstreamClient, body: bytes) -> bytes:
        headers = [
            *client.auth_headers(),
            ("content-type", "application/json"),
            ("accept", "application/json"),
        ]
        # `timeout=None`: the consultation's one deadline is ours; per-operation httpx timeouts
        # would fire apart from it and be counted as transport errors.
        async with self._http_client().stream(
            "POST", client.url(JUDGE_PATH), content=body, headers=headers, timeout=None
        ) as response:
            # Leaving this block (error, timeout or cancellation) closes the response, so a
            # judge we stopped waiting for is hung up on instead of finishing unread.
            if not 200 <= response.status_code < 300:
                raise _JudgeHTTPError(response.status_code)
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
        ctx: RequestContext,
        name: str,
        route: Route,
        reason: str,
        span: trace.Span,
        started: float,
    ) -> None:
        ctx.resolved_model = route.fallback
        ctx.route = f"fail_open:{reason}"
        tm.classifier_fail_open.add(1, {"route": name, "reason": reason})
        tm.judge_duration.record(time.monotonic() - started, {"route": name, "outcome": reason})
        span.set_attributes({tm.JUDGE_OUTCOME: "fail_open", tm.JUDGE_REASON: reason})
        span.set_status(trace.StatusCode.ERROR, reason)


def _bound_secs(ctx: RequestContext, route: Route, client: UpstreamClient) -> float:
    """How long the consultation may take: its own deadline, capped by the request's budget.

    Without `judge_deadline_ms` the judge client's `timeout_secs` still caps it, so a judge
    that never answers cannot hold a request that has no budget forever.
    """
    if route.judge_deadline_ms is not None:
        bound = route.judge_deadline_ms / 1000
    else:
        bound = client.spec.timeout_secs
    if ctx.budget_at is not None:
        bound = min(bound, ctx.budget_at - time.monotonic())
    return max(bound, 0.0)
