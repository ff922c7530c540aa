"""VariantMiddleware: canary rollouts where a conversation never switches model mid-way."""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import trace

from .. import telemetry as tm
from ..config import Canary, Server
from ..context import RequestContext
from ..core.variants import Split
from ._base import PolicyMiddleware
from ._types import ASGIApp, Receive, Scope, Send


def build_splits(canaries: Mapping[str, Canary]) -> dict[str, Split]:
    return {
        model: Split.build(model, list(canary.variants.items()), canary.salt)
        for model, canary in canaries.items()
    }


class VariantMiddleware(PolicyMiddleware):
    """Moves a configured share of each canaried model's conversations to its variants.

    The split key is the user id, else the conversation's first user turn, so every turn of a
    conversation lands on the same variant; the app receives the body with `model` rewritten.
    Requests for models without a canary pass with no rewrite.
    """

    def __init__(
        self, app: ASGIApp, *, canaries: Mapping[str, Canary], server: Server | None = None
    ) -> None:
        super().__init__(app, server=server)
        self._splits = build_splits(canaries)

    async def handle(self, ctx: RequestContext, scope: Scope, receive: Receive, send: Send) -> None:
        self.assign(ctx)
        await self.app(scope, receive, send)

    def assign(self, ctx: RequestContext) -> None:
        """Move the request to its variant when its model has a canary."""
        model = ctx.resolved_model
        split = self._splits.get(model) if model is not None else None
        if split is not None and ctx.view is not None:
            view = ctx.view
            # A user id decides alone: the first turn is hashed only when there is none.
            turn = None if view.user_key else view.first_turn_hash
            chosen, kind = split.choose(view.user_key, turn)
            ctx.resolved_model = chosen
            ctx.key_kind = kind
            tm.variant_assignments.add(split.base, chosen, kind)
            if view.user_key and tm.tracing() and (span := trace.get_current_span()).is_recording():
                span.set_attribute(tm.VARIANT_KEY_HASH, tm.short_hash(view.user_key))
