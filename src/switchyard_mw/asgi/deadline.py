"""DeadlineMiddleware: a total bound on every upstream attempt, growing with the output cap.

The bound is the request's one timer (its exchange, `exchange.py`): it cancels the app's own
task (no task group: the app keeps its ContextVars), as `asyncio.timeout` does but with no new
timer per stream chunk, and from then on the app's `receive` says `http.disconnect`. An app
that listens for that in a task of its own when the time comes (Django, which cancels its view
only then) is told first and given `LISTENER_GRACE_SECS` to end its work itself: cancelling
the task first would leave the view running. Either way the client gets the expiry's answer.
A stream's `send` moves it: the response must start within `timeout_secs`, and then every
chunk re-arms it for `stream_idle_secs`. It is the one timer that decides an expiry: the
outbound call's own bounds (the forwarder's, `timeout_for`'s) are none or set past it, so that
every expiry is answered and counted as `deadline_exceeded` with its phase, never as an
upstream failure.
"""

from __future__ import annotations

from ..config import Server
from ..context import RequestContext
from ..engine.answers import DEADLINE_EXCEEDED
from ..engine.attempts import Limits
from ..errors import DeadlineExceededAfterStart as DeadlineExceededAfterStart
from ._base import PolicyMiddleware
from ._types import ASGIApp, Receive, Scope, Send
from .attempt_driver import arm_from
from .exchange import exchange_of

__all__ = ["DEADLINE_EXCEEDED", "DeadlineExceededAfterStart", "DeadlineMiddleware"]


class DeadlineMiddleware(PolicyMiddleware):
    """Bounds the app's work on each request as the deadline rule says.

    The limits come from the account the cooling policy chose (`ctx.account`) when there is one,
    else from this middleware's own `timeout_secs`, `stream_idle_secs` and `default_max_tokens`.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        timeout_secs: float = 60.0,
        stream_idle_secs: float = 60.0,
        default_max_tokens: int | None = None,
        server: Server | None = None,
    ) -> None:
        super().__init__(app, server=server)
        if timeout_secs <= 0 or stream_idle_secs <= 0:
            raise ValueError("timeout_secs and stream_idle_secs must be > 0")
        self.timeout_secs = timeout_secs
        self.stream_idle_secs = stream_idle_secs
        self.default_max_tokens = default_max_tokens

    async def handle(self, ctx: RequestContext, scope: Scope, receive: Receive, send: Send) -> None:
        ex = exchange_of(scope)
        if ctx.view is None or ex is None:
            return await self.app(scope, receive, send)
        # The account's limits when the cooling policy chose one, else this policy's own.
        limits: Limits = self if ctx.account is None else ctx.account.spec
        arm_from(ex, ctx, limits)
        await ex.run(self.app, scope, receive, send)
