"""Account affinity across replicas: two gateway processes (the example app under uvicorn)
sharing one Redis send each conversation's turns to the same account, whichever replica takes
a turn; when that account cools on one replica, both send its conversations to their next
account in rendezvous order (the cooling is shared), and every other conversation stays."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import anthropic
import httpx
import pytest

from redis_server import running_redis
from servers import example_gateway, serve_in_thread
from switchyard_mw.core.affinity import pick
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = pytest.mark.integration  # starts real servers

NAMES = ("rep-a", "rep-b", "rep-c")
ENV = {f"KEY_{n[-1].upper()}": f"key-{n}" for n in NAMES}
MODEL = "replica-model"


def config_text(mock_url: str, redis_url: str) -> str:
    accounts = "".join(
        f'[llm_clients.{n}]\nbase_url = "{mock_url}"\napi_key_env = "KEY_{n[-1].upper()}"\n'
        f'auth = "x-api-key"\nmodels = ["{MODEL}"]\nfailure_threshold = 1\n'
        f"cooldown_secs = 300\n\n"
        for n in NAMES
    )
    state = f'[state]\nbackend = "redis"\nurl = "{redis_url}"\nkey_prefix = "affinity"\n\n'
    return state + accounts


def first_choice(user: str, without: str | None = None) -> str:
    order = pick(user, [(n, 1.0) for n in NAMES])
    return next(n for n in order if n != without)


def wait_until_cooled(gateway: str, account: str) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        accounts = httpx.get(f"{gateway}/switchyard/accounts", timeout=5).json()["accounts"]
        if {a["name"]: a["state"] for a in accounts}[account] != "closed":
            return
        time.sleep(0.05)
    raise AssertionError(f"{gateway} never heard that {account} cooled")


def test_a_conversation_lands_on_one_account_from_either_replica(tmp_path: Path) -> None:
    mock = MockProvider()
    with contextlib.ExitStack() as stack:
        redis = stack.enter_context(contextlib.contextmanager(running_redis)(tmp_path))
        mock_url = stack.enter_context(serve_in_thread(mock))
        config = config_text(mock_url, redis.url)
        replicas = []
        for name in ("one", "two"):
            (tmp_path / name).mkdir()
            replicas.append(stack.enter_context(example_gateway(config, tmp_path / name, ENV)))
        sdks = [
            anthropic.Anthropic(base_url=url, api_key="caller", max_retries=0) for url in replicas
        ]
        users = [f"replica-user-{i}" for i in range(24)]
        histories: dict[str, list[anthropic.types.MessageParam]] = {u: [] for u in users}

        def turn(user: str, replica: int) -> tuple[str, int]:
            """One more turn of `user`'s conversation on `replica`: (key reached, cache read)."""
            history = histories[user]
            opening = f"{user} opens with a long prompt. " * 30
            history.append({"role": "user", "content": opening if not history else "and?"})
            answer = sdks[replica].messages.create(
                model=MODEL, max_tokens=8, messages=history, metadata={"user_id": user}
            )
            history.append({"role": "assistant", "content": answer.content[0].text})  # type: ignore[union-attr]
            return mock.requests[-1].key, answer.usage.cache_read_input_tokens or 0

        # Four turns each, alternating replicas: every turn on the account the user id ranks
        # first, and from the second turn on, read from that account's cache.
        for i in range(4):
            for n, user in enumerate(users):
                key, read = turn(user, (n + i) % 2)
                assert key == f"key-{first_choice(user)}", (user, i)
                assert (read > 0) == (i > 0), (user, i, read)
        assert len({first_choice(u) for u in users}) == len(NAMES)

        # rep-b fails on replica one and cools (failure_threshold 1): its conversations move
        # to their next account on both replicas, every other conversation stays.
        mock.set_behaviour(ENV["KEY_B"], Behaviour(status=500))
        moved = [u for u in users if first_choice(u) == "rep-b"]
        key, _ = turn(moved[0], 0)  # the fault, then the failover within the same request
        assert key == f"key-{first_choice(moved[0], without='rep-b')}"
        wait_until_cooled(replicas[1], "rep-b")
        faults = sum(r.key == ENV["KEY_B"] for r in mock.requests)
        for i in range(2):
            for n, user in enumerate(users):
                key, _ = turn(user, (n + i) % 2)
                assert key == f"key-{first_choice(user, without='rep-b')}", (user, i)
        assert sum(r.key == ENV["KEY_B"] for r in mock.requests) == faults  # not tried again
        for sdk in sdks:
            sdk.close()
