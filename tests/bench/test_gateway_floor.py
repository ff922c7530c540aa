"""`bench/gateway_floor.py`: the in-process count of the example gateway against the floors.

Its driver must behave as a server does after the body (a `receive` that waits, not a client
that left at once, which the stack would answer by cancelling a slow request), and its
profile mode must run the gateway's forwarding app on every request.
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from process_group import run_in_own_group
from servers import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import _inproc  # bench/ is a folder of scripts, not a package
import gateway_floor
from _harness import envoy_binary


async def test_the_driver_hands_over_the_body_in_pieces_then_waits() -> None:
    body = b"x" * (_inproc.PIECE * 2 + 5)
    scope, receive, send, sent = _inproc.pieced_driver("/v1/chat/completions", body)()
    assert dict(scope["headers"])[b"content-length"] == str(len(body)).encode()
    pieces = [await receive() for _ in range(3)]
    assert b"".join(p["body"] for p in pieces) == body
    assert [p["more_body"] for p in pieces] == [True, True, False]
    with pytest.raises(TimeoutError):  # the client stays until the request ends
        await asyncio.wait_for(receive(), 0.05)
    await send({"type": "http.response.start", "status": 200})
    assert sent == [{"type": "http.response.start", "status": 200}]


def test_requests_at_a_size_are_about_the_bytes_of_the_1kb_ones_at_least_60() -> None:
    assert gateway_floor.requests_at("1KB", 2000) == 2000
    assert gateway_floor.requests_at("32KB", 2000) == 62
    assert gateway_floor.requests_at("128KB", 2000) == 60


@pytest.mark.integration  # starts an Envoy as the mock upstream
@pytest.mark.timeout(240)  # a guard against a hang, not a time target
def test_the_profile_runs_the_forwarding_app_on_every_request() -> None:
    if envoy_binary() is None:
        pytest.skip("no Envoy binary")
    code, out, err = run_in_own_group(
        [
            sys.executable,
            str(ROOT / "bench/gateway_floor.py"),
            "--calls",
            "gateway",
            "--sizes",
            "1KB",
            "--requests",
            "60",
        ],
        cwd=ROOT,
        timeout=230,
    )
    assert code == 0, out[-3000:] + err[-3000:]
    assert "60 requests" in out
    # `_call` runs once a request (cProfile counts each resumption of its coroutine too).
    line = next(line for line in out.splitlines() if "forwarder.py" in line and "(_call)" in line)
    assert int(line.split()[0]) >= 60
