"""`server.envoy_failover`: aggregate clusters and the provider clusters each tries in order."""

from __future__ import annotations

import textwrap

import pytest

from switchyard_mw.config import config_warnings, parse_config
from switchyard_mw.errors import ConfigError

ACCOUNTS = """
[llm_clients.a]
base_url = "http://a"
models = ["m"]
envoy_cluster = "pa"
[llm_clients.b]
base_url = "http://b"
models = ["m"]
envoy_cluster = "pb"
"""


def problems(failover: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(ACCOUNTS + textwrap.dedent(failover))
    return list(info.value.problems)


def test_aggregates_keep_their_order() -> None:
    config = parse_config(ACCOUNTS + '[server.envoy_failover]\n"a-b" = ["pa", "pb"]\n')
    assert config.server.envoy_failover == {"a-b": ["pa", "pb"]}


def test_an_aggregate_of_one_cluster_is_refused() -> None:
    (problem,) = problems('[server.envoy_failover]\n"a" = ["pa"]\n')
    assert "server.envoy_failover" in problem


def test_a_cluster_named_twice_in_one_aggregate_is_refused() -> None:
    assert problems('[server.envoy_failover]\n"a-b" = ["pa", "pb", "pa"]\n') == [
        "server.envoy_failover.a-b: names a cluster twice"
    ]


def test_a_cluster_heading_two_aggregates_is_refused() -> None:
    (problem,) = problems('[server.envoy_failover]\n"x" = ["pa", "pb"]\n"y" = ["pa", "pc"]\n')
    assert problem.startswith('server.envoy_failover.y: "pa" heads "x" already')


def test_a_cluster_no_account_is_on_is_warned_of() -> None:
    """A retry Envoy sends there finds no account: the aggregate would only lose retries."""
    config = parse_config(ACCOUNTS + '[server.envoy_failover]\n"a-z" = ["pa", "pz"]\n')
    assert config_warnings(config) == [
        'server.envoy_failover.a-z: no account has envoy_cluster = "pz": a retry Envoy '
        "sends there is refused"
    ]


def test_aggregates_over_accounts_clusters_are_not_warned_of() -> None:
    config = parse_config(ACCOUNTS + '[server.envoy_failover]\n"a-b" = ["pa", "pb"]\n')
    assert config_warnings(config) == []
