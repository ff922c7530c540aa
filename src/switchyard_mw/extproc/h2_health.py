"""The gRPC health service of the `h2` transport (`Health/Check`, `Health/Watch`), without
sockets or HTTP/2: what each request is answered, and who watches.

A call takes one `HealthCheckRequest`; `Check` answers it once and ends, `Watch` answers it
and again on every change (here: only NOT_SERVING, once stopping) until the client cancels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from .h2_framing import INVALID_ARGUMENT, NOT_FOUND, OK

SERVING = 1
NOT_SERVING = 2
"""grpc.health.v1.HealthCheckResponse.ServingStatus"""


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one health request gets: `status` OK and the service asked about, or the gRPC
    status and detail that end the call."""

    status: int
    detail: str = ""
    service: str = ""


class Health:
    """What `Health/Check` and `Health/Watch` answer; NOT_SERVING once stopping.

    `watchers` maps each watching call to how to send it the status again."""

    __slots__ = ("services", "serving", "watchers")

    def __init__(self, services: frozenset[str]) -> None:
        self.services = services
        self.serving = True
        self.watchers: dict[object, Callable[[], None]] = {}

    def status_of(self, service: str) -> int | None:
        """The service's status; None for a service not served here."""
        if service not in self.services:
            return None
        return SERVING if self.serving else NOT_SERVING

    def judge(self, payload: memoryview | bytes, *, asked: bool) -> Verdict:
        """The verdict on one request of a call; `asked`: the call already had one."""
        if asked:  # each more would answer (and watch) again
            return Verdict(INVALID_ARGUMENT, "more than one HealthCheckRequest")
        try:
            service = health_pb2.HealthCheckRequest.FromString(payload).service
        except DecodeError:
            return Verdict(INVALID_ARGUMENT, "cannot parse HealthCheckRequest")
        if self.status_of(service) is None:
            return Verdict(NOT_FOUND, f"unknown service {service!r}", service)
        return Verdict(OK, service=service)

    def answer(self, service: str) -> bytes:
        """The serialized `HealthCheckResponse` for `service` now."""
        reply = health_pb2.HealthCheckResponse(status=self.status_of(service) or 0)
        answer: bytes = reply.SerializeToString()
        return answer

    def watch(self, call: object, notify: Callable[[], None]) -> None:
        self.watchers[call] = notify

    def unwatch(self, call: object) -> None:
        self.watchers.pop(call, None)

    def stop_serving(self) -> None:
        """NOT_SERVING from now on; every watcher is told."""
        self.serving = False
        for notify in list(self.watchers.values()):
            notify()
