"""Hedged first tokens through both fronts make the same decisions (the comparison of
test_two_fronts.py, for a stream whose first content is slower than its hedge time).

`a` (preferred) and `b` serve `m`, both hedging after `HEDGE_SECS` without content. Both fronts
send every try to the mock provider in process, whose answer comes whole (an in-process
transport reads the body to its end): an answer held `LATE_SECS` before its first content
comes at that time, headers and all.

- The ASGI front runs the whole stack around the gateway's forwarding app (`gateway.Forwarder`);
  its race (`asgi/hedge.py`) starts the hedge at the hedge time.
- The ext_proc front runs with `[server] envoy_hedge = true` and is driven as Envoy drives the
  example's hedge route (`extproc/hedge_tries.py`; the live proof is
  tests/extproc/test_envoy_hedge_live.py): the router-level stream marks the request
  `x-switchyard-hedge` and sets the per-try timeout to the hedge time; each try has the hedged
  refusal filter's stream and the hedged first-token filter's stream, both told the try's
  `x-envoy-attempt-count`; a try that has not released its headers to the router by the
  per-try timeout gets a second try beside it, whose request goes through the retry filter
  (which gives it the hedge's account, or makes it void); the first try whose headers reach
  the router is the answer, and Envoy resets the other.

What must match: as test_two_fronts.py (status, `x-switchyard-*`, attempt and CLIENT spans, the
(key, model) each provider got), and the `switchyard.hedges` counts and each account's faults.

Where the fronts differ for a reason of the front, kept explicit:

- With no hedge budget, Envoy still sends the second try (its `hedge_policy` asks no one): the
  processor makes it *void*, with neither credential nor prompt, and holds its refusal. The
  ASGI front sends nothing. The void try is left out of `sent` and checked on its own: it
  reached the provider with no key and no prompt.
- Only streams are hedged under Envoy (the race needs the first-token filter holding each
  try's headers); the ASGI front also hedges a JSON answer (tests/asgi/test_hedge.py). Every
  scenario here is a stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import httpx
import msgspec
import pytest
from machine_moves import machine_moves  # noqa: F401 (autouse: each move is a row)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import Metrics
from extproc_helpers import (
    Pushed,
    Stream,
    request_body,
    request_headers,
    response_body,
    response_headers,
    sets,
    upstream_headers,
)
from switchyard_mw import switchyard_stack
from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.core.pool import AccountPool
from switchyard_mw.extproc import ExtProcServicer, Policies
from switchyard_mw.extproc.policy import HEDGE_HEADER
from switchyard_mw.telemetry import names as tm
from switchyard_mw.testing import Behaviour, MockProvider
from two_fronts import (
    Answer,
    Decisions,
    Outgoing,
    attempt_spans,
    client_spans,
    decoded,
    kept_headers,
    send_upstream,
)

pytest.importorskip("aiohttp")
from switchyard_mw.gateway import Forwarder

HEDGE_SECS = 0.2
LATE_SECS = 1.5
"""A first try this late to content is hedged long before it answers."""
ENV = {"KEY_A": "ka", "KEY_B": "kb"}
RID = "rid-two-fronts-hedge"
BODY = msgspec.json.encode(
    {
        "model": "m",
        "max_tokens": 8,
        "stream": True,
        "messages": [{"role": "user", "content": "hedge me"}],
    }
)
CONFIG = "".join(
    f"""
[llm_clients.{name}]
base_url = "https://api.anthropic.com"
api_key_env = "KEY_{name.upper()}"
auth = "x-api-key"
models = ["m"]
priority = {i}
failure_threshold = 1
cooldown_secs = 30
first_token_secs = 10
hedge_after_secs = {HEDGE_SECS}
envoy_cluster = "prov"
"""
    for i, name in enumerate("ab")
)
LATE = Behaviour(stall_after_chunks=0, body_stall_secs=LATE_SECS)
"""Headers and the opening events at once, the first content event `LATE_SECS` later."""
RESULTS = ("won", "lost", "refused")


def server(ratio: float) -> str:
    return f"[server]\nenvoy_hedge = true\nhedge_max_ratio = {ratio}\n"


@dataclass(frozen=True)
class Scenario:
    upstream: Mapping[str, Behaviour]
    """How each account's key answers."""
    served: str
    """The account whose answer the client gets."""
    hedged: dict[str, int] = field(default_factory=dict)
    """`switchyard.hedges` counted, by result."""
    ratio: float = 1.0
    """`hedge_max_ratio`: 0 leaves no hedge budget."""


SCENARIOS = {
    "a slow first token is hedged, and the hedge wins": Scenario(
        {"ka": LATE, "kb": Behaviour()}, "b", {"won": 1}
    ),
    "a first token in time is not hedged": Scenario({"ka": Behaviour(), "kb": Behaviour()}, "a"),
    "the hedge refused (503) loses, the first try answers": Scenario(
        {"ka": Behaviour(stall_after_chunks=0, body_stall_secs=0.6), "kb": Behaviour(status=503)},
        "a",
        {"lost": 1},
    ),
    "the first try refused (503) during the race leaves the hedge": Scenario(
        {
            "ka": Behaviour(status=503, headers_delay_secs=HEDGE_SECS * 2),
            "kb": Behaviour(stall_after_chunks=0, body_stall_secs=0.6),
        },
        "b",
        {"won": 1},
    ),
    "no hedge budget: the first try is waited for": Scenario(
        {"ka": Behaviour(stall_after_chunks=0, body_stall_secs=0.6), "kb": Behaviour()},
        "a",
        {"refused": 1},
        ratio=0.0,
    ),
}


@dataclass
class Seen(Decisions):
    """`Decisions`, and what a hedge changes besides."""

    hedges: dict[str, float] = field(default_factory=dict)
    """`switchyard.hedges` counted during the request, by result."""
    faults: dict[str, int] = field(default_factory=dict)
    """Each account's consecutive faults after the request."""
    void: list[tuple[str, bytes]] = field(default_factory=list)
    """(key, body) of each try that went out void (Envoy only: see the module)."""


def _mock(scenario: Scenario) -> MockProvider:
    mock = MockProvider()
    for key, behaviour in scenario.upstream.items():
        mock.set_behaviour(key, behaviour)
    return mock


def _counts(metrics: Metrics) -> dict[str, float]:
    return {r: metrics.value(tm.HEDGES, **{tm.RESPONSE_MODEL: "m", "result": r}) for r in RESULTS}


def _seen(
    decisions: Decisions,
    before: dict[str, float],
    metrics: Metrics,
    pool: AccountPool,
    mock: MockProvider,
) -> Seen:
    after = _counts(metrics)
    requests = list(mock.requests)
    return Seen(
        **vars(decisions),
        hedges={r: after[r] - before[r] for r in RESULTS if after[r] != before[r]},
        faults={name: pool.status_of(name).consecutive_faults for name in "ab"},
        void=[(r.key, r.body) for r in requests if r.model is None],
    )


def _sent(mock: MockProvider) -> list[tuple[str, str]]:
    """(key, model) of each request with a prompt the mock got, in the order it got them."""
    return [(r.key, r.model) for r in mock.requests if r.model is not None]


def _text(body: bytes) -> str:
    """The text of an Anthropic event stream's deltas."""
    text = ""
    for line in body.decode().splitlines():
        if line.startswith("data: ") and "text_delta" in line:
            text += msgspec.json.decode(line[6:])["delta"]["text"]
    return text


# --- the ASGI front ------------------------------------------------------------------------


async def through_asgi(
    scenario: Scenario, spans: InMemorySpanExporter, metrics: Metrics
) -> tuple[Seen, str]:
    mock = _mock(scenario)
    upstream = httpx.AsyncClient(transport=httpx.ASGITransport(app=mock))
    config = parse_config(server(scenario.ratio) + CONFIG)
    stack = switchyard_stack(Forwarder(upstream), config=config, environ=ENV)
    spans.clear()
    before = _counts(metrics)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=stack), base_url="http://gw.test"
    ) as client:
        reply = await client.post(
            "/v1/messages", content=BODY, headers={"content-type": "application/json"}
        )
    await stack.aclose()
    await upstream.aclose()
    decisions = Decisions(
        status=reply.status_code,
        headers=kept_headers(reply.headers),
        attempts=attempt_spans(spans),
        calls=client_spans(spans),
        sent=_sent(mock),
    )
    return _seen(decisions, before, metrics, stack.pool, mock), _text(reply.content)


# --- the ext_proc front, driven as Envoy drives the hedge route ----------------------------

RETRY_FILTER = [("x-switchyard-filter", "upstream")]
REFUSAL_FILTER = [("x-switchyard-filter", "upstream-hedged")]
"""The hedged variant of the refusal filter (it sees each try's request headers)."""
PER_TRY = "x-envoy-upstream-rq-per-try-timeout-ms"


def _refused(status: int) -> bool:
    """Whether envoy.yaml's matcher sends an answer of `status` to the refusal filter."""
    return status in (400, 401, 402, 403, 429) or status >= 500


@dataclass
class _Try:
    """One of Envoy's tries of the request: its upstream-level streams and its fate."""

    number: int
    refusal: Stream
    first_token: Pushed
    answer: Answer | None = None
    retry: bool = False
    """Its answer asks Envoy for a retry (`x-switchyard-retry`)."""

    async def reset(self) -> None:
        """Envoy resets the try: its filters' streams end."""
        await self.first_token.close()
        await self.refusal.close()


async def _try(
    servicer: ExtProcServicer,
    upstream: httpx.AsyncClient,
    routed: Outgoing,
    number: int,
    tries: list[_Try],
) -> _Try:
    """Try `number`: its request through the upstream chain, sent to the provider, and its
    answer back through it; it returns when its headers reach the router (it never does when
    the processor holds them: Envoy resets it for the other try)."""
    named = {"x-request-id": RID}
    out = Outgoing(dict(routed.headers), routed.body)
    refusal = Stream(servicer, REFUSAL_FILTER)
    await refusal.send(upstream_headers(named, attempt=number))
    if number > 1:  # the retry filter: the hedge's account, its credential and body
        retry = Stream(servicer, RETRY_FILTER)
        out.apply(await retry.send(upstream_headers(named, attempt=number)))
        out.apply(await retry.send(request_body(out.body)))
        await retry.close()
    first_token = Pushed(servicer)
    await first_token.inbox.put(upstream_headers(named, attempt=number))
    await first_token.next()
    this = _Try(number, refusal, first_token)
    tries.append(this)
    answer = this.answer = await send_upstream(upstream, out)
    streams = answer.headers.get("content-type", "").startswith("text/event-stream")
    if answer.status < 300 and streams:
        await first_token.inbox.put(response_headers(200, answer.headers, request_id=RID))
        await first_token.inbox.put(response_body(answer.body, end=True))
        released = await first_token.next(within=30.0)  # held while the try loses
        this.retry = sets(released).get("x-switchyard-retry") == b"1"
        return this
    if _refused(answer.status):
        extra = {k: v for k, v in answer.headers.items() if k == "retry-after"}
        reply = await refusal.send(response_headers(answer.status, extra, request_id=RID))
        if reply.HasField("override_message_timeout"):  # held until Envoy resets it
            await asyncio.Event().wait()
        if reply.HasField("mode_override"):  # a 400 or 429 to read
            reply = await refusal.send(response_body(answer.body, end=True))
        this.retry = sets(reply).get("x-switchyard-retry") == b"1"
    return this


async def _race(
    servicer: ExtProcServicer, upstream: httpx.AsyncClient, routed: Outgoing, per_try: float
) -> tuple[_Try, list[_Try]]:
    """Envoy's tries of a request on the hedge route: the first; at its per-try timeout
    without headers, the hedge beside it; the first try whose headers reach the router is
    the answer, the other is reset. A retry mark with the route's one retry left starts the
    next try (a first try refused before the hedge time)."""
    tries: list[_Try] = []
    running = {asyncio.ensure_future(_try(servicer, upstream, routed, 1, tries))}
    started, hedge_at = 1, per_try
    try:
        while True:
            done, running = await asyncio.wait(
                running, timeout=hedge_at, return_when=asyncio.FIRST_COMPLETED
            )
            if not done:  # the per-try timeout, no headers yet: the hedge
                started, hedge_at = started + 1, None
                running.add(asyncio.ensure_future(_try(servicer, upstream, routed, 2, tries)))
                continue
            first = done.pop().result()
            if first.retry and started == 1:  # the route's one retry, before any hedge
                started, hedge_at = 2, None
                running.add(asyncio.ensure_future(_try(servicer, upstream, routed, 2, tries)))
                continue
            return first, tries
    finally:
        for task in running:  # Envoy resets the other try
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for each in tries:
            await each.reset()


async def through_extproc(
    scenario: Scenario, spans: InMemorySpanExporter, metrics: Metrics
) -> tuple[Seen, str]:
    config = parse_config(server(scenario.ratio) + CONFIG)
    policies = Policies(config, build_accounts(config, ENV))
    servicer = ExtProcServicer(policies)
    mock = _mock(scenario)
    spans.clear()
    before = _counts(metrics)
    router = Stream(servicer)
    client = {"content-type": "application/json"}
    await router.send(request_headers(extra={"x-request-id": RID, **client}))
    routed = await router.send(request_body(BODY))
    marked = decoded(sets(routed))
    assert marked.get(HEDGE_HEADER) == "1", "the request takes the hedge route"
    per_try = int(marked[PER_TRY]) / 1000
    assert per_try == HEDGE_SECS
    out = Outgoing({":path": "/v1/messages", **client}, BODY)
    out.apply(routed)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=mock), base_url="http://upstream.test"
    ) as upstream:
        winner, _ = await _race(servicer, upstream, out, per_try)
    answer = winner.answer
    assert answer is not None
    final = await router.send(
        response_headers(answer.status, answer.headers, details="via_upstream")
    )
    await router.close()
    decisions = Decisions(
        answer.status,
        headers=kept_headers({**answer.headers, **decoded(sets(final))}),
        attempts=attempt_spans(spans),
        calls=client_spans(spans),
        sent=_sent(mock),
    )
    return _seen(decisions, before, metrics, policies.pool, mock), _text(answer.body)


def _without_void(seen: Seen) -> Seen:
    return Seen(**{**vars(seen), "void": []})


@pytest.mark.parametrize("scenario", SCENARIOS.values(), ids=SCENARIOS.keys())
async def test_both_fronts_hedge_alike(
    scenario: Scenario, otel_spans: InMemorySpanExporter, otel_metrics: Metrics
) -> None:
    asgi, asgi_text = await through_asgi(scenario, otel_spans, otel_metrics)
    extproc, extproc_text = await through_extproc(scenario, otel_spans, otel_metrics)
    if scenario.ratio == 0.0:
        # Envoy's second try went out void (the module says why); the ASGI front sent none.
        assert asgi.void == []
        assert extproc.void == [("", b"")]
    assert asgi == _without_void(extproc)
    assert asgi_text == extproc_text != ""
    assert asgi.status == 200
    assert asgi.headers["x-switchyard-account"] == scenario.served
    assert asgi.hedges == scenario.hedged
    hedged = bool(scenario.hedged) and scenario.ratio > 0
    assert asgi.headers["x-switchyard-attempts"] == ("2" if hedged else "1")
    assert [key for key, _ in asgi.sent] == (["ka", "kb"] if hedged else ["ka"])
    hedge_spans = [a for a in asgi.attempts if a[1].get(tm.HEDGE)]
    assert len(hedge_spans) == int(hedged), "the hedge's attempt span says it is one"
    assert len(asgi.calls) == len(asgi.attempts), "each attempt has its CLIENT span"


async def test_a_json_answer_is_hedged_through_the_asgi_front_only(
    otel_spans: InMemorySpanExporter, otel_metrics: Metrics
) -> None:
    """A difference of the fronts, kept in sight: the ASGI front hedges a JSON answer slow to
    start (its first body bytes are its content); under Envoy only a stream takes the hedge
    route (`hedge_tries.arm`): the race needs the first-token filter, which watches event
    streams, so a JSON request is routed as ever and its answer waited for."""
    body = msgspec.json.encode({**msgspec.json.decode(BODY), "stream": False})
    scenario = Scenario({"ka": Behaviour(headers_delay_secs=LATE_SECS), "kb": Behaviour()}, "b")
    mock = _mock(scenario)
    config = parse_config(server(1.0) + CONFIG)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=mock)) as upstream:
        stack = switchyard_stack(Forwarder(upstream), config=config, environ=ENV)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=stack), base_url="http://gw.test"
        ) as client:
            reply = await client.post("/v1/messages", content=body)
        await stack.aclose()
    assert reply.status_code == 200
    assert (reply.headers["x-switchyard-account"], reply.headers["x-switchyard-attempts"]) == (
        "b",
        "2",
    )

    router = Stream(ExtProcServicer(Policies(config, build_accounts(config, ENV))))
    await router.send(request_headers(extra={"x-request-id": RID}))
    routed = decoded(sets(await router.send(request_body(body))))
    await router.close()
    assert HEDGE_HEADER not in routed
    assert PER_TRY not in routed  # a JSON answer's bound is the route's whole timeout
    assert routed["x-api-key"] == "ka"
