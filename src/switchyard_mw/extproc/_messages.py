"""Thin builders over Envoy's generated ext_proc classes, so the servicer reads as policy.

Header values travel in `raw_value` (bytes): Envoy fills `raw_value`, not `value`, and a
mutation that sets `value` would be applied as an empty header by some Envoy versions.

Hot-path economy: answers that never change are built once (`UNCHANGED_*`, `answer_for`), and
header options that repeat (a cluster, a credential, an exposed model name) are built once and
copied into each answer (`Options`), which is several times cheaper than building them anew.
Built answers are shared: never mutate one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from .._protos.envoy.config.core.v3 import base_pb2
from .._protos.envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from .._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from .._protos.envoy.type.v3 import http_status_pb2
from ..wire import Wire, error_body

Headers = dict[str, bytes]
ATTRIBUTES_KEY = "envoy.filters.http.ext_proc"
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_Mode = processing_mode_pb2.ProcessingMode
Mode = _Mode


def headers_of(http_headers: ep.HttpHeaders, wanted: frozenset[str] | None = None) -> Headers:
    """Header names (lowercase, as Envoy sends them) to values; a repeated name keeps its first.
    With `wanted`, only those names are kept."""
    out: Headers = {}
    for header in http_headers.headers.headers:
        key = header.key
        if (wanted is None or key in wanted) and key not in out:
            out[key] = header.raw_value or header.value.encode()
    return out


def attribute(request: ep.ProcessingRequest, name: str) -> str | None:
    """A string attribute Envoy attached (`request_attributes` / `response_attributes`)."""
    if ATTRIBUTES_KEY not in request.attributes:
        return None
    fields = request.attributes[ATTRIBUTES_KEY].fields
    if name not in fields:
        return None
    value = fields[name]
    return value.string_value if value.HasField("string_value") else None


def option(key: str, value: bytes) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value), append_action=_OVERWRITE
    )


class Options:
    """Header options by (name, value), built once each; bounded, so values that never repeat
    (a deadline cut to an incoming budget) cannot grow it without limit."""

    def __init__(self, limit: int = 4096) -> None:
        self._built: dict[tuple[str, bytes], base_pb2.HeaderValueOption] = {}
        self._limit = limit

    def get(self, key: str, value: bytes) -> base_pb2.HeaderValueOption:
        built = self._built.get((key, value))
        if built is None:
            if len(self._built) >= self._limit:
                self._built.clear()
            built = self._built[(key, value)] = option(key, value)
        return built


def mutation(
    set_headers: Iterable[tuple[str, bytes]] = (), remove: Iterable[str] = ()
) -> ep.HeaderMutation:
    return ep.HeaderMutation(
        set_headers=[option(key, value) for key, value in set_headers],
        remove_headers=list(remove),
    )


def fill(
    common: ep.CommonResponse,
    options: Iterable[base_pb2.HeaderValueOption],
    remove: Iterable[str] = (),
) -> None:
    """Copy prebuilt header `options` (and removals) into `common`'s header mutation."""
    change = common.header_mutation
    change.set_headers.extend(options)
    change.remove_headers.extend(remove)


def request_headers(
    change: ep.HeaderMutation | None = None, *, pass_through: bool = False
) -> ep.ProcessingResponse:
    """The answer to the request headers; `pass_through` asks Envoy to skip the later phases
    (honoured when the filter sets `allow_mode_override`)."""
    response = ep.ProcessingResponse(
        request_headers=ep.HeadersResponse(response=ep.CommonResponse(header_mutation=change))
    )
    if pass_through:
        response.mode_override.CopyFrom(
            _Mode(request_body_mode=_Mode.NONE, response_header_mode=_Mode.SKIP)
        )
    return response


def request_body(
    change: ep.HeaderMutation | None = None, body: bytes | None = None
) -> ep.ProcessingResponse:
    """The answer to the buffered body. A new `body` needs its `content-length` in `change`;
    a re-route needs the route cache cleared, which is always asked for when headers change."""
    common = ep.CommonResponse(header_mutation=change, clear_route_cache=change is not None)
    if body is not None:
        common.body_mutation.body = body
    return ep.ProcessingResponse(request_body=ep.BodyResponse(response=common))


def response_headers(change: ep.HeaderMutation | None = None) -> ep.ProcessingResponse:
    return ep.ProcessingResponse(
        response_headers=ep.HeadersResponse(response=ep.CommonResponse(header_mutation=change))
    )


UNCHANGED_REQUEST_HEADERS = request_headers()
UNCHANGED_RESPONSE_HEADERS = response_headers()
UNCHANGED_RESPONSE_BODY = ep.ProcessingResponse(response_body=ep.BodyResponse())
UNCHANGED_REQUEST_BODY = ep.ProcessingResponse(request_body=ep.BodyResponse())
READ_STREAMED = _Mode(response_body_mode=_Mode.STREAMED)
"""A `mode_override` at the response headers: send the response body piece by piece as it
passes (each piece waits for its answer, so every one is answered at once)."""
READ_BUFFERED = _Mode(response_body_mode=_Mode.BUFFERED)
"""A `mode_override` at the response headers: send the whole response body in one message
(Envoy then keeps its `content-length`, which it drops in STREAMED mode)."""
_EMPTY = {
    "request_headers": UNCHANGED_REQUEST_HEADERS,
    "response_headers": UNCHANGED_RESPONSE_HEADERS,
    "request_body": UNCHANGED_REQUEST_BODY,
    "response_body": UNCHANGED_RESPONSE_BODY,
    "request_trailers": ep.ProcessingResponse(request_trailers=ep.TrailersResponse()),
    "response_trailers": ep.ProcessingResponse(response_trailers=ep.TrailersResponse()),
}


def empty_for(request: ep.ProcessingRequest) -> ep.ProcessingResponse:
    """A no-change answer to any phase (trailers, a body nobody asked to see)."""
    return _EMPTY.get(request.WhichOneof("request") or "", UNCHANGED_REQUEST_HEADERS)


def immediate(
    wire: Wire,
    status: int,
    error_type: str,
    message: str,
    extra: Mapping[str, bytes] | Iterable[tuple[str, bytes]] = (),
) -> ep.ProcessingResponse:
    """A local reply in the wire's own error format, so the official SDKs parse it."""
    pairs = extra.items() if isinstance(extra, Mapping) else extra
    headers = [("content-type", b"application/json"), *pairs]
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=mutation(headers),
            body=error_body(wire, error_type, message),
            details=f"switchyard_{error_type}",
        )
    )


def json_reply(status: int, body: bytes, details: str) -> ep.ProcessingResponse:
    """A local reply with a JSON `body` switchyard wrote whole (the models list, a 404)."""
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=mutation([("content-type", b"application/json")]),
            body=body,
            details=details,
        )
    )
