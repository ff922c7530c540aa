"""The first-token filter's streams (`extproc.first_token`), driven as Envoy drives them with
the response body `FULL_DUPLEX_STREAMED`: body pieces arrive while the answer to the headers is
held, and the answers come when the first content event (or the bound) says, not one per
message. The live proof through Envoy is test_envoy_first_token_live.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from extproc_helpers import (
    FakeContext,
    Pushed,
    request_body,
    request_headers,
    response_body,
    response_headers,
    sets,
)
from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.extproc import ExtProcServicer, Policies
from switchyard_mw.extproc.first_token import MAX_HELD_BYTES
from switchyard_mw.telemetry import names as tm

RID = "rid-ft"
OPENING = b'event: message_start\ndata: {"type":"message_start"}\n\n'
CONTENT = (
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
    b'"delta":{"type":"text_delta","text":"hi"}}\n\n'
)


def config(first_token_secs: float, *, accounts: str = "ab") -> str:
    return "".join(
        f"""
[llm_clients.{name}]
base_url = "https://prov.example"
api_key_env = "KEY"
models = ["m"]
priority = {i}
first_token_secs = {first_token_secs}
envoy_cluster = "prov"
"""
        for i, name in enumerate(accounts)
    )


async def routed(
    text: str, extra: dict[str, str] | None = None
) -> tuple[Policies, ExtProcServicer, Any]:
    cfg = parse_config(text)
    policies = Policies(cfg, build_accounts(cfg, {"KEY": "k"}))
    servicer = ExtProcServicer(policies)
    router = _Router(servicer)
    body = msgspec.json.encode(
        {
            "model": "m",
            "max_tokens": 9,
            "stream": True,
            "messages": [{"role": "user", "content": "x"}],
        }
    )
    await router.send(request_headers(extra={"x-request-id": RID, **(extra or {})}))
    await router.send(request_body(body))
    return policies, servicer, router


class _Router:
    def __init__(self, servicer: ExtProcServicer) -> None:
        self.inbox: asyncio.Queue[ep.ProcessingRequest | None] = asyncio.Queue()

        async def requests() -> AsyncIterator[ep.ProcessingRequest]:
            while (item := await self.inbox.get()) is not None:
                yield item

        self.answers = servicer.Process(requests(), FakeContext())

    async def send(self, request: ep.ProcessingRequest) -> ep.ProcessingResponse:
        await self.inbox.put(request)
        answer: ep.ProcessingResponse = await anext(self.answers)
        return answer


def _pieces_of(answer: ep.ProcessingResponse) -> bytes:
    return answer.response_body.response.body_mutation.streamed_response.body


async def test_the_headers_wait_for_the_first_content_event_then_all_goes_in_order() -> None:
    _, servicer, _ = await routed(config(5.0))
    stream = Pushed(servicer)
    await stream.inbox.put(response_headers(200, request_id=RID))
    await stream.inbox.put(response_body(OPENING))
    await stream.nothing()  # the opening is no start: nothing goes yet
    await stream.inbox.put(response_body(CONTENT))
    first, second, third = [await stream.next() for _ in range(3)]
    assert first.WhichOneof("response") == "response_headers"
    assert "x-switchyard-retry" not in sets(first)
    assert [_pieces_of(second), _pieces_of(third)] == [OPENING, CONTENT]
    await stream.inbox.put(response_body(b"", end=True))  # later pieces: answered at once
    last = await stream.next()
    assert last.response_body.response.body_mutation.streamed_response.end_of_stream
    await stream.close()


async def test_no_content_within_the_bound_retries_on_the_next_account(otel_metrics: Any) -> None:
    policies, servicer, _ = await routed(config(0.2))
    before = otel_metrics.value(tm.DEADLINE_EXCEEDED, phase="first_token")
    stream = Pushed(servicer)
    await stream.inbox.put(response_headers(200, request_id=RID))
    await stream.inbox.put(response_body(OPENING))
    answer = await stream.next()  # the timer's, with no message arriving
    assert sets(answer)["x-switchyard-retry"] == b"1"
    assert _pieces_of(await stream.next()) == OPENING
    assert otel_metrics.value(tm.DEADLINE_EXCEEDED, phase="first_token") == before + 1
    assert policies.pool.status_of("a").consecutive_faults == 1  # one model: the account
    await stream.close()


async def test_with_no_account_left_the_answer_is_the_wires_504() -> None:
    _, servicer, _ = await routed(config(0.2, accounts="a"))
    stream = Pushed(servicer)
    await stream.inbox.put(response_headers(200, request_id=RID))
    answer = await stream.next()
    assert answer.immediate_response.status.code == 504
    assert msgspec.json.decode(answer.immediate_response.body)["error"]["type"] == (
        "deadline_exceeded"
    )
    await stream.close()


async def test_an_opening_past_the_bound_on_what_is_held_goes_on_as_it_is() -> None:
    _, servicer, _ = await routed(config(5.0))
    stream = Pushed(servicer)
    await stream.inbox.put(response_headers(200, request_id=RID))
    ping = b'event: ping\ndata: {"type":"ping"}\n\n'
    pieces = MAX_HELD_BYTES // (len(ping) * 64) + 1
    for _ in range(pieces):
        await stream.inbox.put(response_body(ping * 64))
    answer = await stream.next()
    assert answer.WhichOneof("response") == "response_headers"
    assert "x-switchyard-retry" not in sets(answer)
    for _ in range(pieces):
        assert _pieces_of(await stream.next()) == ping * 64
    await stream.close()


async def test_an_answer_of_no_request_in_flight_goes_at_once() -> None:
    _, servicer, _ = await routed(config(5.0))
    stream = Pushed(servicer)
    await stream.inbox.put(response_headers(200, request_id="someone-else"))
    assert (await stream.next()).WhichOneof("response") == "response_headers"
    await stream.inbox.put(response_body(OPENING))
    assert _pieces_of(await stream.next()) == OPENING
    await stream.close()


async def test_a_budget_that_ends_first_is_the_callers_not_the_accounts(otel_metrics: Any) -> None:
    policies, servicer, _ = await routed(config(5.0), {"x-switchyard-timeout-ms": "200"})
    before = otel_metrics.value(tm.DEADLINE_EXCEEDED, phase="budget")
    stream = Pushed(servicer)
    await stream.inbox.put(response_headers(200, request_id=RID))
    answer = await stream.next()
    assert answer.immediate_response.status.code == 504
    assert otel_metrics.value(tm.DEADLINE_EXCEEDED, phase="budget") == before + 1
    assert policies.pool.status_of("a").consecutive_faults == 0
    await stream.close()
