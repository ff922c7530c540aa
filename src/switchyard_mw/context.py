"""The request-scoped context every switchyard middleware reads and writes.

The first switchyard middleware that sees a request creates it; the others find it in
`scope["state"]["switchyard"]`. Code deep inside the app reaches it through `current_context()`.
"""

from __future__ import annotations

import time
from collections.abc import MutableMapping, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from .core.variant_buckets import KeyKind
from .telemetry import names as tm
from .wire import RequestView, Wire, rewrite_model

if TYPE_CHECKING:
    from .accounts import Account


_current: ContextVar[RequestContext | None] = ContextVar("switchyard_context", default=None)


class RequestContext:
    """What switchyard decided about one request, and what the app reports back.

    Attributes the app reads: `view` (the parsed body, None when the request was not read),
    `requested_model`, `resolved_model`, `account` (the upstream account to call),
    `seconds_left` (for the outbound call), `attempts`, `route`.
    """

    __slots__ = (
        "_rewritten",
        "account",
        "attempt_deadline_secs",
        "attempts",
        "body",
        "budget_at",
        "cache_read_tokens",
        "cache_write_tokens",
        "deadline_at",
        "deadline_phase",
        "disconnected",
        "first_token_at",
        "headers",
        "input_tokens",
        "key_kind",
        "limit_headers",
        "output_tokens",
        "request_id",
        "resolved_model",
        "response_status",
        "route",
        "started_at",
        "stream_idle_secs",
        "tenant",
        "transport_error",
        "upstream_request_id",
        "upstream_status",
        "variant",
        "view",
    )

    request_id: str
    """The id the request's log records carry, made by its first record (the client's
    `x-request-id` when safe, see `headers`; else a new one): unset until then (most requests
    make none), so that a request pays nothing for it. The ext_proc front sets it at once,
    from the `x-request-id` Envoy gives every request."""
    headers: Sequence[tuple[bytes, bytes]]
    """The request's headers as the ASGI server gave them (set by the ASGI front), read only
    by a request's first record, for the client's `x-request-id`; unset elsewhere."""

    # Not keyword-only: the stack builds one per request, positionally (a call with keywords
    # builds a dict of them first).
    def __init__(
        self,
        view: RequestView | None = None,
        body: bytes | None = None,
        now: float | None = None,
    ) -> None:
        self.view = view
        """The parsed body (wire, model, output cap, stream, user key); None when not read."""
        self.body = body
        """The request body as the client sent it; `body_for_app()` has the routed model."""
        self.started_at = time.monotonic() if now is None else now
        """When switchyard first saw the request (monotonic seconds)."""
        self.resolved_model: str | None = view.model if view else None
        """The model the request goes to, after the judge, the canary split and any fallback."""
        self.account: Account | None = None
        """The account the current attempt calls (`name`, `base_url`, `url(path)`,
        `auth_headers()`); None when no account serves the model or no cooling policy runs."""
        self.attempts = 0
        """Upstream attempts so far, refused connections included."""
        self.attempt_deadline_secs: float | None = None
        """The current attempt's deadline in seconds (a stream: its time to start)."""
        self.deadline_at: float | None = None
        """When the current attempt's deadline ends (monotonic); `deadline` is what is left."""
        self.stream_idle_secs: float | None = None
        """A stream's limit on the silence between chunks, set by the deadline policy."""
        self.budget_at: float | None = None
        """When the request's budget (its budget headers) ends (monotonic); None: no budget."""
        self.route: str | None = None
        """For a judge route: `judge:<label>` or `fail_open:<reason>`; else None."""
        self.key_kind: KeyKind | None = None
        """What the canary split was keyed on: user id, first user turn, or none."""
        self.upstream_status: int | None = None
        """The real upstream status the app reported for the current attempt
        (`report_upstream`); None when it did not."""
        self.upstream_request_id: bytes | None = None
        """The provider's request id on the current attempt's answer (`request-id`,
        `x-request-id`, `x-amzn-requestid`); None when it sent none."""
        self.deadline_phase: str | None = None
        """Set when a deadline expired: `total`, `headers`, `first_token`, `idle`, `slow` or
        `budget`."""
        self.transport_error: type[BaseException] | None = None
        """The type of the transport error (refused, reset, stalled) the current attempt's
        upstream call raised: set by the client `make_http_client()` builds, or by the app
        through `report_transport_error`. Whatever error answer the app's framework then made
        of it is not the upstream's: switchyard fails over, or answers 502 itself."""
        self.disconnected = False
        """Set when the client left; the app's work has been cancelled."""
        self.input_tokens: int | None = None
        """Input tokens the app reported (`report_usage`); telemetry only."""
        self.output_tokens: int | None = None
        """Output tokens the app reported (`report_usage`); telemetry only."""
        self.cache_read_tokens: int | None = None
        """Of the input tokens, those the provider read from its prompt cache (`report_usage`);
        None: the answer did not say. Telemetry only."""
        self.cache_write_tokens: int | None = None
        """Of the input tokens, those the provider wrote to its prompt cache (`report_usage`)."""
        self.response_status: int | None = None
        """The status the client was answered with, once the response started."""
        self.variant: str | None = None
        """The model the canary split chose (None: no canary applied)."""
        self.first_token_at: float | None = None
        """Streams: when the first content chunk went to the client (monotonic)."""
        self.tenant: str | None = None
        """The configured name of the tenant asking (never a key); None without `[tenants]`.
        An app's own authentication names it before the stack decides with `name_tenant`."""
        self.limit_headers: tuple[tuple[bytes, bytes], ...] | None = None
        """The tenant's rate-limit headers, on the answer in place of the account's."""
        self._rewritten: tuple[str, bytes] | None = None

    @property
    def wire(self) -> Wire | None:
        """The request's wire format (Anthropic Messages, OpenAI Chat, OpenAI Responses or
        generic JSON); None when the body was not read."""
        return self.view.wire if self.view else None

    @property
    def requested_model(self) -> str | None:
        """The `model` the client asked for, before any judge, canary or fallback moved it
        (`resolved_model` is where the request goes); None when the body was not read."""
        return self.view.model if self.view else None

    @property
    def pinned_model(self) -> bool:
        """True when no fallback may move this conversation to another model.

        Signed thinking blocks bind to the model that wrote them; another model rejects them.
        """
        return bool(self.view and self.view.has_thinking)

    def canary_base(self) -> str | None:
        """The canary's base, which may take over when none of its variant's accounts can serve.

        Only the canary's own base (the requested model, when no judge routed the request),
        and never for a conversation whose signed thinking binds it to its model. The caller
        still checks that some account serves it.
        """
        requested = self.requested_model
        if (
            self.pinned_model
            or self.route is not None
            or requested is None
            or requested == self.resolved_model
        ):
            return None
        return requested

    @property
    def seconds_left(self) -> float | None:
        """Seconds left for the current upstream attempt (attempt deadline and budget), or None."""
        ends = [t for t in (self.deadline_at, self.budget_at) if t is not None]
        if not ends:
            return None
        return max(0.0, min(ends) - time.monotonic())

    def report_upstream(self, status: int) -> None:
        """Tell switchyard the real upstream status when the app answers the client another."""
        self.upstream_status = status

    def report_transport_error(self, exc: BaseException) -> None:
        """Tell switchyard the upstream call failed in transport (an app whose client is not
        `make_http_client()`'s): its 5xx answer is then taken as no upstream answer at all."""
        self.transport_error = type(exc)

    def report_usage(
        self,
        *,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        cache_read_tokens: int | None = None,
        cache_write_tokens: int | None = None,
    ) -> None:
        """Tell switchyard the tokens the upstream call used, for the request's span and
        metrics.

        Counts as the GenAI conventions mean them: input includes cached prompt tokens, those
        read from the provider's prompt cache (`cache_read_tokens`) and written to it
        (`cache_write_tokens`). A later report replaces an earlier one (the answer that
        reached the client wins).
        """
        self.input_tokens = input_tokens
        self.output_tokens = output_tokens
        self.cache_read_tokens = cache_read_tokens
        self.cache_write_tokens = cache_write_tokens

    def replace_body(self, body: bytes) -> None:
        """The request the next attempt sends is `body` (a resumed stream's continuation):
        `body_for_app()` rewrites its model as it did the client's."""
        self.body = body
        self._rewritten = None

    def body_for_app(self) -> bytes:
        """The request body with `model` set to the resolved model, in the name the current
        attempt's account knows it by (rewritten once per name: each attempt's own)."""
        if self.body is None:
            return b""
        view, model, account = self.view, self.resolved_model, self.account
        if account is not None and model is not None and account.model == model:
            model = account.provider_model
        if view is None or model is None or model == view.model:
            return self.body
        if self._rewritten is None or self._rewritten[0] != model:
            self._rewritten = (model, rewrite_model(self.body, model))
        return self._rewritten[1]


def decision_attributes(ctx: RequestContext) -> dict[str, str | int]:
    """What switchyard decided about a request, as attributes of its span (every transport)."""
    attributes: dict[str, str | int] = {}
    if ctx.view is not None:
        attributes[tm.REQUEST_MODEL] = ctx.view.model
        if ctx.view.max_tokens is not None:
            attributes[tm.REQUEST_MAX_TOKENS] = ctx.view.max_tokens
    if ctx.resolved_model is not None:
        attributes[tm.RESPONSE_MODEL] = ctx.resolved_model
    if ctx.account is not None:
        attributes[tm.ACCOUNT] = ctx.account.name
        if (provider := tm.provider_name(ctx.account.base_url)) is not None:
            attributes[tm.PROVIDER_NAME] = provider
    if ctx.attempts:
        attributes[tm.ATTEMPTS] = ctx.attempts
    if ctx.attempt_deadline_secs is not None:
        attributes[tm.DEADLINE_MS] = round(ctx.attempt_deadline_secs * 1000)
    if ctx.route is not None:
        attributes[tm.ROUTE] = ctx.route
    if ctx.key_kind is not None:
        attributes[tm.VARIANT_KEY_KIND] = ctx.key_kind
    if ctx.deadline_phase is not None:
        attributes[tm.DEADLINE_PHASE] = ctx.deadline_phase
    if ctx.tenant is not None:
        attributes[tm.TENANT] = ctx.tenant
    attributes.update(
        tm.usage_attributes(
            ctx.input_tokens, ctx.output_tokens, ctx.cache_read_tokens, ctx.cache_write_tokens
        )
    )
    return attributes


def context_of(scope: MutableMapping[str, Any]) -> RequestContext | None:
    """The context of an ASGI scope, if a switchyard middleware has seen the request."""
    state = scope.get("state")
    if state is None:
        return None
    ctx = state.get("switchyard")
    return ctx if isinstance(ctx, RequestContext) else None


TENANT_KEY = "switchyard.tenant"
"""Where `name_tenant` keeps the tenant in `scope["state"]` until the stack reads it."""


def name_tenant(scope: MutableMapping[str, Any], tenant: str) -> None:
    """Name the request's tenant from an app's own authentication, in a middleware outside
    `switchyard_stack`: the stack takes it as `ctx.tenant` before it decides, ahead of the
    tenant header and the client key (an unconfigured name is refused with a 401)."""
    scope.setdefault("state", {})[TENANT_KEY] = tenant


def current_context() -> RequestContext | None:
    """The context of the request this coroutine serves (set by the outermost middleware)."""
    return _current.get()


current_var = _current
