"""Hedged first tokens through both fronts make the same decisions (the comparison of
test_two_fronts.py, for a stream whose first content is slower than its hedge time), and their
neighbour, a first token late past its bound, across providers.

`a` (preferred) and `b` serve `m`, both hedging after `HEDGE_SECS` without content. Both fronts
call the mock provider served on a thread (`served`), so a stream comes as the mock sends it:
headers and opening events at once, its first content when the scenario says.

- The ASGI front runs the whole stack around the gateway's forwarding app (`gateway.Forwarder`);
  its race (`asgi/hedge.py`) starts the hedge at the hedge time.
- The ext_proc front runs with `[server] envoy_hedge = true` and is driven as Envoy drives the
  example's hedge route (`extproc/hedge_tries.py`; the live proof is
  tests/extproc/test_envoy_hedge_live.py): the router-level stream marks the request
  `x-switchyard-hedge` and sets the per-try timeout to the hedge time; each try has the hedged
  refusal filter's stream and the hedged first-token filter's stream, both told the try's
  `x-envoy-attempt-count`; the first-token filter gets the try's headers and then each piece
  as it comes, and holds its answer to the headers until the first content event; a try that
  has not released its headers to the router by the per-try timeout gets a second try beside
  it, whose request goes through the retry filter (which gives it the hedge's account, on
  the cluster an aggregate sent it to, or makes it void); the first try whose headers reach
  the router is the answer, and Envoy resets the other (`hedge_race`, which
  test_two_fronts_clouds.py runs through the cloud filter too).

What must match: as test_two_fronts.py (status, `x-switchyard-*`, attempt and CLIENT spans, the
(key, model) each provider got), the answer's text, the `switchyard.hedges` counts and each
account's faults.

Where the fronts differ for a reason of the front, kept explicit:

- With no hedge budget, Envoy still sends the second try (its `hedge_policy` asks no one): the
  processor makes it *void*, with neither credential nor prompt, and holds its refusal. The
  ASGI front sends nothing. The void try is left out of `sent` and checked on its own: it
  reached the provider with no key and no prompt.
- Envoy's per-try timeout is read once, at routing, for every try: off the hedge route it is
  the longest first-token bound among the accounts the request's tries may go to, so a
  retry on `b` is not cut at `a`'s bound; each try's own bound is the processor's timer (the
  simulated Envoy below cuts a try at the per-try timeout as Envoy does).

A JSON answer is hedged alike (`JSON_SCENARIOS`): its content is the answer itself, whose
headers come with it, so under Envoy the hedged refusal filter sees each try's 2xx JSON headers
and the first try to answer wins (the ASGI front's first body bytes come with them).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import httpx
import msgspec
import pytest
from machine_moves import machine_moves  # noqa: F401 (autouse: each move is a row)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import Metrics
from extproc_helpers import (
    Stream,
    immediate,
    request_body,
    request_headers,
    response_headers,
    sets,
)
from hedge_race import Route, plain, race
from servers import serve_in_thread
from switchyard_mw import switchyard_stack
from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import Config, parse_config
from switchyard_mw.core.pool import AccountPool
from switchyard_mw.extproc import ExtProcServicer, Policies
from switchyard_mw.extproc.policy import HEDGE_HEADER
from switchyard_mw.telemetry import names as tm
from switchyard_mw.testing import Behaviour, MockProvider
from two_fronts import (
    Decisions,
    Outgoing,
    attempt_spans,
    client_spans,
    decoded,
    error_of,
    kept_headers,
    post_through,
    text_of,
)

pytest.importorskip("aiohttp")
from switchyard_mw.gateway import Forwarder

pytestmark = pytest.mark.integration  # the mock is served (`served`)

HEDGE_SECS = 0.3
LATE_SECS = 2.0
SLOW = Behaviour(stall_after_chunks=0, body_stall_secs=1.2)
"""A first content late enough to be hedged, soon enough to win against a hedge that fails."""
"""A first try this late to content is hedged long before it answers."""
ENV = {"KEY_A": "ka", "KEY_B": "kb"}
B_FIRST_TOKEN_SECS = 10.0
RID = "rid-two-fronts-hedge"
BODY = msgspec.json.encode(
    {
        "model": "m",
        "max_tokens": 8,
        "stream": True,
        "messages": [{"role": "user", "content": "hedge me"}],
    }
)
JSON_BODY = msgspec.json.encode({**msgspec.json.decode(BODY), "stream": False})
SLOW_JSON = Behaviour(headers_delay_secs=SLOW.body_stall_secs)
"""A JSON answer as late as `SLOW`'s first content: its headers come with it."""
CONFIG = "".join(
    f"""
[llm_clients.{name}]
base_url = "@MOCK@"
api_key_env = "KEY_{name.upper()}"
auth = "x-api-key"
models = ["m"]
priority = {i}
failure_threshold = 1
cooldown_secs = 30
first_token_secs = {B_FIRST_TOKEN_SECS:g}
hedge_after_secs = {HEDGE_SECS}
envoy_cluster = "prov"
"""
    for i, name in enumerate("ab")
)
RENAMED = CONFIG.replace('models = ["m"]\npriority = 1', 'models = { m = "m-at-b" }\npriority = 1')
"""b knows m by its own name: the hedge's body carries it."""
ACROSS = CONFIG.replace('envoy_cluster = "prov"', 'envoy_cluster = "other"').replace(
    'envoy_cluster = "other"', 'envoy_cluster = "prov"', 1
) + (
    """
[server.envoy_failover]
"prov-then-other" = ["prov", "other"]
"other-then-prov" = ["other", "prov"]
"""
)
"""b on another provider's cluster: Envoy sends the hedge there (an aggregate's next)."""
FIRST_TOKEN_SECS = 0.3
LATE_ACROSS = ACROSS.replace(f"hedge_after_secs = {HEDGE_SECS}\n", "").replace(
    f"first_token_secs = {B_FIRST_TOKEN_SECS:g}", f"first_token_secs = {FIRST_TOKEN_SECS}", 1
)
"""As ACROSS, no hedging and a's first token due after FIRST_TOKEN_SECS: a late one fails
over, to the other provider's cluster (the neighbour of a hedge: the same first-token filter)."""
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
    config: str = CONFIG
    hedge_route: bool = True
    """The processor sends it to Envoy's hedge route (`x-switchyard-hedge`)."""
    failover: bool = False
    """Not hedged, but failed over to `b`."""
    body: bytes = BODY
    """The request: a stream, or a JSON answer (`JSON_BODY`)."""


SCENARIOS = {
    "a slow first token is hedged, and the hedge wins": Scenario(
        {"ka": LATE, "kb": Behaviour()}, "b", {"won": 1}
    ),
    "the hedge's account knows the model by its own name": Scenario(
        {"ka": LATE, "kb": Behaviour()}, "b", {"won": 1}, config=RENAMED
    ),
    "the hedge goes to the other provider's cluster": Scenario(
        {"ka": LATE, "kb": Behaviour()}, "b", {"won": 1}, config=ACROSS
    ),
    "a first token late on one provider, not hedged: the other provider's cluster": Scenario(
        {"ka": LATE, "kb": Behaviour()},
        "b",
        config=LATE_ACROSS,
        hedge_route=False,
        failover=True,
    ),
    "the other provider's first token, later than the first's bound, within its own": Scenario(
        {"ka": LATE, "kb": SLOW}, "b", config=LATE_ACROSS, hedge_route=False, failover=True
    ),
    "a first token in time is not hedged": Scenario({"ka": Behaviour(), "kb": Behaviour()}, "a"),
    "the hedge refused (503) loses, the first try answers": Scenario(
        {"ka": SLOW, "kb": Behaviour(status=503)},
        "a",
        {"lost": 1},
    ),
    "the first try refused (503) during the race leaves the hedge": Scenario(
        {
            "ka": Behaviour(status=503, headers_delay_secs=HEDGE_SECS * 2),
            "kb": SLOW,
        },
        "b",
        {"won": 1},
    ),
    "no hedge budget: the first try is waited for": Scenario(
        {"ka": SLOW, "kb": Behaviour()},
        "a",
        {"refused": 1},
        ratio=0.0,
    ),
}


JSON_SCENARIOS = {
    "a slow JSON answer is hedged, and the hedge wins": Scenario(
        {"ka": Behaviour(headers_delay_secs=LATE_SECS), "kb": Behaviour()},
        "b",
        {"won": 1},
        body=JSON_BODY,
    ),
    "a JSON answer in time is not hedged": Scenario(
        {"ka": Behaviour(), "kb": Behaviour()}, "a", body=JSON_BODY
    ),
    "the JSON hedge refused (503) loses, the first try answers": Scenario(
        {"ka": SLOW_JSON, "kb": Behaviour(status=503)}, "a", {"lost": 1}, body=JSON_BODY
    ),
    "the first JSON try refused (503) during the race leaves the hedge": Scenario(
        {"ka": Behaviour(status=503, headers_delay_secs=HEDGE_SECS * 2), "kb": SLOW_JSON},
        "b",
        {"won": 1},
        body=JSON_BODY,
    ),
    "no hedge budget: the first JSON try is waited for": Scenario(
        {"ka": SLOW_JSON, "kb": Behaviour()}, "a", {"refused": 1}, ratio=0.0, body=JSON_BODY
    ),
}
SCENARIOS |= {f"{name} [json]": scenario for name, scenario in JSON_SCENARIOS.items()}


@dataclass
class Seen(Decisions):
    """`Decisions`, and what a hedge changes besides."""

    hedges: dict[str, float] = field(default_factory=dict)
    """`switchyard.hedges` counted during the request, by result."""
    faults: dict[str, int] = field(default_factory=dict)
    """Each account's consecutive faults after the request."""
    void: list[tuple[str, bytes]] = field(default_factory=list)
    """(key, body) of each try that went out void (Envoy only: see the module)."""


@dataclass(frozen=True)
class Served:
    """The mock provider, served on a thread: answers stream as the mock sends them (an
    in-process transport would hand over each answer whole, headers at its end)."""

    mock: MockProvider
    url: str

    def ready(self, scenario: Scenario) -> Config:
        """The mock answering as `scenario` says, nothing recorded; the scenario's config."""
        self.mock.reset_behaviours()
        self.mock.clear_requests()
        for key, behaviour in scenario.upstream.items():
            self.mock.set_behaviour(key, behaviour)
        return parse_config(server(scenario.ratio) + scenario.config.replace("@MOCK@", self.url))


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    mock = MockProvider()
    with serve_in_thread(mock) as url:
        yield Served(mock, url)


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


# --- the ASGI front ------------------------------------------------------------------------


async def through_asgi(
    scenario: Scenario, served: Served, spans: InMemorySpanExporter, metrics: Metrics
) -> tuple[Seen, str]:
    config, mock = served.ready(scenario), served.mock
    upstream = httpx.AsyncClient()
    stack = switchyard_stack(Forwarder(upstream), config=config, environ=ENV)
    spans.clear()
    before = _counts(metrics)
    reply = await post_through(stack, upstream, scenario.body)
    decisions = Decisions(
        status=reply.status_code,
        headers=kept_headers(reply.headers),
        attempts=attempt_spans(spans),
        calls=client_spans(spans),
        sent=_sent(mock),
    )
    return _seen(decisions, before, metrics, stack.pool, mock), text_of(reply.content)


# --- the ext_proc front, driven as Envoy drives the hedge route ----------------------------

PER_TRY = "x-envoy-upstream-rq-per-try-timeout-ms"


async def through_extproc(
    scenario: Scenario, served: Served, spans: InMemorySpanExporter, metrics: Metrics
) -> tuple[Seen, str]:
    config, mock = served.ready(scenario), served.mock
    policies = Policies(config, build_accounts(config, ENV))
    servicer = ExtProcServicer(policies)
    spans.clear()
    before = _counts(metrics)
    router = Stream(servicer)
    client = {"content-type": "application/json"}
    await router.send(request_headers(extra={"x-request-id": RID, **client}))
    routed = await router.send(request_body(scenario.body))
    marked = decoded(sets(routed))
    hedged = marked.get(HEDGE_HEADER) == "1"
    assert hedged == scenario.hedge_route, "the request takes the route the scenario says"
    per_try = int(marked[PER_TRY]) / 1000
    # Off the hedge route: the longest first-token bound among the accounts its tries may go
    # to (b's), read once by Envoy for every try; a's own is the processor's timer.
    assert per_try == (HEDGE_SECS if hedged else B_FIRST_TOKEN_SECS)
    out = Outgoing({":path": "/v1/messages", **client}, scenario.body)
    out.apply(routed)
    async with httpx.AsyncClient(base_url=served.url) as upstream:
        cluster = marked["x-switchyard-cluster"]
        order = tuple(config.server.envoy_failover.get(cluster, [cluster]))
        route = Route(servicer, plain(upstream), out, order, RID, hedged=hedged)
        winner, _ = await race(route, per_try)
    if winner.reply is not None:  # Envoy sends an upstream filter's reply to the client
        await router.close()
        status, headers, body = immediate(winner.reply)
        decisions = Decisions(
            status,
            error=error_of(body),
            headers=kept_headers(decoded(headers)),
            attempts=attempt_spans(spans),
            calls=client_spans(spans),
            sent=_sent(mock),
        )
        return _seen(decisions, before, metrics, policies.pool, mock), ""
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
    return _seen(decisions, before, metrics, policies.pool, mock), text_of(answer.body)


def _without_void(seen: Seen) -> Seen:
    return Seen(**{**vars(seen), "void": []})


@pytest.mark.parametrize("scenario", SCENARIOS.values(), ids=SCENARIOS.keys())
async def test_both_fronts_hedge_alike(
    scenario: Scenario, served: Served, otel_spans: InMemorySpanExporter, otel_metrics: Metrics
) -> None:
    asgi, asgi_text = await through_asgi(scenario, served, otel_spans, otel_metrics)
    extproc, extproc_text = await through_extproc(scenario, served, otel_spans, otel_metrics)
    if scenario.ratio == 0.0:
        # Envoy's second try went out void (the module says why); the ASGI front sent none.
        assert asgi.void == []
        assert extproc.void == [("", b"")]
    assert asgi == _without_void(extproc)
    assert asgi_text == extproc_text != ""
    assert asgi.status == 200
    assert asgi.headers["x-switchyard-account"] == scenario.served
    assert asgi.hedges == scenario.hedged
    moved = (bool(scenario.hedged) and scenario.ratio > 0) or scenario.failover
    assert asgi.headers["x-switchyard-attempts"] == ("2" if moved else "1")
    assert [key for key, _ in asgi.sent] == (["ka", "kb"] if moved else ["ka"])
    if scenario.config is RENAMED:
        assert asgi.sent == [("ka", "m"), ("kb", "m-at-b")]
    hedge_spans = [a for a in asgi.attempts if a[1].get(tm.HEDGE)]
    assert len(hedge_spans) == int(moved and not scenario.failover), "the hedge's span says so"
    assert len(asgi.calls) == len(asgi.attempts), "each attempt has its CLIENT span"
