"""Failover across providers: which Envoy cluster each attempt of a request goes to.

Envoy's retries stay on the cluster a request was routed to, unless that cluster is an
aggregate (`envoy.clusters.aggregate`): its priority levels are its clusters' in order, and
the route's retry priority `envoy.retry_priorities.previous_priorities` (`update_frequency:
1`) sends each retry to the next one, round after round (measured with Envoy 1.40: two
clusters both refusing, four attempts went a, b, a, b). Envoy picks the cluster; the
processor picks the account on it and sets its credential and body.

`server.envoy_failover` names the aggregates and their clusters in order. A request whose
first account is on the first cluster of an aggregate is routed to it. Each attempt's
cluster is known from its endpoint's metadata (`filter_metadata.switchyard.cluster`, which
the upstream-level filter asks for as the `xds.upstream_host_metadata` attribute: the
aggregate runs its own upstream filters, not its clusters'), else predicted by Envoy's order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from google.protobuf import text_format

from .._protos.envoy.config.core.v3 import base_pb2

HOST_METADATA_ATTRIBUTE = "xds.upstream_host_metadata"
"""The attempt's endpoint metadata, in protobuf text format (Envoy 1.40)."""
METADATA_NAMESPACE = "switchyard"
METADATA_KEY = "cluster"


class Aggregates:
    """The aggregate clusters of `server.envoy_failover`, by the cluster that heads each."""

    def __init__(self, aggregates: Mapping[str, Sequence[str]]) -> None:
        self._heads: dict[str, tuple[str, tuple[str, ...]]] = {}
        for name, clusters in aggregates.items():
            self._heads.setdefault(clusters[0], (name, tuple(clusters)))

    def route(self, cluster: str) -> str:
        """The cluster a request whose first account is on `cluster` is routed to."""
        head = self._heads.get(cluster)
        return cluster if head is None else head[0]

    def order(self, cluster: str) -> tuple[str, ...]:
        """The clusters its attempts go to, in Envoy's order (one: no failover across)."""
        head = self._heads.get(cluster)
        return (cluster,) if head is None else head[1]


def next_cluster(order: Sequence[str], attempts: int) -> str:
    """The cluster of the attempt after `attempts` of them: each retry goes to the next
    cluster of `order`, and after the last back to the first."""
    return order[attempts % len(order)]


def host_cluster(metadata: str | None) -> str | None:
    """The cluster an attempt's endpoint names in its metadata; None when it names none or
    the text does not parse."""
    if not metadata:
        return None
    parsed = base_pb2.Metadata()
    try:
        text_format.Parse(metadata, parsed)
    except text_format.ParseError:
        return None
    fields = parsed.filter_metadata.get(METADATA_NAMESPACE)
    if fields is None or METADATA_KEY not in fields.fields:
        return None
    value = fields.fields[METADATA_KEY]
    return value.string_value if value.HasField("string_value") else None
