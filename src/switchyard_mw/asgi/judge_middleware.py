"""JudgeMiddleware: an LLM judge picks the model of a route, and never makes a request wait long.

The consultation itself (one deadline over the whole call, fail-open reasons, the pin cache of
conversations carrying signed thinking) lives in `switchyard_mw.engine.judge`, shared with the
ext_proc servicer; this middleware only maps it onto the request context.
"""

from __future__ import annotations

from collections.abc import Mapping

import httpx

from ..accounts import Account, build_accounts
from ..config import ConfigSource, Route, Server, as_config
from ..context import RequestContext
from ..engine.judge import JUDGE_PATH, MAX_VERDICT_BYTES, Judge
from ..engine.policies import Engine, judge_model
from ._base import PolicyMiddleware
from ._types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["JUDGE_PATH", "MAX_VERDICT_BYTES", "JudgeMiddleware"]


class JudgeMiddleware(PolicyMiddleware):
    """For requests whose model names a route, asks the route's judge which model to call.

    Alone, build it from the config (a `Config` or the path of its TOML file), as any
    framework adds a middleware: `app.add_middleware(JudgeMiddleware, config="s.toml")`; its
    `[routes]` and `[llm_clients]` (keys read from `environ`, default `os.environ`, now).
    Or pass `routes` (a requested model name -> its `Route`) and `accounts` (every account a
    route's `judge` names) instead of `config`.

    Pass `http_client` to share a connection pool; otherwise the middleware builds its own on
    first use and closes it on ASGI lifespan shutdown or `aclose()` (whoever passes a client
    closes it). Requests for any other model pass straight through. `engine` (instead of
    all of these) is how `SwitchyardStack` hands in the judge it built.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        config: ConfigSource | None = None,
        environ: Mapping[str, str] | None = None,
        routes: Mapping[str, Route] | None = None,
        accounts: Mapping[str, Account] | None = None,
        http_client: httpx.AsyncClient | None = None,
        server: Server | None = None,
        engine: Engine | None = None,
    ) -> None:
        if engine is not None:
            if engine.judge is None:
                raise TypeError("JudgeMiddleware needs an engine with a judge")
            super().__init__(app, server=server)
            self.judge = engine.judge
            return
        if config is not None:
            if routes is not None or accounts is not None:
                raise TypeError("JudgeMiddleware takes config or routes and accounts, not both")
            loaded = as_config(config)
            routes, accounts = loaded.routes, build_accounts(loaded, environ)
            server = server or loaded.server
        elif routes is None or accounts is None:
            raise TypeError("JudgeMiddleware needs config (or routes and accounts)")
        super().__init__(app, server=server)
        self.judge = Judge(routes=routes, accounts=accounts, http_client=http_client)

    @property
    def _routes(self) -> dict[str, Route]:
        return self.judge.routes

    @property
    def _http(self) -> httpx.AsyncClient | None:
        return self.judge.http

    async def aclose(self) -> None:
        """Close the judge's connection pool if this middleware built it."""
        await self.judge.aclose()

    async def other(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" and self.judge.owns_http:
            # The messages pass unchanged; the pool closes just before shutdown completes.
            async def send_closing(message: Message) -> None:
                if message["type"] == "lifespan.shutdown.complete":
                    await self.aclose()
                await send(message)

            return await self.app(scope, receive, send_closing)
        await self.app(scope, receive, send)

    async def handle(self, ctx: RequestContext, scope: Scope, receive: Receive, send: Send) -> None:
        if self.applies(ctx):
            await self.route(ctx)
        await self.app(scope, receive, send)

    def applies(self, ctx: RequestContext) -> bool:
        """Whether the request's model names a route: only then is there a choice to make."""
        return self.judge.applies(ctx.view)

    async def route(self, ctx: RequestContext) -> None:
        """The judge's choice for a request it `applies` to; nothing for any other."""
        await judge_model(self.judge, ctx, gone=lambda: ctx.disconnected)
