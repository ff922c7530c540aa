"""Which cluster each attempt goes to through an aggregate (`extproc.failover`)."""

from __future__ import annotations

import msgspec

from extproc_helpers import (
    Stream,
    immediate,
    request_body,
    request_headers,
    response_body,
    response_headers,
    sets,
    upstream_headers,
)
from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.extproc import ExtProcServicer, Policies
from switchyard_mw.extproc.failover import Aggregates, host_cluster, next_cluster

AGGREGATES = Aggregates(
    {"a-then-b": ["pa", "pb"], "b-then-a": ["pb", "pa"], "c3": ["pc", "pa", "pb"]}
)


def test_a_request_is_routed_to_the_aggregate_its_cluster_heads() -> None:
    assert AGGREGATES.route("pa") == "a-then-b"
    assert AGGREGATES.route("pb") == "b-then-a"
    assert AGGREGATES.order("pc") == ("pc", "pa", "pb")


def test_a_cluster_heading_none_is_routed_to_itself() -> None:
    assert AGGREGATES.route("pz") == "pz"
    assert AGGREGATES.order("pz") == ("pz",)


def test_retries_go_round_the_clusters_as_envoy_s_previous_priorities_do() -> None:
    # Measured with Envoy 1.40, two clusters both refusing: a, b, a, b.
    order = ("pa", "pb")
    assert [next_cluster(order, n) for n in range(1, 5)] == ["pb", "pa", "pb", "pa"]
    assert [next_cluster(("pz",), n) for n in range(1, 3)] == ["pz", "pz"]


def test_the_endpoint_s_metadata_names_its_cluster() -> None:
    # As Envoy 1.40 sends the xds.upstream_host_metadata attribute.
    text = (
        'filter_metadata { key: "switchyard" value { fields { key: "cluster" '
        'value { string_value: "pb" } } } } '
    )
    assert host_cluster(text) == "pb"


def test_metadata_naming_no_cluster_is_none() -> None:
    assert host_cluster(None) is None
    assert host_cluster("") is None
    assert host_cluster('filter_metadata { key: "other" value { } }') is None
    number = (
        'filter_metadata { key: "switchyard" value { fields { key: "cluster" '
        "value { number_value: 1 } } } }"
    )
    assert host_cluster(number) is None
    assert host_cluster("filter_metadata {") is None


# --- the processor, driven message by message as Envoy drives it ------------------------------

CONFIG = """
[llm_clients.a1]
base_url = "https://one.example"
api_key_env = "KEY_A1"
models = ["m"]
envoy_cluster = "prov"

[llm_clients.a2]
base_url = "https://one.example"
api_key_env = "KEY_A2"
models = ["m"]
priority = 1
envoy_cluster = "prov"

[llm_clients.b]
base_url = "https://other.example"
api_key_env = "KEY_B"
auth = "x-api-key"
models = ["m"]
priority = 2
envoy_cluster = "other"

[server.envoy_failover]
"prov-then-other" = ["prov", "other"]
"""
KEYS = {"KEY_A1": "ka1", "KEY_A2": "ka2", "KEY_B": "kb"}
RID = "rid-failover"
UPSTREAM = [("x-switchyard-filter", "upstream")]
BODY = msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


async def _refused_then_retried(cluster: str | None) -> dict[str, bytes]:
    """a1 answers 500; the retry's request headers, its endpoint naming `cluster`: what the
    processor sets on them."""
    config = parse_config(CONFIG)
    servicer = ExtProcServicer(Policies(config, build_accounts(config, KEYS)))
    router = Stream(servicer)
    await router.send(request_headers(extra={"x-request-id": RID}))
    routed = sets(await router.send(request_body(BODY)))
    assert routed["x-switchyard-cluster"] == b"prov-then-other"
    assert routed["authorization"] == b"Bearer ka1"
    refused = Stream(servicer, UPSTREAM)
    answer = await refused.send(response_headers(500, request_id=RID))
    assert sets(answer)["x-switchyard-retry"] == b"1"
    await refused.close()
    retry = Stream(servicer, UPSTREAM)
    retried = sets(
        await retry.send(upstream_headers({"x-request-id": RID}, attempt=2, cluster=cluster))
    )
    await retry.close()
    await router.close()
    return retried


async def test_from_routing_on_the_machine_reaches_the_cluster_of_envoy_s_next_try() -> None:
    """Some next tries are decided before any upstream-level stream could aim the machine:
    the hedge's arming and a late first token's retry (the first-token filter's bound). From
    routing on, its reach is the cluster Envoy's next try goes to: through an aggregate, the
    other provider's (tests/engine/test_two_fronts_hedge.py shows both through both fronts)."""
    config = parse_config(CONFIG)
    servicer = ExtProcServicer(Policies(config, build_accounts(config, KEYS)))
    router = Stream(servicer)
    await router.send(request_headers(extra={"x-request-id": RID}))
    await router.send(request_body(BODY))
    flight = servicer.flights.find(RID)
    assert flight is not None
    assert flight.machine is not None
    assert set(flight.machine.within or ()) == {"b"}
    await router.close()


async def test_the_retry_goes_with_the_other_provider_s_account() -> None:
    retried = await _refused_then_retried("other")
    assert retried["x-api-key"] == b"kb"


async def test_without_the_endpoint_s_word_envoy_s_order_says_the_cluster() -> None:
    retried = await _refused_then_retried(None)
    assert retried["x-api-key"] == b"kb"


async def test_the_endpoint_s_cluster_wins_over_the_order() -> None:
    """Envoy sent the retry back to prov (say, other's hosts were unhealthy): the account
    is one of prov's, never the other provider's key to prov's host."""
    retried = await _refused_then_retried("prov")
    assert retried["authorization"] == b"Bearer ka2"
    assert "x-api-key" not in retried


async def test_no_retry_in_place_when_the_retry_would_go_to_another_provider() -> None:
    """a1 alone on its cluster may be retried in place after a 429's short wait, but Envoy
    would send that retry to the other provider's cluster: not asked for (a1's key would
    go to the other provider's host), and the 429 is the answer."""
    text = CONFIG.replace(
        'priority = 1\nenvoy_cluster = "prov"', 'priority = 1\nenvoy_cluster = "x"'
    )
    text = text.replace(
        'models = ["m"]\nenvoy_cluster = "prov"',
        'models = ["m"]\nretry_wait_max_secs = 5\nenvoy_cluster = "prov"',
        1,
    )
    config = parse_config(text)
    policies = Policies(config, build_accounts(config, KEYS))
    policies.pool.hold("b", "m", 30)  # the other provider cannot serve now
    servicer = ExtProcServicer(policies)
    router = Stream(servicer)
    await router.send(request_headers(extra={"x-request-id": RID}))
    routed = sets(await router.send(request_body(BODY)))
    assert routed["x-switchyard-cluster"] == b"prov-then-other"
    refused = Stream(servicer, UPSTREAM)
    answer = await refused.send(response_headers(429, {"retry-after": "1"}, request_id=RID))
    if answer.HasField("mode_override"):  # a 429's body is read (a billing refusal?)
        answer = await refused.send(response_body(b'{"type":"error"}', end=True))
    assert "x-switchyard-retry" not in sets(answer)
    assert "x-switchyard-retry-after" not in sets(answer)
    await refused.close()
    await router.close()


async def test_a_retry_in_place_on_a_cluster_of_one_provider_is_still_asked_for() -> None:
    """The same without the aggregate: the retry stays on a1's cluster, and waits."""
    text = CONFIG.split("[server.envoy_failover]")[0]
    text = text.replace('priority = 1\nenvoy_cluster = "prov"', 'priority = 1\nenvoy_cluster = "x"')
    text = text.replace(
        'models = ["m"]\nenvoy_cluster = "prov"',
        'models = ["m"]\nretry_wait_max_secs = 5\nenvoy_cluster = "prov"',
        1,
    )
    config = parse_config(text)
    servicer = ExtProcServicer(Policies(config, build_accounts(config, KEYS)))
    router = Stream(servicer)
    await router.send(request_headers(extra={"x-request-id": RID}))
    await router.send(request_body(BODY))
    refused = Stream(servicer, UPSTREAM)
    answer = await refused.send(response_headers(429, {"retry-after": "1"}, request_id=RID))
    if answer.HasField("mode_override"):
        answer = await refused.send(response_body(b'{"type":"error"}', end=True))
    assert sets(answer)["x-switchyard-retry-after"] == b"1"
    await refused.close()
    await router.close()


async def test_a_retry_on_another_provider_with_no_account_there_carries_no_key() -> None:
    """The other provider's account was free when the retry was asked for and is held by
    the time Envoy sends it there: the previous account's key does not go along."""
    config = parse_config(CONFIG)
    policies = Policies(config, build_accounts(config, KEYS))
    servicer = ExtProcServicer(policies)
    router = Stream(servicer)
    await router.send(request_headers(extra={"x-request-id": RID}))
    await router.send(request_body(BODY))
    refused = Stream(servicer, UPSTREAM)
    answer = await refused.send(response_headers(500, request_id=RID))
    assert sets(answer)["x-switchyard-retry"] == b"1"
    await refused.close()
    policies.pool.hold("b", "m", 30)  # meanwhile
    retry = Stream(servicer, UPSTREAM)
    sent = await retry.send(upstream_headers({"x-request-id": RID}, attempt=2, cluster="other"))
    await retry.close()
    await router.close()
    # The machine's answer when no account is left (the 500 was not held to pass on).
    status, _, body = immediate(sent)
    assert (status, body["error"]["type"]) == (502, "upstream_unreachable")
