"""Thin builders over Envoy's generated ext_proc classes, so the servicer reads as policy.

Header values travel in `raw_value` (bytes): Envoy fills `raw_value`, not `value`, and a
mutation that sets `value` would be applied as an empty header by some Envoy versions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2

from ..wire import Wire, error_body

Headers = dict[str, bytes]
ATTRIBUTES_KEY = "envoy.filters.http.ext_proc"
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def headers_of(http_headers: ep.HttpHeaders) -> Headers:
    """Header names (lowercase, as Envoy sends them) to values; a repeated name keeps its first."""
    out: Headers = {}
    for header in http_headers.headers.headers:
        out.setdefault(header.key, header.raw_value or header.value.encode())
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


def mutation(
    set_headers: Iterable[tuple[str, bytes]] = (), remove: Iterable[str] = ()
) -> ep.HeaderMutation:
    return ep.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=key, raw_value=value), append_action=_OVERWRITE
            )
            for key, value in set_headers
        ],
        remove_headers=list(remove),
    )


def request_headers(
    change: ep.HeaderMutation | None = None, *, pass_through: bool = False
) -> ep.ProcessingResponse:
    """The answer to the request headers; `pass_through` asks Envoy to skip the later phases
    (honoured when the filter sets `allow_mode_override`)."""
    response = ep.ProcessingResponse(
        request_headers=ep.HeadersResponse(response=ep.CommonResponse(header_mutation=change))
    )
    if pass_through:
        mode = processing_mode_pb2.ProcessingMode
        response.mode_override.CopyFrom(
            mode(request_body_mode=mode.NONE, response_header_mode=mode.SKIP)
        )
    return response


def request_body(
    change: ep.HeaderMutation | None = None, body: bytes | None = None
) -> ep.ProcessingResponse:
    """The answer to the buffered body. A new `body` needs its `content-length` in `change`;
    a re-route needs the route cache cleared, which is always asked for when headers change."""
    common = ep.CommonResponse(header_mutation=change, clear_route_cache=change is not None)
    if body is not None:
        common.body_mutation.CopyFrom(ep.BodyMutation(body=body))
    return ep.ProcessingResponse(request_body=ep.BodyResponse(response=common))


def response_headers(change: ep.HeaderMutation | None = None) -> ep.ProcessingResponse:
    return ep.ProcessingResponse(
        response_headers=ep.HeadersResponse(response=ep.CommonResponse(header_mutation=change))
    )


def empty_for(request: ep.ProcessingRequest) -> ep.ProcessingResponse:
    """A no-change answer to any phase (trailers, a body nobody asked to see)."""
    kind = request.WhichOneof("request")
    if kind in ("request_body", "response_body"):
        return ep.ProcessingResponse(**{kind: ep.BodyResponse()})
    if kind in ("request_trailers", "response_trailers"):
        return ep.ProcessingResponse(**{kind: ep.TrailersResponse()})
    return ep.ProcessingResponse(**{kind or "request_headers": ep.HeadersResponse()})


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
