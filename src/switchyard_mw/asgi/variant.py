"""VariantMiddleware: canary rollouts where a conversation never switches model mid-way."""

from __future__ import annotations

from collections.abc import Mapping

from ..config import Canary, ConfigSource, Server, as_config
from ..context import RequestContext
from ..core.clock import Clock, monotonic
from ..engine.policies import Engine
from ..engine.variants import Canaries
from ._base import PolicyMiddleware
from ._types import ASGIApp, Receive, Scope, Send


class VariantMiddleware(PolicyMiddleware):
    """Moves a configured share of each canaried model's conversations to its variants.

    The split key is the user id, else the conversation's first user turn, so every turn of a
    conversation lands on the same variant; the app receives the body with `model` rewritten.
    Requests for models without a canary pass with no rewrite.

    Alone, build it from the config (a `Config` or the path of its TOML file) and it reads
    `[canaries]`, or pass `canaries` itself (or the `engine` whose canaries they are, as
    `SwitchyardStack` does).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        config: ConfigSource | None = None,
        canaries: Mapping[str, Canary] | None = None,
        server: Server | None = None,
        clock: Clock = monotonic,
        engine: Engine | None = None,
    ) -> None:
        if engine is not None:
            if engine.canaries is None:
                raise TypeError("VariantMiddleware needs an engine with canaries")
            super().__init__(app, server=server)
            self.canaries = engine.canaries
            return
        if config is not None:
            if canaries is not None:
                raise TypeError("VariantMiddleware takes config or canaries, not both")
            loaded = as_config(config)
            canaries, server = loaded.canaries, server or loaded.server
        elif canaries is None:
            raise TypeError("VariantMiddleware needs config (or canaries)")
        super().__init__(app, server=server)
        self.canaries = Canaries.from_config(canaries, clock=clock)
        """The splits and their guards (`record` them every attempt's outcome to guard)."""

    async def handle(self, ctx: RequestContext, scope: Scope, receive: Receive, send: Send) -> None:
        self.assign(ctx)
        await self.app(scope, receive, send)

    def assign(self, ctx: RequestContext) -> None:
        """Move the request to its variant when its model has a canary."""
        self.canaries.assign(ctx)
