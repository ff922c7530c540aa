"""The Envoy rig of the tests under tests/extproc: the mock provider, switchyard's processor on
a transport, and examples/envoy/envoy.yaml's Envoy in front of both, all on free loopback ports
(`switchyard_mw.testing.envoy.run_on_free_ports`). For the probes that measure what Envoy
itself does, a bare processor of the test's own and an Envoy config around one cluster.

A module starts its rig with the `start_rig` fixture (tests/extproc/conftest.py), giving its
config (a function of the upstream's URL) and the keys its accounts read; each test then
installs the config it needs (`Rig.configure`). Envoy runs from this test process, so it dies
with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from time import monotonic
from typing import Any

import grpc  # type: ignore[import-untyped]
import httpx
import yaml

from servers import ROOT
from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.extproc import ExtProcServer, Policies, Transport, start_server
from switchyard_mw.testing import MockProvider
from switchyard_mw.testing.envoy import EXAMPLE_PORTS, RunningEnvoy, run_on_free_ports

ENVOY_YAML = (ROOT / "examples" / "envoy" / "envoy.yaml").read_text()
"""The example's Envoy config, written with `EXAMPLE_PORTS`."""

ConfigText = Callable[..., str]
"""A module's switchyard config: a function of the URL its accounts call (and of options)."""


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def policies_of(
    text: str, keys: Mapping[str, str], clock: Callable[[], float] = monotonic
) -> Policies:
    """The processor's policies for `text` (a switchyard config), with fresh accounts (their
    keys read from `keys`) and a fresh pool."""
    config = parse_config(text)
    return Policies(config, build_accounts(config, keys), clock=clock)


@dataclass
class Rig:
    """What a rig runs, and the config it was started with, to install it again."""

    mock: MockProvider
    mock_url: str
    """The URL the config's accounts call: the mock's, or the other upstream the rig was
    started with."""
    processor: ExtProcServer
    envoy: RunningEnvoy
    config_text: ConfigText
    keys: Mapping[str, str]
    clock: Callable[[], float] = monotonic
    """What the pools of the policies installed from now on read as the time."""

    @property
    def envoy_url(self) -> str:
        return self.envoy.url

    @property
    def admin_url(self) -> str:
        assert self.envoy.admin_url is not None, "start the rig with admin=True"
        return self.envoy.admin_url

    @property
    def policies(self) -> Policies:
        """The policies the processor serves with now."""
        return self.processor.servicer.policies

    def sent_to(self) -> dict[str, int]:
        """Requests Envoy sent to each cluster so far, by its own counters (admin=True)."""
        stats = httpx.get(f"{self.admin_url}/stats?filter=upstream_rq_total$").text
        counts = {}
        for line in stats.splitlines():
            name, _, value = line.partition(": ")
            counts[name.removeprefix("cluster.").removesuffix(".upstream_rq_total")] = int(value)
        return counts

    def install(self, text: str) -> Policies:
        """`text` (a switchyard config) as the processor's policies for the next requests."""
        policies = policies_of(text, self.keys, self.clock)
        self.processor.servicer.policies = policies
        return policies

    def configure(self, **options: Any) -> Policies:
        """The module's config (with `options`) installed, and the mock reset: each test
        starts on a fresh pool and a provider that answers every key with a fast 200."""
        policies = self.install(self.config_text(self.mock_url, **options))
        self.mock.reset()
        return policies


@dataclass(frozen=True)
class StartRig:
    """Starts rigs on one mock and one processor transport (the `start_rig` fixture)."""

    mock: MockProvider
    mock_url: str
    transport: Transport

    @contextlib.asynccontextmanager
    async def __call__(
        self,
        config_text: ConfigText,
        keys: Mapping[str, str],
        *,
        options: Mapping[str, Any] | None = None,
        upstream: str | None = None,
        otel: int | None = None,
        admin: bool = False,
        runtime: Mapping[str, float | bool | str] | None = None,
        edit: Callable[[str], str] | None = None,
        **server: Any,
    ) -> AsyncIterator[Rig]:
        """The processor serving `config_text(upstream, **options)` (accounts from `keys`)
        and the example's Envoy in front of it, until the block ends; the mock is reset then,
        so that the next rig (the next transport's) starts on a clean provider.

        `upstream`: another upstream's URL than the mock's (the config is written for it and
        Envoy's clusters point at its port); `otel`, `admin`, `runtime`, `edit`: as
        `run_on_free_ports` takes them (`edit` adds clusters, say); `server`: `start_server`'s
        other arguments (`h2_limits`, ...).
        """
        url = upstream if upstream is not None else self.mock_url
        policies = policies_of(config_text(url, **(options or {})), keys)
        processor = await start_server(policies, "127.0.0.1:0", transport=self.transport, **server)
        assert processor.port is not None
        try:
            with run_on_free_ports(
                ENVOY_YAML,
                processor=processor.port,
                upstream=port_of(url),
                otel=otel,
                admin=admin,
                runtime=runtime,
                edit=edit,
            ) as envoy:
                yield Rig(self.mock, url, processor, envoy, config_text, keys)
        finally:
            await processor.stop(grace_secs=1)
            self.mock.reset()


# --- probes: a bare processor of a test's own, and an Envoy config around one cluster -----------

EXTENSIONS = "type.googleapis.com/envoy.extensions"
_CODEC = {
    "name": "envoy.filters.http.upstream_codec",
    "typed_config": {"@type": f"{EXTENSIONS}.filters.http.upstream_codec.v3.UpstreamCodec"},
}


@contextlib.asynccontextmanager
async def bare_processor(servicer: Any) -> AsyncIterator[int]:
    """`servicer` (an ExternalProcessorServicer of the test's own) served by grpc.aio on a free
    loopback port, until the block ends; yields the port."""
    server = grpc.aio.server()
    ep_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
    port: int = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield port
    finally:
        await server.stop(0)


def ext_proc_filter(processing_mode: Mapping[str, str], **settings: Any) -> dict[str, Any]:
    """An upstream ext_proc filter calling the `processor` cluster, failing closed."""
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": f"{EXTENSIONS}.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "processor"}},
            "failure_mode_allow": False,
            "message_timeout": "10s",
            **settings,
            "processing_mode": dict(processing_mode),
        },
    }


def upstream_cluster(
    name: str, ports: Sequence[int] | None = None, filters: Sequence[Mapping[str, Any]] = ()
) -> dict[str, Any]:
    """A static HTTP/1.1 cluster, an endpoint a priority on each of `ports` (default: the
    example's upstream port, which `run_on_free_ports` swaps), `filters` its upstream HTTP
    filters (the codec added last)."""
    priorities = [
        {"priority": priority, "lb_endpoints": [{"endpoint": {"address": _address(port)}}]}
        for priority, port in enumerate(ports or [EXAMPLE_PORTS["upstream"]])
    ]
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name, "endpoints": priorities},
    }
    if filters:
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": f"{EXTENSIONS}.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http_protocol_options": {}},
                "http_filters": [*filters, _CODEC],
            }
        }
    return cluster


def probe_config(
    route: Mapping[str, Any],
    cluster: Mapping[str, Any],
    virtual_host: Mapping[str, Any] | None = None,
) -> str:
    """An Envoy config written with `EXAMPLE_PORTS`, for `run_on_free_ports`: one listener
    whose every request takes `route` (and the `virtual_host` settings), the `processor`
    cluster (HTTP/2, at the example's processor port) and `cluster`."""
    manager = {
        "@type": f"{EXTENSIONS}.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "probe",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "all",
                    "domains": ["*"],
                    **(virtual_host or {}),
                    "routes": [{"match": {"prefix": "/"}, "route": dict(route)}],
                }
            ]
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": f"{EXTENSIONS}.filters.http.router.v3.Router"},
            }
        ],
    }
    processor = upstream_cluster("processor", [EXAMPLE_PORTS["processor"]])
    processor["typed_extension_protocol_options"] = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": f"{EXTENSIONS}.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }
    }
    listener = {
        "address": _address(EXAMPLE_PORTS["listener"]),
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": manager,
                    }
                ]
            }
        ],
    }
    config = {"static_resources": {"listeners": [listener], "clusters": [processor, dict(cluster)]}}
    # Leaf mappings in flow style (`{address: ..., port_value: ...}`), as with_ports reads them.
    return str(yaml.safe_dump(config, sort_keys=False, default_flow_style=None))


def _address(port: int) -> dict[str, Any]:
    return {"socket_address": {"address": "127.0.0.1", "port_value": port}}
