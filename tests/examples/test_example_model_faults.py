"""Faults per (account, model) and the return after an outage, through the example gateway
(uvicorn) with the official OpenAI SDK and the bundled mock provider.

`dual` serves two models on one key, `spare` (lower priority) the same two. Model A's 503s
cool (dual, gpt-a) only: gpt-b keeps going to dual. A 401 is the key's: both models move.
Then a primary down 60 s with a request every 4 s: it serves again within 30 s of healing
(that timeline ten times faster: `SCALE`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from servers import example_gateway, serve_in_thread
from switchyard_mw.config import LLMClient
from switchyard_mw.testing import Behaviour, MockProvider

pytestmark = pytest.mark.integration

ENV = {"KEY_DUAL": "key-dual", "KEY_SPARE": "key-spare"}
MESSAGES: Any = [{"role": "user", "content": "hi"}]


SCALE = 10
"""The outage timeline runs this many times faster than the issue's: every period of it (the
outage, the request interval, the cooling and its cap) divided by it; the order of its events
and its counts are the issue's."""


def config(mock_url: str, *, threshold: int = 2, periods: str = "") -> str:
    return f"""
[llm_clients.dual]
base_url = "{mock_url}"
api_key_env = "KEY_DUAL"
models = ["gpt-a", "gpt-b"]
failure_threshold = {threshold}
{periods}

[llm_clients.spare]
base_url = "{mock_url}"
api_key_env = "KEY_SPARE"
models = ["gpt-a", "gpt-b"]
priority = 1
"""


@pytest.fixture(scope="module")
def mock() -> Iterator[tuple[MockProvider, str]]:
    provider = MockProvider()
    with serve_in_thread(provider) as url:
        yield provider, url


@pytest.fixture
def gateway(mock: tuple[MockProvider, str], tmp_path: Path) -> Iterator[str]:
    mock[0].reset()
    with example_gateway(config(mock[1]), tmp_path, ENV) as url:
        yield url


def ask(client: openai.OpenAI, model: str, *, stream: bool = False) -> str:
    """One request; the account that answered it (the text arrived whole)."""
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, stream=stream
    )
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)  # type: ignore[union-attr]
    else:
        text = raw.parse().choices[0].message.content or ""  # type: ignore[union-attr]
    assert text
    return raw.headers["x-switchyard-account"]


def accounts(gateway: str) -> dict[str, Any]:
    found = httpx.get(f"{gateway}/switchyard/accounts").json()["accounts"]
    return {a["name"]: a for a in found}


def tries(provider: MockProvider, key: str, model: str) -> int:
    return sum(1 for r in provider.requests if r.key == key and r.model == model)


@pytest.mark.parametrize("stream", [False, True])
def test_model_as_503s_do_not_move_model_bs_traffic(
    gateway: str, mock: tuple[MockProvider, str], stream: bool
) -> None:
    provider, _ = mock
    provider.set_behaviour("key-dual", Behaviour(status=503, status_models=["gpt-a"]))
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="caller", max_retries=0)
    assert [ask(client, "gpt-a", stream=stream) for _ in range(4)] == ["spare"] * 4
    assert [ask(client, "gpt-b", stream=stream) for _ in range(4)] == ["dual"] * 4
    assert tries(provider, "key-dual", "gpt-a") == 2  # the threshold; then cooled for gpt-a
    assert tries(provider, "key-dual", "gpt-b") == 4
    assert tries(provider, "key-spare", "gpt-b") == 0
    dual = accounts(gateway)["dual"]
    assert (dual["state"], dual["cause"]) == ("closed", None)
    assert list(dual["models"]) == ["gpt-a"]
    assert dual["models"]["gpt-a"]["state"] == "cooled"
    assert dual["models"]["gpt-a"]["cause"] == "outage"
    assert 25 < dual["models"]["gpt-a"]["cooled_for_secs"] <= 30
    assert accounts(gateway)["spare"]["models"] == {}


def test_a_refused_key_moves_every_model(gateway: str, mock: tuple[MockProvider, str]) -> None:
    provider, _ = mock
    provider.set_behaviour("key-dual", Behaviour(status=401))
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="caller", max_retries=0)
    assert [ask(client, "gpt-b") for _ in range(2)] == ["spare"] * 2  # 2 refusals: cooled
    assert [ask(client, m) for m in ("gpt-a", "gpt-b", "gpt-a")] == ["spare"] * 3
    assert tries(provider, "key-dual", "gpt-a") == 0  # never tried: the key was refused
    dual = accounts(gateway)["dual"]
    assert (dual["state"], dual["cause"], dual["models"]) == ("cooled", "credentials", {})


@pytest.mark.timeout(60)  # the timeline itself lasts about 7.5 s
def test_a_primary_down_60_s_serves_again_within_30_s_of_healing(
    mock: tuple[MockProvider, str], tmp_path: Path
) -> None:
    """The issue's timeline `SCALE` times faster (about 7.5 s; 75 s at its real pace): the
    default threshold (3 faults), the default cooling (30 s) and cap (300 s), a request every
    4 s, the primary answering 503 for its first 60 s, each period divided by `SCALE`. Below,
    the comments' times are the issue's seconds."""
    provider, url = mock
    provider.reset()
    defaults = LLMClient(models=["gpt-a"])  # 3 faults, 30 s cooling, 300 s cap
    cooling, cap = defaults.cooldown_secs / SCALE, defaults.max_cooldown_secs / SCALE
    periods = f"cooldown_secs = {cooling}\nmax_cooldown_secs = {cap}"
    text = config(url, threshold=defaults.failure_threshold, periods=periods)
    every, outage, recovery = 4 / SCALE, 60 / SCALE, 30 / SCALE
    with example_gateway(text, tmp_path, ENV) as gateway:
        client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="caller", max_retries=0)
        provider.set_behaviour("key-dual", Behaviour(status=503, status_for_secs=outage))
        start = time.monotonic()
        served: list[tuple[float, str]] = []
        while not served or served[-1][1] != "dual" or served[-1][0] < outage:
            at = time.monotonic() - start
            assert at < outage + recovery + every, f"the primary did not serve again: {served}"
            served.append((at, ask(client, "gpt-a")))
            time.sleep(max(0.0, start + every * len(served) - time.monotonic()))
        back = served[-1][0]
        # The probe at about 40 s fails; the next, at about 72 s (not 100 s), succeeds.
        assert outage < back <= outage + recovery, served
        assert all(a == "spare" for t, a in served if t < outage)  # failed over, never an error
        # The primary saw 3 faults (0, 4, 8 s), the failed probe and the probe that served.
        assert tries(provider, "key-dual", "gpt-a") == 5
        print(f"primary healed at {outage:g} s, served again at {back:.2f} s: {served}")
