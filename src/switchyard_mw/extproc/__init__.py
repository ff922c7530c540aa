"""The four policies served to Envoy as an external processor (ext_proc over gRPC).

    switchyard-mw extproc --config switchyard.toml --listen 127.0.0.1:50051

`examples/envoy/envoy.yaml` shows the Envoy side: a router-level ext_proc filter and, for
in-request failover between accounts on one cluster, one in the cluster's upstream chain.
"""

from ..errors import MissingExtraError

try:  # what the `envoy` extra brings; one clear error instead of a failed import deep inside
    import google.protobuf  # noqa: F401
    import grpc  # type: ignore[import-untyped]  # noqa: F401
    import grpc_health.v1  # noqa: F401
    import h2.connection  # noqa: F401
except ImportError as exc:
    raise MissingExtraError("the ext_proc server (switchyard_mw.extproc)", "envoy", exc) from None

from .policy import Policies
from .server import (
    DEFAULT_LISTEN,
    TRANSPORTS,
    ExtProcServer,
    GrpcioLimits,
    Transport,
    parse_listen,
    serve,
    start_server,
)
from .servicer import ExtProcServicer

__all__ = [
    "DEFAULT_LISTEN",
    "TRANSPORTS",
    "ExtProcServer",
    "ExtProcServicer",
    "GrpcioLimits",
    "Policies",
    "Transport",
    "parse_listen",
    "serve",
    "start_server",
]
