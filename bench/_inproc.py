"""Section 1: µs per request of each middleware alone and of the whole stack, in process.

The ASGI callable is driven directly with hand-made scope/receive/send (no server, no socket):
what is measured is the middleware's own Python work. The OpenTelemetry API is the no-op one
(no SDK), as in an app that has not configured one. Rounds interleave the variants, so drift
of the machine hits them alike; each figure is the median over the rounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import gc
import io
import os
import pstats
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _apps import MinimalMiddleware, bare
from _harness import (
    ANTHROPIC_PATH,
    OPENAI_PATH,
    SERVER_CORE,
    SIZES,
    Result,
    anthropic_body,
    median,
    openai_body,
)

from switchyard_mw.accounts import build_accounts
from switchyard_mw.asgi._types import ASGIApp, Message, Receive, Scope, Send
from switchyard_mw.asgi.cooling import CoolingMiddleware
from switchyard_mw.asgi.deadline import DeadlineMiddleware
from switchyard_mw.asgi.judge_middleware import JudgeMiddleware
from switchyard_mw.asgi.stack import switchyard_stack
from switchyard_mw.asgi.variant import VariantMiddleware
from switchyard_mw.config import load_config

SECTION = "1 in-process"

CONFIG = """
[llm_clients.acct-a]
base_url = "http://127.0.0.1:9"
api_key_env = "BENCH_KEY_A"
auth = "x-api-key"
models = [
    "claude-opus-5", "claude-opus-5-5", "claude-haiku-5", "claude-sonnet-5",
    "gpt-5", "gpt-5-1", "gpt-5-mini",
]
[llm_clients.acct-b]
base_url = "http://127.0.0.1:9"
api_key_env = "BENCH_KEY_B"
models = [
    "claude-opus-5", "claude-opus-5-5", "claude-haiku-5", "claude-sonnet-5",
    "gpt-5", "gpt-5-1", "gpt-5-mini",
]
priority = 1
[canaries."claude-opus-5"]
variants = { "claude-opus-5-5" = 10.0 }
salt = "bench"
[canaries."claude-sonnet-5"]
variants = { "claude-opus-5-5" = 100.0 }
[canaries."gpt-5"]
variants = { "gpt-5-1" = 10.0 }
salt = "bench"
[routes.auto]
classifier = "llm"
judge = "acct-a"
judge_model = "gpt-5-mini"
choices = { simple = "claude-haiku-5", complex = "claude-opus-5" }
fallback = "claude-opus-5"
"""
ENV = {"BENCH_KEY_A": "key-a", "BENCH_KEY_B": "key-b"}

# (label, path, body maker): both wires, for a model with and without a canary.
_MAKERS: list[tuple[str, str, Callable[[int], bytes]]] = [
    ("anthropic", ANTHROPIC_PATH, lambda size: anthropic_body("claude-haiku-5", size)),
    ("anthropic+canary", ANTHROPIC_PATH, lambda size: anthropic_body("claude-opus-5", size)),
    # Every request moved to the variant: the body reaches the app with its model rewritten.
    ("anthropic+rewrite", ANTHROPIC_PATH, lambda size: anthropic_body("claude-sonnet-5", size)),
    ("openai", OPENAI_PATH, lambda size: openai_body("gpt-5-mini", size)),
    ("openai+canary", OPENAI_PATH, lambda size: openai_body("gpt-5", size)),
]


def bodies(size: str = "1KB") -> list[tuple[str, str, bytes]]:
    """(label, path, body) of each wire and model at one body size."""
    return [(label, path, make(SIZES[size])) for label, path, make in _MAKERS]


BODIES = bodies()  # 1 KB


def write_config(workdir: Path) -> Path:
    path = workdir / "inproc.toml"
    path.write_text(CONFIG)
    return path


def build_apps(config_path: Path) -> dict[str, ASGIApp]:
    config = load_config(config_path)
    accounts = build_accounts(config, ENV)
    return {
        "bare app": bare,
        "Deadline": DeadlineMiddleware(bare),
        "Variant": VariantMiddleware(bare, canaries=config.canaries),
        "Cooling": CoolingMiddleware(bare, accounts=accounts),
        "Judge (no route hit)": JudgeMiddleware(bare, routes=config.routes, accounts=accounts),
        "minimal middleware (reference)": MinimalMiddleware(bare),
        "switchyard_stack": switchyard_stack(bare, config=config, environ=ENV),
    }


def _scope(path: str, body: bytes) -> Scope:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"127.0.0.1:8000"),
            (b"user-agent", b"bench"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"authorization", b"Bearer sk-client"),
            (b"accept", b"application/json"),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }


def _driver(path: str, body: bytes) -> Callable[[], tuple[Scope, Receive, Send, list[Message]]]:
    """A fresh scope/receive/send per request, as a server makes them."""
    template = _scope(path, body)
    request: Message = {"type": "http.request", "body": body, "more_body": False}

    def make() -> tuple[Scope, Receive, Send, list[Message]]:
        scope = {**template, "state": {}}
        sent: list[Message] = []
        gone = asyncio.Event()
        first = True

        async def receive() -> Message:
            nonlocal first
            if first:
                first = False
                return request
            await gone.wait()  # a server's receive blocks until the client leaves
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            sent.append(message)

        return scope, receive, send, sent

    return make


PIECE = 65536  # uvicorn pauses reading past 64 KiB of body not yet taken by the app


def pieced_driver(
    path: str, body: bytes
) -> Callable[[], tuple[Scope, Receive, Send, list[Message]]]:
    """A fresh scope/receive/send per request, the body in pieces of `PIECE` bytes, then a
    client that stays: `receive` waits, as a server's does, until the request ends (a
    `http.disconnect` at once would be a client that left, which the stack answers by
    cancelling the request once it watches, as it does when a request is slow)."""
    view = memoryview(body)
    pieces = [bytes(view[i : i + PIECE]) for i in range(0, len(body), PIECE)] or [b""]
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    template: Scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }

    def make() -> tuple[Scope, Receive, Send, list[Message]]:
        sent: list[Message] = []
        left = iter(range(len(pieces)))

        async def receive() -> Message:
            i = next(left, None)
            if i is None:
                await asyncio.Event().wait()  # cancelled when the request ends
            assert i is not None
            more = i + 1 < len(pieces)
            return {"type": "http.request", "body": pieces[i], "more_body": more}

        async def send(message: Message) -> None:
            sent.append(message)

        return {**template, "state": {}}, receive, send, sent

    return make


async def _check(app: ASGIApp, name: str, path: str, body: bytes) -> None:
    scope, receive, send, sent = _driver(path, body)()
    await app(scope, receive, send)
    start = next((m for m in sent if m["type"] == "http.response.start"), None)
    if start is None or start["status"] != 200:
        raise RuntimeError(f"{name} on {path} answered {start}: the benchmark would be wrong")


async def _round(app: ASGIApp, make: Callable[..., Any], n: int) -> float:
    started = time.perf_counter_ns()
    for _ in range(n):
        scope, receive, send, _sent = make()
        await app(scope, receive, send)
        # A server returns to its loop between requests: what the request left scheduled (the
        # disconnect watcher's start and cancellation) runs, and is counted, here.
        await asyncio.sleep(0)
    return (time.perf_counter_ns() - started) / n / 1000


async def _measure(
    apps: dict[str, ASGIApp], cases: list[tuple[str, str, bytes]], n: int, rounds: int
) -> dict[tuple[str, str], float]:
    makers = {label: _driver(path, body) for label, path, body in cases}
    for label, path, body in cases:
        for name, app in apps.items():
            await _check(app, name, path, body)
            await _round(app, makers[label], max(10, n // 10))  # warm-up
    samples: dict[tuple[str, str], list[float]] = {}
    order = [(label, name) for label, _path, _body in cases for name in apps]
    shuffle = random.Random(11)
    for _ in range(rounds):
        shuffle.shuffle(order)  # no variant always runs right after the same other one
        for label, name in order:
            gc.collect()  # garbage left by the previous variant is not collected on this one's time
            us = await _round(apps[name], makers[label], n)
            samples.setdefault((label, name), []).append(us)
    return {key: median(values) for key, values in samples.items()}


def run(
    workdir: Path, *, smoke: bool, profile: bool, sizes: Sequence[str] = ("1KB",)
) -> list[Result]:
    apps = build_apps(write_config(workdir))
    n_1kb, rounds = (300, 5) if smoke else (2000, 21)
    results = []
    for size in sizes:
        # About as many bytes per round at every size: a round of 1 MB bodies is 10 requests.
        n = max(10, n_1kb * SIZES["1KB"] // SIZES[size])
        cases = bodies(size)
        # On the server core, as the served sections' servers are, and never migrated mid-round.
        affinity = os.sched_getaffinity(0)
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {int(SERVER_CORE)})
        try:
            medians = asyncio.run(_measure(apps, cases, n, rounds))
        finally:
            os.sched_setaffinity(0, affinity)
        results += _results(apps, cases, medians, size)
    if profile:
        write_profile(apps["switchyard_stack"], workdir, n=20_000)
    return results


def _results(
    apps: dict[str, ASGIApp],
    cases: list[tuple[str, str, bytes]],
    medians: dict[tuple[str, str], float],
    size: str,
) -> list[Result]:
    results = []
    for label, _path, _body in cases:
        floor = medians[(label, "bare app")]
        for name in apps:
            us = medians[(label, name)]
            added = us - floor
            results.append(
                Result(
                    section=SECTION,
                    name=f"{name} [{label}]",
                    size=size,
                    us_per_req=us,
                    ratio=us / floor,
                    ratio_to="bare app",
                    note="" if name == "bare app" else f"+{added:.1f} µs",
                    extra={"added_us": added},
                )
            )
    return results


def write_profile(app: ASGIApp, workdir: Path, *, n: int) -> Path:
    """cProfile of the whole stack on the 1 KB Anthropic canary body, top functions by self time."""
    _label, path, body = BODIES[1]
    make = _driver(path, body)
    profiler = cProfile.Profile()

    async def loop() -> None:
        await _round(app, make, 200)
        profiler.enable()
        await _round(app, make, n)
        profiler.disable()

    asyncio.run(loop())
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(35)
    stats.sort_stats("cumulative").print_stats(35)
    target = workdir / "profile_stack.txt"
    target.write_text(out.getvalue().replace(os.getcwd() + "/", ""))
    return target
