"""Which cluster each attempt goes to through an aggregate (`extproc.failover`)."""

from __future__ import annotations

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
