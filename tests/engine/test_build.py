"""`engine.build`: one config to one engine, per front; `engine.reload.rebuild` on top of it."""

from __future__ import annotations

import functools
from pathlib import Path

import httpx
import pytest

from switchyard_mw.accounts import build_accounts, pool_from_accounts
from switchyard_mw.asgi.cooling import CoolingMiddleware
from switchyard_mw.asgi.stack import switchyard_stack
from switchyard_mw.config import load_config, parse_config
from switchyard_mw.core.pool import BreakerState, Outcome
from switchyard_mw.engine import build, reload
from switchyard_mw.engine.build import Front, build_engine
from switchyard_mw.extproc import Policies
from switchyard_mw.state import MemoryStore
from switchyard_mw.state.limit_stores import LocalLimits
from switchyard_mw.telemetry import request_metrics

ENV = {"KEY_A": "a", "KEY_B": "b", "TENANT_KEY": "t"}


def config_text(*, a_url: str = "http://a.test", b_hedges: bool = False, extra: str = "") -> str:
    hedge = "hedge_after_secs = 1.0" if b_hedges else ""
    return f"""
[llm_clients.acct-a]
base_url = "{a_url}"
api_key_env = "KEY_A"
models = ["base", "var"]
envoy_cluster = "a"
failure_threshold = 1
cooldown_secs = 60

[llm_clients.acct-b]
base_url = "http://b.test"
api_key_env = "KEY_B"
models = ["base"]
failure_threshold = 1
cooldown_secs = 60
{hedge}

[canaries.base]
variants = {{ var = 10.0 }}

[routes.auto]
classifier = "llm"
judge = "acct-a"
judge_model = "base"
choices = {{ easy = "base" }}
fallback = "base"

[tenants.team]
keys_env = "TENANT_KEY"
{extra}
"""


def test_the_asgi_front_gets_every_part_and_hedging_where_an_account_hedges() -> None:
    config = parse_config(config_text(b_hedges=True))
    engine = build_engine(config, front=Front.ASGI, environ=ENV)
    assert engine.config is config
    assert set(engine.accounts) == {"acct-a", "acct-b"}
    assert set(engine.pool.names) == {"acct-a", "acct-b"}
    assert engine.judge is not None
    assert engine.judge.routes.keys() == {"auto"}
    assert engine.canaries is not None
    assert isinstance(engine.store, MemoryStore)
    assert isinstance(engine.limit_store, LocalLimits)
    assert engine.tenancy is not None
    assert engine.hedging is not None
    assert engine.routable is None  # the stack sends to any account
    assert engine.pool in request_metrics._pools  # `switchyard.account.state` reports it
    request_metrics.unwatch(engine.pool)


def test_no_account_hedging_builds_no_hedging() -> None:
    engine = build_engine(parse_config(config_text()), front=Front.ASGI, environ=ENV)
    assert engine.hedging is None


def test_the_envoy_front_routes_to_clustered_accounts_and_never_hedges() -> None:
    engine = build_engine(parse_config(config_text(b_hedges=True)), front=Front.ENVOY, environ=ENV)
    assert engine.routable == frozenset({"acct-a"})  # acct-b has no envoy_cluster
    assert engine.hedging is None  # Envoy sends each attempt once
    assert engine.rewrites_retries is False  # no renames, no chains
    assert engine.tenancy is not None


def test_the_envoy_front_rewrites_retries_when_a_chain_can_move_them() -> None:
    text = config_text(extra='\n[fallbacks]\nbase = ["var"]\n')
    engine = build_engine(parse_config(text), front=Front.ENVOY, environ=ENV)
    assert engine.chains is not None
    assert engine.rewrites_retries is True


def test_the_cooling_front_builds_no_judge_canaries_or_tenants() -> None:
    engine = build_engine(parse_config(config_text()), front=Front.COOLING, environ=ENV)
    assert engine.judge is None
    assert engine.canaries is None
    assert engine.tenancy is None
    assert engine.limit_store is None
    assert engine.hedging is None
    assert isinstance(engine.store, MemoryStore)


def test_a_pool_shared_with_the_cooling_policy_gets_no_state_store_of_its_own() -> None:
    # Its owner binds it to `[state]`: a second Redis store bound to it would double every
    # change (and connect to a server here that does not exist).
    text = config_text() + '\n[state]\nbackend = "redis"\nurl = "redis://127.0.0.1:1/0"\n'
    config = parse_config(text)
    pool = pool_from_accounts(build_accounts(config, ENV))
    engine = build_engine(config, front=Front.COOLING, environ=ENV, pool=pool)
    assert engine.pool is pool
    assert isinstance(engine.store, MemoryStore)


def test_parts_handed_in_are_used_not_built() -> None:
    config = parse_config(config_text())
    accounts = build_accounts(config, ENV)
    pool, store, limits = pool_from_accounts(accounts), MemoryStore(), LocalLimits()
    http = httpx.AsyncClient()
    engine = build_engine(
        config,
        accounts,
        front=Front.ENVOY,
        environ=ENV,
        pool=pool,
        store=store,
        limit_store=limits,
        judge_http_client=http,
    )
    assert engine.pool is pool
    assert engine.store is store
    assert engine.limit_store is limits
    assert engine.judge is not None
    assert engine.judge.http is http
    assert not engine.judge.owns_http


def test_every_front_holds_the_engine_the_builder_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[object] = []
    real = build.build_engine

    def counting(*args: object, **kwargs: object) -> object:
        engine = real(*args, **kwargs)  # type: ignore[arg-type]
        built.append(engine)
        return engine

    for module in ("switchyard_mw.asgi.stack", "switchyard_mw.asgi.cooling"):
        monkeypatch.setattr(f"{module}.build_engine", counting)
    monkeypatch.setattr("switchyard_mw.extproc.policy.build_engine", counting)
    monkeypatch.setenv("TENANT_KEY", "t")  # the processor reads tenants' keys from os.environ
    config = parse_config(config_text())
    stack = switchyard_stack(lambda *_: None, config=config, environ=ENV, reload_on_signal=False)
    cooling = CoolingMiddleware(lambda *_: None, config=config, environ=ENV)
    policies = Policies(config, build_accounts(config, ENV))
    assert built == [stack.engine, cooling.engine, policies.engine]
    assert stack.cooling.engine is stack.engine  # the stack's policies are its faces
    assert stack.judge.judge is stack.engine.judge
    assert stack.variant.canaries is stack.engine.canaries
    assert (stack.store, stack.limit_store, stack.tenancy) == (
        stack.engine.store,
        stack.engine.limit_store,
        stack.engine.tenancy,
    )


def test_rebuild_carries_health_the_stores_and_the_judge_pool_over(tmp_path: Path) -> None:
    path = tmp_path / "switchyard.toml"
    path.write_text(config_text())
    http = httpx.AsyncClient()
    current = build_engine(
        load_config(path), front=Front.ENVOY, environ=ENV, judge_http_client=http
    )
    for name in ("acct-a", "acct-b"):
        lease = current.pool.acquire("base", allowed={name})
        assert lease is not None
        current.pool.record(lease, Outcome.FAULT)
    path.write_text(config_text(a_url="http://a2.test"))  # acct-a is another account now
    engine = reload.rebuild(current, functools.partial(load_config, path), Front.ENVOY, ENV)
    assert not isinstance(engine, list)
    assert engine.pool is not current.pool
    assert engine.pool.status_of("acct-b").state is BreakerState.COOLED  # same name and URL
    assert engine.pool.status_of("acct-a").state is BreakerState.CLOSED
    assert engine.store is current.store
    assert engine.limit_store is current.limit_store  # what was spent stays spent
    assert engine.judge is not None
    assert engine.judge.http is http
    assert engine.routable == frozenset({"acct-a"})  # built for the same front
    assert current.pool not in request_metrics._pools
    assert engine.pool in request_metrics._pools
    request_metrics.unwatch(engine.pool)


def test_rebuild_refuses_a_changed_state_table_and_keeps_the_engine(tmp_path: Path) -> None:
    path = tmp_path / "switchyard.toml"
    path.write_text(config_text())
    current = build_engine(load_config(path), front=Front.ASGI, environ=ENV)
    path.write_text(config_text() + '\n[state]\nbackend = "redis"\nurl = "redis://x:1/0"\n')
    problems = reload.rebuild(current, functools.partial(load_config, path), Front.ASGI, ENV)
    assert problems == ["state: changed; [state] takes effect at a restart, not a reload"]
    assert current.pool in request_metrics._pools
    request_metrics.unwatch(current.pool)


def test_the_processor_reads_tenants_keys_where_its_reload_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `switchyard-mw extproc` reads keys from one environment at start-up and at each reload.
    monkeypatch.delenv("TENANT_KEY", raising=False)
    config = parse_config(config_text())
    policies = Policies(config, build_accounts(config, ENV), environ=ENV)
    assert policies.tenancy is not None
    request_metrics.unwatch(policies.pool)


@pytest.mark.parametrize(
    ("extra_a", "server", "guard", "renaming", "resumes", "guarded"),
    [
        ("", "", "", set(), False, set()),
        (
            'resume_streams = true\nmodels = { base = "base-2026", var = "var" }',
            "",
            "",
            {"acct-a"},
            True,
            set(),
        ),
        ("", "[server]\nresume_streams = true\n", "", set(), True, set()),
        (
            "",
            "",
            "guard = { max_fault_rate = 0.2, min_requests = 5, window_secs = 60 }",
            set(),
            False,
            {"base", "var"},
        ),
    ],
    ids=["plain", "an-account-renames-and-resumes", "the-server-resumes", "a-guarded-canary"],
)
def test_the_success_path_s_facts_are_worked_out_at_load(
    extra_a: str, server: str, guard: str, renaming: set[str], resumes: bool, guarded: set[str]
) -> None:
    """What a plain success reads rather than asks: which accounts bind an attempt to the
    model's own name, whether a stream is watched for its break, which models a guard counts."""
    text = f"""
{server}
[llm_clients.acct-a]
base_url = "http://a.test"
api_key_env = "KEY_A"
{extra_a or 'models = ["base", "var"]'}

[llm_clients.acct-b]
base_url = "http://b.test"
api_key_env = "KEY_B"
models = ["base"]

[canaries.base]
variants = {{ var = 10.0 }}
{guard}
"""
    config = parse_config(text)
    engine = build_engine(config, build_accounts(config, ENV), front=Front.ASGI, environ=ENV)
    grounds = engine.grounds
    assert grounds.renaming == renaming
    assert grounds.resumes_streams is resumes
    assert engine.canaries is not None
    assert engine.canaries.guarded == guarded
