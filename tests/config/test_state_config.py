"""`[state]` config: validation with key paths, the check-config line, and the stack's wiring."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from redis_server import RedisServer, running_redis, until
from switchyard_mw.asgi.stack import switchyard_stack
from switchyard_mw.cli import main
from switchyard_mw.config import parse_config
from switchyard_mw.core.pool import BreakerState, Outcome
from switchyard_mw.engine.claims import acquire_shared
from switchyard_mw.errors import ConfigError, StartupError
from switchyard_mw.state import MemoryStore, build_store
from switchyard_mw.state.redis_store import RedisStore

CLIENT = """
[llm_clients.a]
base_url = "http://127.0.0.1:9"
models = ["m"]
failure_threshold = 1
"""


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(textwrap.dedent(text))
    return list(info.value.problems)


def test_memory_is_the_default() -> None:
    state = parse_config(CLIENT).state
    assert (state.backend, state.url, state.key_prefix) == ("memory", None, "switchyard")
    assert (state.timeout_ms, state.probe_lease_secs) == (100, 60.0)


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ('backend = "redis"', 'state.url: required when backend = "redis"'),
        ('backend = "etcd"', 'state.backend: expected one of "memory", "redis"'),
        ('backend = "redis"\nurl = "http://x"', "state.url: must start with redis://"),
        ('key_prefix = ""', "state.key_prefix: must not be empty"),
        ("timeout_ms = 0", "state.timeout_ms: must be > 0"),
        ("probe_lease_secs = -1", "state.probe_lease_secs: must be > 0"),
        ("ttl = 5", "state.ttl: unknown key"),
        ('mode = "shards"', 'state.mode: expected one of "standalone", "cluster", "sentinel"'),
        (
            'backend = "redis"\nmode = "sentinel"',
            'state.sentinels: required when mode = "sentinel"',
        ),
        ('mode = "sentinel"\nsentinels = ["10.0.0.1"]', "state.sentinels[0]: '10.0.0.1' is not"),
        ('mode = "sentinel"\nsentinels = ["a:1", "b:x"]', "state.sentinels[1]: 'b:x' is not"),
        (
            'url = "redis://a:1"\nsentinels = ["a:1"]',
            'state.sentinels: only with mode = "sentinel"',
        ),
        ('mode = "sentinel"\nsentinels = ["a:1"]\nservice = ""', "state.service: must not"),
        (
            'mode = "cluster"\nurl = "redis://a:1/2"',
            "state.url: a Redis Cluster has only database 0",
        ),
        ('mode = "cluster"\nurl = "unix:///tmp/r.sock"', "state.url: a Redis Cluster is reached"),
    ],
)
def test_bad_state_tables_name_the_key(table: str, expected: str) -> None:
    found = problems(f"[state]\n{table}\n")
    assert any(p.startswith(expected) for p in found), found


def test_check_config_names_the_backend_without_credentials(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "s.toml"
    path.write_text(
        CLIENT + '[state]\nbackend = "redis"\nurl = "redis://:hunter2@10.0.0.5:6380/2"\n'
    )
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "state: redis at redis://10.0.0.5:6380, key prefix 'switchyard'" in out
    assert "hunter2" not in out


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        (
            'mode = "cluster"\nurl = "redis://:pw@10.0.0.5:7000"',
            "state: redis at cluster redis://10.0.0.5:7000, key prefix 'switchyard'",
        ),
        (
            'mode = "sentinel"\nsentinels = ["10.0.0.1:26379", "[::1]:26380"]\nservice = "sy"',
            "state: redis at sentinel 'sy' via 10.0.0.1:26379, [::1]:26380, key prefix",
        ),
        (
            'mode = "sentinel"\nsentinels = ["s:26379"]\nurl = "rediss://:pw@x/3"',
            "state: redis at sentinel 'mymaster' via s:26379, key prefix",
        ),
    ],
)
def test_check_config_names_the_mode(
    table: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "s.toml"
    path.write_text(CLIENT + f'[state]\nbackend = "redis"\n{table}\n')
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert expected in out
    assert "pw" not in out


def test_a_sentinel_store_asks_the_named_sentinels() -> None:
    text = '[state]\nbackend = "redis"\nmode = "sentinel"\nsentinels = ["h:1", "[::1]:2"]\n'
    store = build_store(parse_config(CLIENT + text).state)
    assert isinstance(store, RedisStore)
    assert store._target.sentinels == (("h", 1), ("::1", 2))


def test_cluster_mode_names_the_redis_py_it_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    from redis.asyncio.cluster import RedisCluster

    monkeypatch.delattr(RedisCluster, "pubsub")  # as in redis-py < 8
    text = '[state]\nbackend = "redis"\nmode = "cluster"\nurl = "redis://h:7000"\n'
    with pytest.raises(StartupError, match=r"redis-py >= 8\.0"):
        build_store(parse_config(CLIENT + text).state)


async def test_the_stack_keeps_state_in_memory_by_default() -> None:
    stack = switchyard_stack(_app, config=parse_config(CLIENT), environ={})
    assert isinstance(stack.store, MemoryStore)
    await stack.aclose()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    yield from running_redis(tmp_path)


async def test_two_stacks_on_one_redis_share_a_cooling(redis_server: RedisServer) -> None:
    text = CLIENT + f'[state]\nbackend = "redis"\nurl = "{redis_server.url}"\nkey_prefix = "s"\n'
    config = parse_config(text)
    first = switchyard_stack(_app, config=config, environ={})
    second = switchyard_stack(_app, config=config, environ={})
    try:
        assert isinstance(first.store, RedisStore)
        for stack in (first, second):  # the first ASGI call (lifespan here) starts the store
            await stack({"type": "lifespan"}, _receive_shutdown, _ignore)
        await until(lambda: first.store.healthy and second.store.healthy)  # type: ignore[attr-defined]
        lease = await acquire_shared(first.pool, "m")
        assert lease is not None
        first.pool.record(lease, Outcome.FAULT)
        await until(lambda: second.pool.status_of("a").state is BreakerState.COOLED)
    finally:
        await first.aclose()
        await second.aclose()
    assert not first.store.healthy  # type: ignore[attr-defined]


async def _app(scope: object, receive: object, send: object) -> None:
    pass


async def _receive_shutdown() -> dict[str, str]:
    return {"type": "lifespan.shutdown"}


async def _ignore(message: object) -> None:
    pass


@pytest.mark.parametrize("name", ["a", "x}y", "{x", "a{b}c", "über", "a b", "}{", "{}"])
def test_both_keys_of_an_account_hash_to_one_slot(name: str) -> None:
    from redis.crc import key_slot

    from switchyard_mw.state._lua import keys

    account, probe = keys("switchyard", name)
    same = key_slot(account.encode()) == key_slot(probe.encode())
    # The one way to break it, a name opening with "}", cluster mode refuses (and a braced prefix).
    assert same or name.startswith("}")


def test_a_name_opening_with_a_brace_would_split_its_keys() -> None:
    """Why cluster mode refuses such a name: its keys land in different slots."""
    from redis.crc import key_slot

    from switchyard_mw.state._lua import keys

    account, probe = keys("switchyard", "}x")
    assert key_slot(account.encode()) != key_slot(probe.encode())


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ('key_prefix = "sy{a}"', 'state.key_prefix: no "{" or "}" in cluster mode'),
        ('[llm_clients."}x"]\nbase_url = "http://h"\nmodels = ["m"]', 'llm_clients."}x": in cl'),
    ],
)
def test_cluster_mode_refuses_what_would_split_an_account_over_slots(
    extra: str, expected: str
) -> None:
    head, _, table = extra.partition("[llm_clients")
    text = f'[state]\nbackend = "redis"\nmode = "cluster"\nurl = "redis://h:1"\n{head}\n'
    found = problems(CLIENT + text + (f"[llm_clients{table}\n" if table else ""))
    assert any(p.startswith(expected) for p in found), found
