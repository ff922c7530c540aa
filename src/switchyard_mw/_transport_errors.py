"""The outbound call's failures, each also httpx's exception of its name (see `errors`).

Apart from `errors` because they import httpx, which a process that only reads a config need
not load: `errors` re-exports them on first use.
"""

import httpx

from .core.base_errors import SwitchyardError

# Each is also httpx's exception of the same name (so its `request` is set when an httpx
# client raised it); the names stay httpx's because metrics and stream error events show them.


class TransportError(SwitchyardError, httpx.TransportError):
    """An outbound call failed in transport: no answer, or only part of one, came back."""


class TimeoutException(TransportError, httpx.TimeoutException):
    """A bound of the call's own timeout expired (not the deadline policy's)."""


class ConnectTimeout(TimeoutException, httpx.ConnectTimeout):
    """Connecting took longer than the call's connect bound."""


class ReadTimeout(TimeoutException, httpx.ReadTimeout):
    """The upstream was silent (for the headers or between body chunks) past the read bound."""


class WriteTimeout(TimeoutException, httpx.WriteTimeout):
    """Sending the request took longer than the call's write bound."""


class PoolTimeout(TimeoutException, httpx.PoolTimeout):
    """No pooled connection came free within the call's pool bound."""


class NetworkError(TransportError, httpx.NetworkError):
    """The network failed the call."""


class ConnectError(NetworkError, httpx.ConnectError):
    """The upstream could not be reached: refused, unresolvable or unreachable."""


class ReadError(NetworkError, httpx.ReadError):
    """Reading the answer failed (a reset connection, say)."""


class WriteError(NetworkError, httpx.WriteError):
    """Sending the request failed."""


class ProtocolError(TransportError, httpx.ProtocolError):
    """The HTTP exchange broke its rules."""


class LocalProtocolError(ProtocolError, httpx.LocalProtocolError):
    """Our side broke them (a request the client cannot send)."""


class RemoteProtocolError(ProtocolError, httpx.RemoteProtocolError):
    """The upstream hung up before or while answering, or its answer was not HTTP."""


class ProxyError(TransportError, httpx.ProxyError):
    """A proxy between us and the upstream failed the call."""


class UnsupportedProtocol(TransportError, httpx.UnsupportedProtocol):
    """The URL's scheme is not one the client speaks."""
