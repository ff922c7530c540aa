"""Build, serve and stop the ext_proc server (`switchyard-mw extproc`).

One server carries the `ExternalProcessor` service and the standard gRPC health service, on
one of three transports: a plain asyncio HTTP/2 server (`h2_transport`) whose HTTP/2 is read
and written by `h2_frames` (`frames`, the default) or by the `h2` library (`h2`), or grpc.aio
(`grpcio`). `frames` costs the processor well under half `h2`'s instructions per request,
`h2` half to two thirds of grpc.aio's CPU (docs/performance.md, "Envoy processor
transport"). On SIGTERM (or SIGINT) health turns
NOT_SERVING, new streams are refused and the ones in flight get `grace_secs` to finish: a
request whose body is being judged or whose upstream call is under way completes instead of
failing. With a `loader`, SIGHUP reloads the config (`reloading.reload_policies`).
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import signal
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import grpc  # type: ignore[import-untyped]  # grpcio ships no type hints
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from .._protos.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from ..accounts import build_accounts
from ..config import Config
from ..engine.reload import Loader, on_signal
from ..errors import ListenError
from .h2_transport import H2Limits, H2Server
from .policy import Policies
from .servicer import ExtProcServicer

DEFAULT_LISTEN = "127.0.0.1:50051"
GRACE_SECS = 30.0
SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
_MESSAGE_SLACK = 1 << 20
"""Room for headers and framing around the largest body a message may carry."""
Transport = Literal["grpcio", "h2", "frames"]
TRANSPORTS: tuple[Transport, ...] = ("grpcio", "h2", "frames")
DEFAULT_TRANSPORT: Transport = "frames"


def parse_listen(text: str) -> str:
    """`host:port`, `[v6]:port` or `unix:/path` as a gRPC address; ValueError when not."""
    if text.startswith("unix:"):
        if len(text) <= len("unix:"):
            raise ValueError(f"{text!r}: unix: needs a socket path")
        return text
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{text!r}: expected HOST:PORT or unix:/path")
    return text


@dataclass(frozen=True, slots=True, kw_only=True)
class GrpcioLimits:
    """What one peer may hold of a grpc.aio server: the bounds grpcio exposes (SECURITY.md).

    The defaults are far above what Envoy uses (one connection per worker thread, one stream
    per request in flight) and well below what takes the process down.
    """

    max_concurrent_streams: int = 1000
    """Per connection, advertised in SETTINGS; a stream beyond it is refused (REFUSED_STREAM),
    the connection and its other streams live on."""
    max_concurrent_rpcs: int = 10_000
    """Per process: an RPC beyond it is answered RESOURCE_EXHAUSTED at once."""
    max_connections: int | None = None
    """Per process; None: half the process's open-file limit, so the judge, Redis and
    accepted-but-refused sockets keep descriptors to use."""
    max_metadata_bytes: int = 16 << 10
    """A stream's headers (gRPC metadata) over this are refused; Envoy sends well under 1 KiB."""
    idle_secs: float = 60.0
    """A connection with no stream for this long is closed (GOAWAY); Envoy reconnects."""
    handshake_secs: float = 10.0
    """Time for a new connection to finish the HTTP/2 preface and settings."""
    max_age_secs: float = 3600.0
    """A connection is asked to go away (GOAWAY) after this long: Envoy opens a new one."""
    age_grace_secs: float = 600.0
    """Then its streams get this long to finish: the bound on what a peer that stops reading
    can hold, and on a request (a long LLM stream) through one connection."""
    keepalive_secs: float = 60.0
    """The server pings a connection this often; no answer within `keepalive_timeout_secs`
    closes it (a peer that is gone). It does not catch a peer that stops reading: grpcio
    cannot send the ping past the unread data; only the age limit ends that one."""
    keepalive_timeout_secs: float = 20.0
    max_ping_strikes: int = 2
    """Pings from the peer more often than every `min_ping_interval_secs` while no stream is
    open are strikes; past this many, GOAWAY (ENHANCE_YOUR_CALM)."""
    min_ping_interval_secs: float = 10.0

    def options(self, max_message_bytes: int, reuse_port: bool) -> list[tuple[str, int]]:
        """grpcio's channel arguments for these limits."""

        def ms(secs: float) -> int:
            return max(1, round(secs * 1000))

        connections = self.max_connections or default_max_connections()
        return [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 1 if reuse_port else 0),
            ("grpc.max_concurrent_streams", self.max_concurrent_streams),
            ("grpc.max_allowed_incoming_connections", connections),
            ("grpc.max_metadata_size", self.max_metadata_bytes),
            ("grpc.absolute_max_metadata_size", self.max_metadata_bytes),
            ("grpc.max_connection_idle_ms", ms(self.idle_secs)),
            ("grpc.server_handshake_timeout_ms", ms(self.handshake_secs)),
            ("grpc.max_connection_age_ms", ms(self.max_age_secs)),
            ("grpc.max_connection_age_grace_ms", ms(self.age_grace_secs)),
            ("grpc.keepalive_time_ms", ms(self.keepalive_secs)),
            ("grpc.keepalive_timeout_ms", ms(self.keepalive_timeout_secs)),
            ("grpc.http2.max_ping_strikes", self.max_ping_strikes),
            ("grpc.http2.min_ping_interval_without_data_ms", ms(self.min_ping_interval_secs)),
        ]


def default_max_connections() -> int:
    """Half the process's soft open-file limit (at least 16)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 10_000
    return max(16, soft // 2)


@dataclass(slots=True)
class ExtProcServer:
    """A started server; `port` is the bound TCP port (None for a unix socket)."""

    servicer: ExtProcServicer
    port: int | None
    transport: Transport
    _stop: Callable[[float], Awaitable[None]]

    async def stop(self, grace_secs: float = GRACE_SECS) -> None:
        """Refuse new streams, let those in flight finish within `grace_secs`, then close."""
        await self._stop(grace_secs)
        await self.servicer.policies.aclose()


async def start_server(
    policies: Policies,
    listen: str = DEFAULT_LISTEN,
    *,
    reuse_port: bool = False,
    transport: Transport = DEFAULT_TRANSPORT,
    h2_limits: H2Limits | None = None,
    grpcio_limits: GrpcioLimits | None = None,
) -> ExtProcServer:
    """Serve `policies` on `listen` (see `parse_listen`); port 0 picks a free one.

    `grpcio_limits`: the grpc.aio transport's bounds on what peers hold (defaults: see
    `GrpcioLimits`).

    `reuse_port`: share the port with other processes that set it too (SO_REUSEPORT; the
    kernel spreads connections among them), as `--workers` does. Without it a port another
    process serves is refused rather than silently shared.

    `h2_limits`: what a peer of the `h2` transport may take (`H2Limits`); by default its
    defaults, with the message size following `[server] max_body_bytes`.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport {transport!r}: expected one of {', '.join(TRANSPORTS)}")
    address = parse_listen(listen)
    # Envoy sends a buffered body in one message and takes a rewritten one back the same way.
    limit = policies.server.max_body_bytes + _MESSAGE_SLACK
    servicer = ExtProcServicer(policies)
    if transport != "grpcio":
        bounds = h2_limits if h2_limits is not None else H2Limits.for_message_size(limit)
        services = ("", SERVICE_NAME)
        h2 = H2Server(
            servicer.open, servicer.end, services=services, limits=bounds, engine=transport
        )
        await policies.start()
        try:
            await h2.listen(address, reuse_port=reuse_port)
        except OSError as exc:
            raise ListenError(f"cannot listen on {listen}: {exc}") from None
        return ExtProcServer(servicer, h2.port, transport, h2.stop)
    limits = grpcio_limits or GrpcioLimits()
    return await _start_grpcio(servicer, address, listen, limits.options(limit, reuse_port), limits)


async def _start_grpcio(
    servicer: ExtProcServicer,
    address: str,
    listen: str,
    options: list[tuple[str, int]],
    limits: GrpcioLimits,
) -> ExtProcServer:
    server = grpc.aio.server(options=options, maximum_concurrent_rpcs=limits.max_concurrent_rpcs)
    await servicer.policies.start()
    ep_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
    checker = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpc's way of saying the address is taken or invalid
        raise ListenError(f"cannot listen on {listen}: {exc}") from None
    if not address.startswith("unix:") and port == 0:
        raise ListenError(f"cannot listen on {listen}")
    await server.start()
    for service in ("", SERVICE_NAME):
        await checker.set(service, health_pb2.HealthCheckResponse.SERVING)

    async def stop(grace_secs: float) -> None:
        await checker.enter_graceful_shutdown()
        await server.stop(grace_secs)

    return ExtProcServer(servicer, None if address.startswith("unix:") else port, "grpcio", stop)


async def serve(
    config: Config,
    listen: str = DEFAULT_LISTEN,
    *,
    environ: Mapping[str, str] | None = None,
    grace_secs: float = GRACE_SECS,
    ready: Callable[[ExtProcServer], None] | None = None,
    reuse_port: bool = False,
    transport: Transport = DEFAULT_TRANSPORT,
    loader: Loader | None = None,
) -> None:
    """Run until SIGTERM or SIGINT, then stop gracefully. API keys are read from `environ`.

    With `loader` (how to read the config again), each SIGHUP reloads it, keys included.
    """
    policies = Policies(config, build_accounts(config, environ), environ=environ)
    running = await start_server(policies, listen, reuse_port=reuse_port, transport=transport)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stopping.set)
    if loader is not None:
        from .reloading import reload_policies

        on_signal(lambda: reload_policies(running.servicer, loader, environ))
    if ready is not None:
        ready(running)
    try:
        await stopping.wait()
    finally:
        await running.stop(grace_secs)
