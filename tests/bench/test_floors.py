"""Section 3's two floors (`bench/_apps.py`) and the tools that count and profile them.

The floors are what the gateway's figures are read against, so a floor that forwarded the
wrong bytes, or none, would make every ratio wrong without failing a run: both are driven here
in front of a recording upstream, at a size sent whole and at one sent as a view after its
head (`upstream_body`, the necessary-work floor only).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from process_group import run_in_own_group
from servers import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import _apps  # bench/ is a folder of scripts, not a package
import instructions
from _harness import OPENAI_PATH, envoy_binary, openai_body

from switchyard_mw.gateway.upstream_body import WRITTEN_APART

REPLY = b'{"id":"up","object":"chat.completion","choices":[]}'


@pytest.fixture
async def upstream(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[list[tuple[str, bytes]]]:
    """A recording upstream on 127.0.0.1 (BENCH_UPSTREAM points at it): (path, body) per call."""
    seen: list[tuple[str, bytes]] = []

    async def record(request: web.Request) -> web.Response:
        body = await request.read()
        assert request.content_length == len(body)
        seen.append((request.path, body))
        return web.Response(body=REPLY, content_type="application/json")

    app = web.Application(client_max_size=8 << 20)
    app.router.add_post("/{tail:.*}", record)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    monkeypatch.setenv("BENCH_UPSTREAM", f"http://127.0.0.1:{port}")
    yield seen
    await runner.cleanup()


async def post(kind: str, body: bytes) -> httpx.Response:
    app = _apps.passthrough(kind)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://floor") as client:
        return await client.post(OPENAI_PATH, content=body)


@pytest.mark.parametrize("kind", ["aiohttp", "aiohttp-read"])
@pytest.mark.parametrize("size", [1024, WRITTEN_APART - 1, WRITTEN_APART, 128 * 1024])
async def test_each_floor_forwards_the_body_intact(
    upstream: list[tuple[str, bytes]], kind: str, size: int
) -> None:
    body = openai_body("gpt-4o-mini", size)
    reply = await post(kind, body)
    assert (reply.status_code, reply.content) == (200, REPLY)
    assert upstream == [(OPENAI_PATH, body)]


async def test_the_necessary_work_floor_refuses_what_the_read_refuses(
    upstream: list[tuple[str, bytes]],
) -> None:
    refused = await post("aiohttp-read", b'{"messages": [], "model": 7}')
    assert refused.status_code == 400
    passed = await post("aiohttp", b'{"messages": [], "model": 7}')  # the plain floor reads nothing
    assert passed.status_code == 200
    assert len(upstream) == 1


def test_apps_names_a_row_whose_name_holds_a_comma() -> None:
    names = instructions.app_names("pass-through aiohttp,example gateway, shipped")
    picked = [
        name for name, _target, _env in instructions.PEERS if instructions._named(name, names)
    ]
    assert picked == ["pass-through aiohttp", "example gateway, shipped"]
    assert not instructions._named("example gateway, shipped", ["example gateway"])
    assert not instructions._named("bare app", ["bare"])


@pytest.mark.integration  # starts an Envoy as the mock upstream
@pytest.mark.timeout(240)  # a guard against a hang, not a time target
def test_floor_profile_runs_and_splits_each_request(tmp_path: Path) -> None:
    if envoy_binary() is None:
        pytest.skip("no Envoy binary")
    code, out, err = run_in_own_group(
        [
            sys.executable,
            str(ROOT / "bench/floor_profile.py"),
            "--sizes",
            "1KB,128KB",
            "--requests",
            "60",
            "--rounds",
            "1",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        timeout=230,
    )
    assert code == 0, out[-3000:] + err[-3000:]
    text = (tmp_path / "floor_profile.md").read_text()
    for row in ("whole request", "receive the body", "read_request", "forward", "the rest"):
        assert f"| {row} |" in text
    # The read is timed in the necessary-work floor only, and costs something there.
    read = next(line for line in text.splitlines() if line.startswith("| read_request |"))
    plain, necessary = (float(cell) for cell in read.split("|")[2:4])
    assert plain == 0 < necessary


@pytest.mark.integration  # runs under valgrind: a minute
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
@pytest.mark.timeout(300)
def test_the_read_alone_is_counted_as_a_difference_of_two_runs() -> None:
    count = instructions.read_alone("1KB", 20, 2)
    # One validating read of a 1 KB conversation: tens of thousands of instructions, not the
    # hundreds of millions a Python start-up costs (which the difference cancels).
    assert 5_000 < count < 500_000
