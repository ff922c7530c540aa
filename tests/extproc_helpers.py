"""Synthetic ext_proc traffic: build the `ProcessingRequest`s Envoy would send, read answers."""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import msgspec
import pytest
import yaml
from google.protobuf import struct_pb2

from switchyard_mw._protos.envoy.config.core.v3 import base_pb2
from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from switchyard_mw.extproc import ExtProcServicer


class FakeContext:
    """The two things the servicer asks of a grpc.aio context."""

    def __init__(self, metadata: Sequence[tuple[str, str]] = ()) -> None:
        self._metadata = tuple(metadata)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


async def answered(answering: Any) -> ep.ProcessingResponse | None:
    """A stream handler's answer to one message (`h2_stream.Handler.answer`): given at once,
    as it is; else awaited."""
    if answering is None or isinstance(answering, ep.ProcessingResponse):
        return answering
    answer: ep.ProcessingResponse | None = await answering
    return answer


class Stream:
    """One ext_proc stream driven message by message, as Envoy does."""

    def __init__(self, servicer: ExtProcServicer, metadata: Sequence[tuple[str, str]] = ()):
        self._inbox: asyncio.Queue[ep.ProcessingRequest | None] = asyncio.Queue()

        async def requests() -> AsyncIterator[ep.ProcessingRequest]:
            while (item := await self._inbox.get()) is not None:
                yield item

        self._answers = servicer.Process(requests(), FakeContext(metadata))

    async def send(self, request: ep.ProcessingRequest) -> ep.ProcessingResponse:
        await self._inbox.put(request)
        answer: ep.ProcessingResponse = await anext(self._answers)
        return answer

    async def close(self) -> None:
        await self._inbox.put(None)
        with contextlib.suppress(StopAsyncIteration):
            await anext(self._answers)


class Pushed:
    """A first-token filter stream: messages in, answers read as they come."""

    def __init__(self, servicer: ExtProcServicer) -> None:
        self.inbox: asyncio.Queue[ep.ProcessingRequest | None] = asyncio.Queue()

        async def requests() -> AsyncIterator[ep.ProcessingRequest]:
            while (item := await self.inbox.get()) is not None:
                yield item

        metadata = [("x-switchyard-filter", "first_token")]
        self.answers = servicer.Process(requests(), FakeContext(metadata))
        self.pending: asyncio.Future[ep.ProcessingResponse] | None = None

    async def next(self, within: float = 1.0) -> ep.ProcessingResponse:
        answer: ep.ProcessingResponse = await asyncio.wait_for(self._take(), within)
        return answer

    async def nothing(self, within: float = 0.1) -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._take()), within)

    def _take(self) -> asyncio.Future[ep.ProcessingResponse]:
        """The next answer (one read at a time: a wait that timed out is read on)."""
        if self.pending is None:
            self.pending = asyncio.ensure_future(anext(self.answers))
            self.pending.add_done_callback(self._taken)
        return self.pending

    def _taken(self, _: object) -> None:
        self.pending = None

    async def close(self) -> None:
        await self.inbox.put(None)
        with contextlib.suppress(StopAsyncIteration, TimeoutError):
            await asyncio.wait_for(self._take(), 1.0)


def _header_map(headers: Mapping[str, str]) -> base_pb2.HeaderMap:
    # As Envoy sends them: the value in raw_value, `value` empty.
    return base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    )


def request_headers(
    path: str = "/v1/messages", extra: Mapping[str, str] | None = None, *, end: bool = False
) -> ep.ProcessingRequest:
    headers = {
        ":method": "POST",
        ":path": path,
        ":authority": "gw",
        "content-type": "application/json",
        "x-request-id": "rid-1",
        **(extra or {}),
    }
    return ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(headers=_header_map(headers), end_of_stream=end)
    )


def upstream_headers(
    extra: Mapping[str, str], *, attempt: int | None = None, cluster: str | None = None
) -> ep.ProcessingRequest:
    """An upstream-level attempt's request headers; `attempt` as Envoy's x-envoy-attempt-count
    (set when the virtual host has include_request_attempt_count); `cluster` as the attempt's
    endpoint names it in its metadata (the `xds.upstream_host_metadata` attribute, in the
    text format Envoy 1.40 sends)."""
    if attempt is not None:
        extra = {**extra, "x-envoy-attempt-count": str(attempt)}
    request = request_headers(extra=extra)
    if cluster is not None:
        metadata = (
            'filter_metadata { key: "switchyard" value { fields { key: "cluster" '
            f'value {{ string_value: "{cluster}" }} }} }} }} '
        )
        fields = struct_pb2.Struct()
        fields.update({"xds.upstream_host_metadata": metadata})
        request.attributes["envoy.filters.http.ext_proc"].CopyFrom(fields)
    return request


def request_body(body: bytes) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))


def response_headers(
    status: int,
    extra: Mapping[str, str] | None = None,
    *,
    details: str | None = None,
    request_id: str | None = None,
    end: bool = False,
) -> ep.ProcessingRequest:
    """Response headers; `details` and `request_id` as the `response.code_details` and
    `request.id` attributes Envoy attaches when the filter asks for them; `end`: no body
    follows."""
    headers = {":status": str(status), **(extra or {})}
    request = ep.ProcessingRequest(
        response_headers=ep.HttpHeaders(headers=_header_map(headers), end_of_stream=end)
    )
    attributes = {}
    if details is not None:
        attributes["response.code_details"] = details
    if request_id is not None:
        attributes["request.id"] = request_id
    if attributes:
        fields = struct_pb2.Struct()
        fields.update(attributes)
        request.attributes["envoy.filters.http.ext_proc"].CopyFrom(fields)
    return request


def response_body(body: bytes, *, end: bool = False) -> ep.ProcessingRequest:
    """A piece of the response body (the last one with `end`), as Envoy streams it."""
    return ep.ProcessingRequest(response_body=ep.HttpBody(body=body, end_of_stream=end))


def common(response: ep.ProcessingResponse) -> ep.CommonResponse:
    kind = response.WhichOneof("response")
    assert kind in ("request_headers", "request_body", "response_headers", "response_body"), kind
    result: ep.CommonResponse = getattr(response, kind).response
    return result


def sets(response: ep.ProcessingResponse) -> dict[str, bytes]:
    """Headers an answer sets; every value must travel in raw_value."""
    out = {}
    for option in common(response).header_mutation.set_headers:
        assert option.header.value == "", option.header.key
        out[option.header.key] = option.header.raw_value
    return out


def removes(response: ep.ProcessingResponse) -> list[str]:
    return list(common(response).header_mutation.remove_headers)


def immediate(response: ep.ProcessingResponse) -> tuple[int, dict[str, bytes], Any]:
    """(status, headers, decoded JSON body) of an ImmediateResponse."""
    assert response.WhichOneof("response") == "immediate_response", response
    reply = response.immediate_response
    headers = {o.header.key: o.header.raw_value for o in reply.headers.set_headers}
    return reply.status.code, headers, msgspec.json.decode(reply.body)


CLOUD_FILTER: dict[str, Any] = {
    "name": "switchyard.upstream.cloud",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {
            "envoy_grpc": {"cluster_name": "switchyard"},
            "initial_metadata": [{"key": "x-switchyard-filter", "value": "cloud"}],
        },
        "failure_mode_allow": False,
        "message_timeout": "12s",
        "allow_mode_override": True,
        "mutation_rules": {"allow_all_routing": True},
        "processing_mode": {
            "request_header_mode": "SEND",
            "request_body_mode": "BUFFERED",
            "response_header_mode": "SEND",
            "response_body_mode": "NONE",
            "request_trailer_mode": "SKIP",
            "response_trailer_mode": "SKIP",
        },
    },
}
"""The cloud filter as docs/envoy.md configures it (`x-switchyard-filter: cloud`)."""


def with_cloud_cluster(envoy_yaml: str, name: str) -> str:
    """The example's config (its ports swapped already) and a cloud cluster `name`: the
    example cluster's upstream filters, the cloud filter nearest the codec, the same endpoint
    (the mock serves every face on one port), its metadata naming `name` (the processor reads
    an attempt's cluster from it)."""
    config = yaml.safe_load(envoy_yaml)
    clusters = config["static_resources"]["clusters"]
    [example] = [c for c in clusters if c["name"] == "mock"]
    cloud = copy.deepcopy(example)
    cloud["name"] = cloud["load_assignment"]["cluster_name"] = name
    for group in cloud["load_assignment"]["endpoints"]:  # each endpoint names its own cluster
        for endpoint in group["lb_endpoints"]:
            endpoint.setdefault("metadata", {})["filter_metadata"] = {
                "switchyard": {"cluster": name}
            }
    options = cloud["typed_extension_protocol_options"]
    filters = options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["http_filters"]
    filters.insert(len(filters) - 1, copy.deepcopy(CLOUD_FILTER))  # before upstream_codec
    clusters.append(cloud)
    return str(yaml.safe_dump(config))
