"""Tenants at request time: who is asking, may they use the model, and does the request fit
their limits. One decision, one place: both fronts ask this module and only translate.

    tenancy = Tenancy.build(config, store=build_limits(config.state))   # None: no [tenants]
    refusal = tenancy.check(ctx, named=..., header=read_header)   # None | Refusal (401, 403)
    ...the judge and the canary split place the request...
    admitted = await tenancy.admit_request(ctx)   # Admission | Refusal (429 and its headers)
    ...the attempts; every answer carries ctx.limit_headers...
    await tenancy.end_request(admitted, ctx, answered=...)   # settle, keep or release

(`identify`, `permit`, `admit` and `finish` are the same steps without a request context.)

Identification, in this order: a tenant the app's own authentication named (`ctx.tenant`);
the trusted `[server] tenant_header`; the client key (`x-api-key`, `Authorization: Bearer`),
whose SHA-256 is looked up (`core.tenant_keys`). Nothing here touches the store before a
tenant is known, so a flood of wrong keys costs a hash each and no write.

Admission reserves the request's worst case on every limit that applies (the tenant's, the
tenant's for the model, the deployment's `[[limits]]` for every model and for the model), all
or nothing (`state.limit_stores.LimitStore`): input tokens estimated from the body's bytes
(`core.limits.estimate_input_tokens`) plus the output cap (the request's `max_tokens`, else
the largest `default_max_tokens` of the accounts serving the model, else
`DEFAULT_OUTPUT_TOKENS`); one request; its worst-case price. At the end, `finish` replaces
the reservation by the answer's usage when it is known, keeps it when an answer started but
its usage never came (the provider may have billed it), and gives it back otherwise (nothing
reached a provider, or every attempt failed before an answer started).
"""

from __future__ import annotations

import datetime as dt
import fnmatch
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from ..config import Config
from ..config_tenants import Limit, Price, tenant_keys
from ..context import RequestContext
from ..core.limits import (
    Granted,
    LimitKey,
    Measure,
    Refused,
    Reservation,
    Status,
    estimate_input_tokens,
    window,
)
from ..core.tenant_keys import KeyIndex, client_key
from ..state.limit_stores import LimitStore
from ..telemetry import logs
from ..telemetry import names as tm
from ..wire import COUNT_TOKENS_PATH, Wire, WireError
from .fallbacks import Chains, Reason
from .usage import Tokens

__all__ = [
    "BUDGET_ROUTE",
    "DEFAULT_OUTPUT_TOKENS",
    "PROVIDER_RATE_LIMIT_HEADERS",
    "Admission",
    "Refusal",
    "Tenancy",
    "billed",
    "cost_usd",
    "limit_label",
    "openai_duration",
    "rate_limit_headers",
    "with_limits",
]

DEFAULT_OUTPUT_TOKENS = 4096
"""The output cap admission reserves for a request with no `max_tokens` on a model whose
accounts set no `default_max_tokens`. An answer longer than this is still charged what it
used when it settles; until then the limit holds less than it will."""

AUTHENTICATION_ERROR = "authentication_error"
PERMISSION_ERROR = "permission_error"
RATE_LIMIT_ERROR = "rate_limit_error"
BUDGET_ROUTE = "fallback:budget"
"""`x-switchyard-route` of a request a spent limit moved to the next model of its chain."""

Headers = tuple[tuple[bytes, bytes], ...]
_NO_RETRY: Headers = ((b"x-should-retry", b"false"),)
_MEASURE_NAMES = {Measure.TOKENS: "tokens", Measure.REQUESTS: "requests", Measure.USD: "usd"}


@dataclass(frozen=True, slots=True)
class Refusal:
    """An answer the front sends instead of any upstream call."""

    error: WireError
    headers: Headers
    limit: LimitKey | None = None
    """The limit that refused (a 429), for `switchyard.limit.refusals`."""


@dataclass(slots=True)
class Admission:
    """A request let in: what it holds until `Tenancy.finish`."""

    tenant: str
    model: str
    """The model it was reserved for (a budget fallback's, when it moved)."""
    reservation: Reservation | None
    """None: no limit applies to it (nothing held)."""
    statuses: Mapping[LimitKey, Status]
    reserved: Mapping[Measure, float]
    """The worst case per measure, as reserved."""
    input_estimate: int
    output_cap: int
    route: str | None = None
    """`fallback:budget` when a spent limit moved it to another model."""
    finished: bool = False
    """Settled, kept or released already: a second `finish` changes nothing."""

    def headers(self, wire: Wire) -> Headers:
        """The tenant's rate-limit headers for an answer on `wire`."""
        return rate_limit_headers(wire, self.statuses.items())


@dataclass(frozen=True, slots=True)
class _Rules:
    patterns: tuple[str, ...]
    limits: tuple[LimitKey, ...]


class Tenancy:
    """The tenant decisions of one config (a reload builds another; the store is kept)."""

    def __init__(
        self,
        *,
        keys: KeyIndex,
        rules: Mapping[str, _Rules],
        deployment: Iterable[LimitKey],
        prices: Mapping[str, Price],
        output_caps: Mapping[str, int],
        store: LimitStore,
        tenant_header: str | None = None,
        chains: Chains | None = None,
    ) -> None:
        self.keys = keys
        self.rules = dict(rules)
        self.deployment = tuple(deployment)
        self.prices = dict(prices)
        self.output_caps = dict(output_caps)
        self.store = store
        self.tenant_header = tenant_header
        self.chains = chains
        self._applies: dict[tuple[str, str], tuple[LimitKey, ...]] = {}
        self._allowed: dict[tuple[str, str], bool] = {}

    @classmethod
    def build(
        cls,
        config: Config,
        *,
        store: LimitStore,
        environ: Mapping[str, str] | None = None,
    ) -> Tenancy | None:
        """The tenancy of `config`; None without `[tenants]` (anyone may spend the keys)."""
        if not config.tenants:
            return None
        rules = {
            name: _Rules(tuple(t.models), tuple(_key(name, limit) for limit in t.limits))
            for name, t in config.tenants.items()
        }
        caps: dict[str, int] = {}
        for client in config.llm_clients.values():
            if client.default_max_tokens is None:
                continue
            for model in client.models:
                caps[model] = max(caps.get(model, 0), client.default_max_tokens)
        return cls(
            keys=KeyIndex(tenant_keys(config.tenants, environ)),
            rules=rules,
            deployment=(_key("", limit) for limit in config.limits),
            prices=config.prices,
            output_caps=caps,
            store=store,
            tenant_header=config.server.tenant_header,
            chains=Chains(config.fallbacks),
        )

    # Who is asking, and may they use the model: no store, no upstream.

    def identify(self, *, named: str | None, header: Callable[[str], str | None]) -> str | Refusal:
        """The tenant of a request: `named` (the app's own authentication), else the trusted
        tenant header, else the client key; `header(name)` reads a request header by its
        lower-case name. An unknown or missing one is a 401."""
        if named is not None:
            return named if named in self.rules else _unknown("the tenant named is not configured")
        if self.tenant_header is not None:
            given = header(self.tenant_header)
            if given is not None:
                given = given.strip()
                return given if given in self.rules else _unknown("unknown tenant")
        key = client_key(header)
        if key is None:
            return _unknown("no API key: send it in x-api-key or Authorization: Bearer")
        tenant = self.keys.tenant_for(key)
        return tenant if tenant is not None else _unknown("invalid API key")

    def permit(self, tenant: str, model: str) -> Refusal | None:
        """A 403 when `model` is outside the tenant's patterns; None when it may use it."""
        if self.allows(tenant, model):
            return None
        text = f"this API key may not use model {model!r}"
        return Refusal(WireError(403, PERMISSION_ERROR, text), ())

    def allows(self, tenant: str, model: str) -> bool:
        key = (tenant, model)
        found = self._allowed.get(key)
        if found is None:
            patterns = self.rules[tenant].patterns
            found = any(fnmatch.fnmatchcase(model, p) for p in patterns)
            if len(self._allowed) < 4096:  # bounded: a model name may be anything sent
                self._allowed[key] = found
        return found

    # Admission: reserve the worst case, all or nothing.

    def applying(self, tenant: str, model: str) -> tuple[LimitKey, ...]:
        """Every limit a request of `tenant` for `model` counts against."""
        key = (tenant, model)
        found = self._applies.get(key)
        if found is None:
            found = tuple(
                limit
                for limit in (*self.rules[tenant].limits, *self.deployment)
                if limit.model is None or limit.model == model
            )
            if len(self._applies) < 4096:  # bounded: a model name may be anything sent
                self._applies[key] = found
        return found

    def output_cap(self, model: str, max_tokens: int | None) -> int:
        """The output tokens a request may use at most: its `max_tokens`, else the largest
        `default_max_tokens` of the accounts serving the model, else `DEFAULT_OUTPUT_TOKENS`."""
        if max_tokens is not None:
            return max_tokens
        cap = self.output_caps.get(model, self.output_caps.get("*"))
        return DEFAULT_OUTPUT_TOKENS if cap is None else cap

    def worst_case(self, model: str, estimate: int, cap: int) -> dict[Measure, float]:
        """What a request of `estimate` input tokens and output cap `cap` may cost at most."""
        price = self.prices.get(model)
        usd = 0.0
        if price is not None:
            dearest = max(price.input, price.cache_read or 0.0, price.cache_write or 0.0)
            usd = (estimate * dearest + cap * price.output) / 1e6
        return {Measure.TOKENS: float(estimate + cap), Measure.REQUESTS: 1.0, Measure.USD: usd}

    async def admit(
        self,
        tenant: str,
        model: str,
        *,
        wire: Wire,
        body_bytes: int,
        max_tokens: int | None,
        pinned: bool | Callable[[], bool] = False,
    ) -> Admission | Refusal:
        """Reserve the request's worst case on every limit that applies; a spent limit of the
        model moves it down a `budget` chain (unless `pinned`: signed thinking binds it; a
        function is asked only then)."""
        estimate = estimate_input_tokens(body_bytes)
        first = await self._reserve(tenant, model, estimate, self.output_cap(model, max_tokens))
        if isinstance(first, Admission):
            return first
        chains = self.chains
        if (
            first.limit.model is not None
            and chains is not None
            and chains.has(model, Reason.BUDGET)
            and not (pinned() if callable(pinned) else pinned)
        ):
            for other in chains.after(model, Reason.BUDGET):
                if not self.allows(tenant, other):
                    continue
                cap = self.output_cap(other, max_tokens)
                outcome = await self._reserve(tenant, other, estimate, cap)
                if isinstance(outcome, Admission):
                    outcome.route = BUDGET_ROUTE
                    budget = Reason.BUDGET.value
                    tm.fallbacks.add(
                        1, {tm.REQUEST_MODEL: model, tm.RESPONSE_MODEL: other, "reason": budget}
                    )
                    logs.fallback(from_model=model, to_model=other, reason=budget)
                    return outcome
                if outcome.limit.model is None:
                    break  # a limit of every model: no other model fits either
        label = limit_label(first.limit)
        retry = None if first.never else first.retry_after_secs
        logs.limit_refused(tenant=tenant, limit=label, model=model, retry_after_secs=retry)
        tm.limit_refusals.add(1, {tm.TENANT: tenant, "limit": label})
        return _refused(wire, first)

    async def _reserve(
        self, tenant: str, model: str, estimate: int, cap: int
    ) -> Admission | Refused:
        worst = self.worst_case(model, estimate, cap)
        limits = self.applying(tenant, model)
        if not limits:
            return Admission(tenant, model, None, {}, worst, estimate, cap)
        asks = {limit: worst[limit.measure] for limit in limits}
        outcome = await self.store.reserve(asks)
        if isinstance(outcome, Granted):
            reservation, statuses = outcome.reservation, outcome.statuses
            return Admission(tenant, model, reservation, statuses, worst, estimate, cap)
        return outcome

    # The end: settle, keep or release.

    def charge(self, admission: Admission, tokens: Tokens) -> dict[Measure, float]:
        """What a request that reported `tokens` used, per measure. A count the answer left
        out is taken at its worst case (a stream cut before its final usage event)."""
        used = Tokens(
            admission.input_estimate if tokens.input is None else tokens.input,
            admission.output_cap if tokens.output is None else tokens.output,
            tokens.cache_read,
            tokens.cache_write,
        )
        assert used.input is not None
        assert used.output is not None
        return {
            Measure.TOKENS: float(used.input + used.output),
            Measure.REQUESTS: 1.0,
            Measure.USD: cost_usd(self.prices.get(admission.model), used) or 0.0,
        }

    async def finish(
        self, admission: Admission, *, usage: Tokens | None, answered: bool
    ) -> dict[Measure, float] | None:
        """End the request's hold once: its usage replaces the reservation (returned); an
        answer that started without usage keeps the reservation (returned); otherwise it is
        given back (None)."""
        if admission.finished:
            return None
        admission.finished = True
        reservation = admission.reservation
        if usage is not None and (usage.input is not None or usage.output is not None):
            used = self.charge(admission, usage)
        elif answered:
            used = dict(admission.reserved)
        else:
            if reservation is not None:
                await self.store.release(reservation)
            return None
        if reservation is not None:
            await self.store.settle(reservation, used)
        if usage is not None and admission.model in self.prices:
            usd, tenant, model = used[Measure.USD], admission.tenant, admission.model
            tm.cost.add(usd, {tm.TENANT: tenant, tm.RESPONSE_MODEL: model})
        return used

    # A request's context, as both fronts hold it: the calls they make.

    def check(
        self, ctx: RequestContext, *, named: str | None, header: Callable[[str], str | None]
    ) -> Refusal | None:
        """Name the request's tenant on `ctx` and check the model it asked for: the refusal
        (401, 403) otherwise. No store and no upstream are touched."""
        view = ctx.view
        assert view is not None
        who = self.identify(named=named, header=header)
        if isinstance(who, Refusal):
            return who
        ctx.tenant = who
        return self.permit(who, view.model)

    async def admit_request(self, ctx: RequestContext) -> Admission | Refusal:
        """Reserve the request's worst case for the model it was routed to; a budget fallback
        moves it (`ctx.resolved_model`, `ctx.route`); `ctx.limit_headers` for its answer."""
        view = ctx.view
        assert view is not None
        assert ctx.tenant is not None
        outcome = await self.admit(
            ctx.tenant,
            ctx.resolved_model or view.model,
            wire=view.wire,
            body_bytes=len(ctx.body or b""),
            max_tokens=view.max_tokens,
            pinned=lambda: ctx.pinned_model,
        )
        if isinstance(outcome, Admission):
            if outcome.route is not None:
                ctx.resolved_model, ctx.route = outcome.model, outcome.route
            ctx.limit_headers = outcome.headers(view.wire)
        return outcome

    async def end_request(
        self, admission: Admission, ctx: RequestContext, *, answered: bool
    ) -> dict[Measure, float] | None:
        """`finish` with the usage the request reported (`ctx.report_usage`); `answered`: a
        provider's successful answer started reaching the client."""
        usage = None
        if ctx.input_tokens is not None or ctx.output_tokens is not None:
            usage = Tokens(
                ctx.input_tokens, ctx.output_tokens, ctx.cache_read_tokens, ctx.cache_write_tokens
            )
        return await self.finish(admission, usage=usage, answered=answered)

    def status(self) -> dict[str, list[dict[str, object]]]:
        """Each tenant's limits (and the deployment's, under `""`) as this process knows them:
        for `GET /switchyard/tenants`."""
        shown: dict[str, list[dict[str, object]]] = {}
        now = time.time()
        for name, limits in [
            *((n, r.limits) for n, r in self.rules.items()),
            ("", self.deployment),
        ]:
            rows: list[dict[str, object]] = []
            for limit in limits:
                used = self.store.used(limit)
                rows.append(
                    {
                        _MEASURE_NAMES[limit.measure]: limit.amount,
                        "per": limit.per,
                        "model": limit.model,
                        "used": round(used, 6),
                        "remaining": round(max(0.0, limit.amount - used), 6),
                        "resets_in_secs": round(window(limit.per, now)[1] - now, 3),
                    }
                )
            if name or rows:
                shown[name] = rows
        return shown


def billed(path: str) -> bool:
    """Whether a call on `path` is one the providers bill: not a token count
    (`/v1/messages/count_tokens`, free and limited apart), which is identified and permitted
    like any call but reserves nothing."""
    return not path.endswith(COUNT_TOKENS_PATH)


def limit_label(limit: LimitKey) -> str:
    """A limit as the `limit` label of `switchyard.limit.refusals` names it:
    `tokens/minute`, `tokens/minute/claude-opus-5`, `deployment:usd/month`."""
    text = f"{_MEASURE_NAMES[limit.measure]}/{limit.per}"
    if limit.model is not None:
        text += f"/{limit.model}"
    return text if limit.scope else f"deployment:{text}"


def _key(scope: str, limit: Limit) -> LimitKey:
    measure = limit.measure()
    assert measure is not None  # check-config refused a limit without exactly one
    return LimitKey(scope, Measure(measure), limit.per, limit.amount(), limit.model)


def _unknown(text: str) -> Refusal:
    return Refusal(WireError(401, AUTHENTICATION_ERROR, text), _NO_RETRY)


def _refused(wire: Wire, refused: Refused) -> Refusal:
    limit = refused.limit
    what = _MEASURE_NAMES[limit.measure]
    whose = "the deployment's" if not limit.scope else "the tenant's"
    model = "" if limit.model is None else f" for model {limit.model!r}"
    text = f"{whose} limit of {limit.amount:g} {what} per {limit.per}{model} is reached"
    headers = rate_limit_headers(wire, [(limit, refused.status)])
    if refused.never:
        text = (
            f"the request's worst case exceeds {whose} limit of {limit.amount:g} {what} per "
            f"{limit.per}{model}: no wait admits it (lower max_tokens or the prompt)"
        )
        return Refusal(WireError(429, RATE_LIMIT_ERROR, text), (*headers, *_NO_RETRY), limit)
    retry = str(max(1, math.ceil(refused.retry_after_secs))).encode()
    return Refusal(
        WireError(429, RATE_LIMIT_ERROR, text), ((b"retry-after", retry), *headers), limit
    )


def cost_usd(price: Price | None, tokens: Tokens) -> float | None:
    """What `tokens` cost at `price` (None: unpriced). Input counts cached tokens too, as the
    GenAI conventions do: those read from or written to the prompt cache go at their prices."""
    if price is None:
        return None
    cache_read = tokens.cache_read or 0
    cache_write = tokens.cache_write or 0
    plain = max(0, (tokens.input or 0) - cache_read - cache_write)
    read_price = price.input if price.cache_read is None else price.cache_read
    write_price = price.input if price.cache_write is None else price.cache_write
    return (
        plain * price.input
        + cache_read * read_price
        + cache_write * write_price
        + (tokens.output or 0) * price.output
    ) / 1e6


_NAMES: dict[tuple[bool, Measure], tuple[bytes, bytes, bytes]] = {
    (anthropic, measure): tuple(  # type: ignore[misc]
        (
            f"anthropic-ratelimit-{_MEASURE_NAMES[measure]}-{part}"
            if anthropic
            else f"x-ratelimit-{part}-{_MEASURE_NAMES[measure]}"
        ).encode()
        for part in ("limit", "remaining", "reset")
    )
    for anthropic in (False, True)
    for measure in (Measure.REQUESTS, Measure.TOKENS)
}
"""The header names per wire kind (Anthropic's or OpenAI's) and measure: limit, remaining,
reset."""


def rate_limit_headers(wire: Wire, statuses: Iterable[tuple[LimitKey, Status]]) -> Headers:
    """The providers' own rate-limit headers for the tightest limit of tokens and of requests:
    OpenAI's `x-ratelimit-*` (reset as a duration, "6m0s") or Anthropic's
    `anthropic-ratelimit-*` (reset as an RFC 3339 time) on Messages."""
    requests: Status | None = None
    tokens: Status | None = None
    for limit, status in statuses:  # the tightest: least remaining, then soonest reset
        if limit.measure is _REQUESTS:
            if requests is None or (status.remaining, status.reset_secs) < (
                requests.remaining,
                requests.reset_secs,
            ):
                requests = status
        elif limit.measure is _TOKENS and (
            tokens is None
            or (status.remaining, status.reset_secs) < (tokens.remaining, tokens.reset_secs)
        ):
            tokens = status
    anthropic = wire.anthropic_style
    out: list[tuple[bytes, bytes]] = []
    for measure, tightest in ((_REQUESTS, requests), (_TOKENS, tokens)):
        if tightest is None:
            continue
        limit_name, remaining_name, reset_name = _NAMES[anthropic, measure]
        secs = tightest.reset_secs
        reset = _rfc3339(secs) if anthropic else openai_duration(secs)
        out += (
            (limit_name, b"%d" % tightest.limit),
            (remaining_name, b"%d" % tightest.remaining),
            (reset_name, reset.encode()),
        )
    return tuple(out)


_REQUESTS, _TOKENS = Measure.REQUESTS, Measure.TOKENS


PROVIDER_RATE_LIMIT_HEADERS = tuple(
    [
        f"x-ratelimit-{p}-{m}"
        for m in ("requests", "tokens")
        for p in ("limit", "remaining", "reset")
    ]
    + [
        f"anthropic-ratelimit-{m}-{p}"
        for m in ("requests", "tokens", "input-tokens", "output-tokens")
        for p in ("limit", "remaining", "reset")
    ]
)
"""The providers' rate-limit headers by name (for a front that removes them by name)."""
RATE_LIMIT_PREFIXES = (b"x-ratelimit-", b"anthropic-ratelimit-")
"""The upstream account's own rate-limit headers start so: with tenants, the tenant's replace
them (the account's say nothing the client may act on, and name the account's quota)."""


def with_limits(
    headers: Iterable[tuple[bytes, bytes]], limits: Headers
) -> list[tuple[bytes, bytes]]:
    """An answer's headers with the tenant's rate-limit headers in place of the account's."""
    kept = [(k, v) for k, v in headers if not k.lower().startswith(RATE_LIMIT_PREFIXES)]
    return [*kept, *limits]


def openai_duration(secs: float) -> str:
    """A wait as OpenAI's `x-ratelimit-reset-*` headers write it: "1s", "6m0s", "1h2m3s",
    "250ms", "2.5s"."""
    ms = max(0, math.ceil(secs * 1000))
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    seconds = f"{rest / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{seconds}"
    if minutes:
        return f"{minutes}m{seconds}"
    return seconds


def _rfc3339(secs: float) -> str:
    """The time `secs` from now, to the whole second up (windows end on whole seconds)."""
    at = math.ceil(time.time() + secs)
    text = _RFC3339.get(at)
    if text is None:
        if len(_RFC3339) > 64:
            _RFC3339.clear()
        text = dt.datetime.fromtimestamp(at, tz=dt.UTC).isoformat().replace("+00:00", "Z")
        _RFC3339[at] = text
    return text


_RFC3339: dict[int, str] = {}
"""The few reset times written recently (most answers name one of the same few window ends)."""
