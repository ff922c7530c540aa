"""Account affinity: the prompt-cache reads it earns, in process through the stack.

300 conversations x 8 turns over 3 accounts of one model (Anthropic Messages wire), through
switchyard_stack and the gateway's forwarder to the mock provider (which keeps a prompt cache
per API key), all in one process. Turns go out interleaved (turn 1 of every conversation, then
turn 2, ..., the conversations shuffled each turn), as concurrent conversations do. Three runs:

- affinity: as shipped (a conversation's key picks its account by rendezvous hashing);
- rotation: the same with the conversation key withheld, i.e. the rotation that serves
  requests without a key (and served every request before affinity);
- cooling: affinity, while one account answers 503 during turns 3-5 (it cools after one fault
  and fails over); afterwards it is healthy again and probed back in.

Printed: the cache-read share of input tokens, the share of cacheable turns (2-8) that read
the cache, each account's share of requests, and for the cooling run how many conversations
moved and how many were back on their own account for the last turn. Then what an operator's
dashboard shows of the same run: each account's cache-hit ratio as switchyard recorded it in
`gen_ai.client.token.usage` (its `cache_read` tokens over its `input` tokens), the ratio the
dashboard's panel draws.

    python bench/affinity.py
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import sys
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.routing import Route

from switchyard_mw.asgi.stack import switchyard_stack
from switchyard_mw.config import parse_config
from switchyard_mw.engine import machine
from switchyard_mw.gateway import WIRE_ROUTES, Forwarder
from switchyard_mw.telemetry import names as tm
from switchyard_mw.telemetry import request_metrics as rm
from switchyard_mw.testing.mock_provider import Behaviour, MockProvider

CONVERSATIONS, TURNS = 300, 8
ACCOUNTS = ("acct-a", "acct-b", "acct-c")
KEYS = {name: f"key-{name}" for name in ACCOUNTS}
COOLING_TURNS = range(3, 6)  # 1-based turns during which acct-b answers 503

CONFIG = "".join(
    f"""
[llm_clients.{name}]
base_url = "http://mock.test/"
api_key_env = "K_{i}"
auth = "x-api-key"
models = ["claude-sonnet-5"]
failure_threshold = 1
cooldown_secs = 0.5
"""
    for i, name in enumerate(ACCOUNTS)
)
ENVIRON = {f"K_{i}": KEYS[name] for i, name in enumerate(ACCOUNTS)}
ACCOUNT_OF_KEY = {v: k for k, v in KEYS.items()}

# A long system prompt and first turn: the cacheable prefix a real assistant conversation has.
SYSTEM = "You are a careful assistant. " * 200


def turn_text(conv: int, turn: int) -> str:
    return f"Conversation {conv}, question {turn}: " + "please go on. " * 20


def recorded_tokens() -> collections.defaultdict[tuple[str, str], float]:
    """Tokens switchyard recorded so far in `gen_ai.client.token.usage`, by account and type."""
    rm.requests.fold()
    metric = rm.token_usage.metric(0)
    found: collections.defaultdict[tuple[str, str], float] = collections.defaultdict(float)
    for point in metric.data.data_points if metric is not None else ():
        attributes = dict(point.attributes or {})
        account, kind = attributes.get(tm.ACCOUNT), attributes.get(tm.TOKEN_TYPE)
        if isinstance(account, str) and isinstance(kind, str):
            found[account, kind] += float(point.sum)  # type: ignore[union-attr]
    return found


async def run(mode: str) -> dict[str, Any]:
    mock = MockProvider(reply="An answer of a plausible length. " * 8)
    upstream = httpx.AsyncClient(transport=httpx.ASGITransport(app=mock), timeout=None)
    forwarder = Forwarder(upstream)
    app = Starlette(routes=[Route(p, forwarder, methods=["POST"]) for p in WIRE_ROUTES])
    stack = switchyard_stack(app, config=parse_config(CONFIG), environ=ENVIRON)
    keyed = machine.conversation_key
    if mode == "rotation":
        machine.conversation_key = lambda ctx: None
    history: list[list[dict[str, Any]]] = [[] for _ in range(CONVERSATIONS)]
    placed: list[list[str]] = [[] for _ in range(CONVERSATIONS)]
    read = total = hit_turns = whole_hits = 0
    prompt_before = [0] * CONVERSATIONS  # the previous turn's prompt, in tokens
    arrivals = random.Random(37)
    recorded_before = recorded_tokens()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=stack), base_url="http://gw")
    try:
        for turn in range(1, TURNS + 1):
            if mode == "cooling":
                if turn in COOLING_TURNS:
                    mock.set_behaviour(KEYS["acct-b"], Behaviour(status=503))
                else:
                    mock.clear_behaviour(KEYS["acct-b"])
                    await asyncio.sleep(0.6)  # its cooling is over: the next request probes it
            # Conversations arrive in no fixed order (a fixed one would line up with the
            # rotation: 300 is a multiple of 3, so conversation i would always get account i % 3).
            order = list(range(CONVERSATIONS))
            arrivals.shuffle(order)
            for conv in order:
                messages = history[conv]
                messages.append({"role": "user", "content": turn_text(conv, turn)})
                body = {"model": "claude-sonnet-5", "max_tokens": 64, "system": SYSTEM}
                body["messages"] = messages
                answer = await client.post("/v1/messages", json=body)
                assert answer.status_code == 200, answer.text
                data = answer.json()
                usage = data["usage"]
                cached = usage.get("cache_read_input_tokens", 0)
                inputs = (
                    usage["input_tokens"] + cached + usage.get("cache_creation_input_tokens", 0)
                )
                read, total = read + cached, total + inputs
                hit_turns += turn > 1 and cached > 0
                # The whole previous prompt read from the cache: the turn's own account served
                # the turn before (earlier, shorter prefixes may sit on several accounts).
                whole_hits += turn > 1 and cached >= prompt_before[conv]
                prompt_before[conv] = cached + usage.get("cache_creation_input_tokens", 0)
                placed[conv].append(ACCOUNT_OF_KEY[mock.requests[-1].key])
                messages.append({"role": "assistant", "content": data["content"]})
    finally:
        machine.conversation_key = keyed
        await client.aclose()
        await upstream.aclose()
    recorded = recorded_tokens()
    for found, before in recorded_before.items():
        recorded[found] -= before
    shares = collections.Counter(a for conv in placed for a in conv)
    out: dict[str, Any] = {
        "mode": mode,
        "cache_read_share_of_input_tokens": round(read / total, 3),
        "cacheable_turns_reading_cache": round(hit_turns / (CONVERSATIONS * (TURNS - 1)), 3),
        "turns_reading_whole_previous_prompt": round(whole_hits / (CONVERSATIONS * (TURNS - 1)), 3),
        "request_share": {a: round(shares[a] / (CONVERSATIONS * TURNS), 3) for a in ACCOUNTS},
        "recorded_cache_hit_ratio": {
            a: round(recorded[a, "cache_read"] / recorded[a, "input"], 3) for a in ACCOUNTS
        },
        "recorded_cache_read_share_of_input_tokens": round(
            sum(recorded[a, "cache_read"] for a in ACCOUNTS)
            / sum(recorded[a, "input"] for a in ACCOUNTS),
            3,
        ),
    }
    if mode == "cooling":
        home = [conv[0] for conv in placed]
        moved = [i for i, conv in enumerate(placed) if set(conv[2:5]) != {home[i]}]
        out["conversations_moved"] = len(moved)
        out["moved_were_on_cooled_account"] = sum(home[i] == "acct-b" for i in moved)
        out["moved_back_for_last_turn"] = sum(placed[i][-1] == home[i] for i in moved)
        out["unmoved_that_changed_account"] = sum(
            len(set(conv)) > 1 for i, conv in enumerate(placed) if i not in moved
        )
    return out


async def main() -> None:
    modes = sys.argv[1:] or ["affinity", "rotation", "cooling"]
    for mode in modes:
        print(json.dumps(await run(mode)))


if __name__ == "__main__":
    asyncio.run(main())
