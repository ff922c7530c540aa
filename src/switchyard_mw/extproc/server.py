"""Build, serve and stop the ext_proc server (`switchyard-mw extproc`).

One server carries the `ExternalProcessor` service and the standard gRPC health service, on
one of two transports: grpc.aio (`grpcio`, the default) or a plain asyncio HTTP/2 server on
`h2` (`h2`, see `h2_transport`), which costs about a third of the CPU per request. On SIGTERM
(or SIGINT) health turns NOT_SERVING, new streams are refused and the ones in flight get
`grace_secs` to finish: a request whose body is being judged or whose upstream call is under
way completes instead of failing.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import grpc  # type: ignore[import-untyped]  # grpcio ships no type hints
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ..clients import build_clients
from ..config import Config
from .h2_transport import H2Limits, H2Server
from .policy import Policies
from .servicer import ExtProcServicer

DEFAULT_LISTEN = "127.0.0.1:50051"
GRACE_SECS = 30.0
SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
_MESSAGE_SLACK = 1 << 20
"""Room for headers and framing around the largest body a message may carry."""
Transport = Literal["grpcio", "h2"]
TRANSPORTS: tuple[Transport, ...] = ("grpcio", "h2")
DEFAULT_TRANSPORT: Transport = "grpcio"


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
) -> ExtProcServer:
    """Serve `policies` on `listen` (see `parse_listen`); port 0 picks a free one.

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
    if transport == "h2":
        limits = h2_limits if h2_limits is not None else H2Limits.for_message_size(limit)
        h2 = H2Server(servicer.open, servicer.end, services=("", SERVICE_NAME), limits=limits)
        await policies.start()
        try:
            await h2.listen(address, reuse_port=reuse_port)
        except OSError as exc:
            raise OSError(f"cannot listen on {listen}: {exc}") from None
        return ExtProcServer(servicer, h2.port, transport, h2.stop)
    return await _start_grpcio(servicer, address, listen, limit, reuse_port)


async def _start_grpcio(
    servicer: ExtProcServicer, address: str, listen: str, limit: int, reuse_port: bool
) -> ExtProcServer:
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 1 if reuse_port else 0),
        ]
    )
    await servicer.policies.start()
    ep_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
    checker = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpc's way of saying the address is taken or invalid
        raise OSError(f"cannot listen on {listen}: {exc}") from None
    if not address.startswith("unix:") and port == 0:
        raise OSError(f"cannot listen on {listen}")
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
) -> None:
    """Run until SIGTERM or SIGINT, then stop gracefully. API keys are read from `environ`."""
    policies = Policies(config, build_clients(config, environ))
    running = await start_server(policies, listen, reuse_port=reuse_port, transport=transport)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stopping.set)
    if ready is not None:
        ready(running)
    try:
        await stopping.wait()
    finally:
        await running.stop(grace_secs)
