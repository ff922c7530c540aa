"""The processor's success path, held in a test as the ASGI stack's is
(tests/asgi/test_call_budget.py): the Python-level calls one request makes through the ext_proc
servicer, driven as Envoy drives the example's filters, counted with `sys.setprofile` ("call"
and "c_call" events), per wire, JSON and stream, served at once and failed over once (the
refusal filter's stream and the retry filter's). The counts include this module's driving of
the streams, the same on every run; they are compared with `call_budgets.json` beside this file
by the one rule of `tests/budgets.py`. `python tests/extproc/test_processor_call_budget.py`
prints them to record.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from budgets import ANSWERS, CONFIG, ENV, VERSION, WIRES, calls_of, check, counted_apart
from extproc_helpers import (
    Stream,
    request_body,
    request_headers,
    response_body,
    response_headers,
    sets,
    upstream_headers,
)
from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.extproc import ExtProcServicer, Policies

BUDGETS = Path(__file__).with_name("call_budgets.json")
ROUTED = CONFIG.replace(
    'models = ["claude-opus-5", "gpt-5"]\n',
    'models = ["claude-opus-5", "gpt-5"]\nenvoy_cluster = "prov"\n',
)
"""The two accounts of the ASGI stack's count, both on one Envoy cluster."""
UPSTREAM = [("x-switchyard-filter", "upstream")]
WIRE_NAMES = ("messages", "chat")


async def one_request(
    servicer: ExtProcServicer, n: int, wire: str, *, stream: bool, failover: bool
) -> None:
    """One request as Envoy drives the processor: the router-level stream (headers, body, the
    answer's headers and, when the processor asks for it, its body); on a failover first the
    refusal filter's stream (a 503) and the retry filter's (the next account's credential)."""
    path, payload = WIRES[wire]
    body = json.dumps({**payload, "stream": True} if stream else payload).encode()
    rid = f"rid-{n}"
    router = Stream(servicer)
    await router.send(
        request_headers(path, {"x-request-id": rid, "content-type": "application/json"})
    )
    routed = await router.send(request_body(body))
    assert "x-switchyard-cluster" in sets(routed), routed
    if failover:
        refusal = Stream(servicer, UPSTREAM)
        marked = await refusal.send(response_headers(503, request_id=rid))
        assert sets(marked).get("x-switchyard-retry") == b"1"
        await refusal.close()
        retry = Stream(servicer, UPSTREAM)
        await retry.send(upstream_headers({"x-request-id": rid}, attempt=2))
        await retry.close()
    answer, events = ANSWERS[wire]
    kind = "text/event-stream" if stream else "application/json"
    reply = await router.send(response_headers(200, {"content-type": kind}, details="via_upstream"))
    if reply.HasField("mode_override"):  # the usage read from the body
        for piece in events if stream else [answer]:
            await router.send(response_body(piece))
        await router.send(response_body(b"", end=True))
    await router.close()


def count_calls(wire: str, *, stream: bool, failover: bool) -> int:
    """The calls of one request, after a first one has warmed every lazy part up."""

    async def run() -> int:
        config = parse_config(ROUTED + "failure_threshold = 1000\n")
        servicer = ExtProcServicer(Policies(config, build_accounts(config, ENV)))
        await one_request(servicer, 0, wire, stream=stream, failover=failover)  # warm-up
        events, _ = await calls_of(one_request(servicer, 1, wire, stream=stream, failover=failover))
        return events

    return asyncio.run(run())


CASES = [
    (wire, stream, failover)
    for wire in WIRE_NAMES
    for stream in (False, True)
    for failover in (False, True)
]


def case_id(wire: str, stream: bool, failover: bool) -> str:
    return f"{wire}-{'stream' if stream else 'json'}-{'failover' if failover else 'first'}"


@pytest.fixture(scope="module")
def counts() -> dict[str, int]:
    return counted_apart(Path(__file__))


def test_counts_are_the_same_run_after_run(counts: dict[str, int]) -> None:
    assert counted_apart(Path(__file__)) == counts


@pytest.mark.parametrize(("wire", "stream", "failover"), CASES, ids=[case_id(*c) for c in CASES])
def test_a_request_stays_within_its_call_budget(
    counts: dict[str, int], wire: str, stream: bool, failover: bool
) -> None:
    name = case_id(wire, stream, failover)
    check(name, counts[name], BUDGETS)


if __name__ == "__main__":  # print the counts, as call_budgets.json records them
    found = {case_id(*c): count_calls(c[0], stream=c[1], failover=c[2]) for c in CASES}
    print(json.dumps({VERSION: found}, indent=2))
