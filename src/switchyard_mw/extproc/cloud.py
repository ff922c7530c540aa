"""The upstream-level cloud filter's streams: a Bedrock or Vertex account's attempt under Envoy.

Envoy runs this filter in a cloud cluster's upstream chain, nearest the codec, once per
attempt (gRPC metadata `x-switchyard-filter: cloud`), so it sees the request as it finally
goes out (the account the router-level stream or, on a retry, the upstream-level filter chose,
the body in that account's model name) and the answer before any other switchyard filter. On
the hedge route both tries are in flight at once while the request's context names the first
try's account: each stream names its try by its own `x-envoy-attempt-count` and goes out as
that try's account (`hedge_tries.account_of`: the hedge's, or none for a void try).

- the buffered request body is re-enveloped and authenticated by the forwarding app's own code
  (`Account.outbound`: `clouds.bedrock`/`clouds.vertex` for the envelope, `clouds.aws_sigv4`
  or `clouds.google_token` for the credential), and its answer sets `:path`, `:authority`,
  the body with its `content-length` and the credential headers: Envoy holds the attempt's
  headers until the body's answer, so the signature covers the very bytes sent (measured:
  `tests/extproc/test_envoy_cloud_envelope.py`). The client's key never leaves.
- a 2xx Bedrock event-stream is turned into Anthropic SSE piece by piece (`clouds.bedrock_
  stream`: a frame may straddle two pieces, so one translator per attempt), its headers
  changed to `text/event-stream` without a `content-length`. An error inside it (Bedrock's
  `exception` message, a stream cut inside a frame) ends the client's stream with Anthropic's
  `error` event, and its status is reported on the request's context as the forwarding app's
  relay reports it (`report_upstream`): the router-level stream settles such an attempt at
  the end of its body (`Judged.AT_END`), where the attempt machine classes that status as it
  does through the forwarding app (a 5xx the account's fault, a 429 a throttle);
- an error answer is read whole (`BUFFERED`, so its headers wait) and replaced by the
  cloud's mapping (`Account.error_answer`): the status the cooling policy should see and
  Anthropic's error body. The upstream-level refusal filter, further from the codec, then sees
  that status, as the forwarding app's attempt machine does.

A request whose attempt goes to an `api` account passes through unchanged.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable
from urllib.parse import urlsplit

from .._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from ..accounts import Account
from ..clouds.anthropic_body import anthropic_error
from ..clouds.base import StreamTranslator
from ..clouds.bedrock import anthropic_error_of
from ..errors import CloudCredentialError, RemoteProtocolError, WireError
from ..wire import Wire
from . import _messages as msg
from . import hedge_tries
from .flights import Flight, Flights, Judged, out_of_order
from .router import REQUEST_ID_HEADER

CLOUD_FILTER = "cloud"
"""The `x-switchyard-filter` metadata value of the cloud filter."""
_READ_REQUEST = frozenset([REQUEST_ID_HEADER, ":path", "anthropic-beta"])
_READ_RESPONSE = frozenset([":status", "content-type", "x-amzn-errortype"])
_CALLER_CREDENTIALS = ["x-api-key", "api-key"]
"""The caller's key: removed (the cloud's credential is set in its place)."""
_SSE_ERROR_STATUS = 502
"""What a cloud's stream that is no event stream, or is cut inside a frame, counts as: the
upstream's fault, as a stream that broke mid-way counts through the forwarding app."""


class Handling(enum.Enum):
    """What the stream does with the attempt's answer."""

    PASS = "pass"
    """An api account's, or a cloud's JSON message (Anthropic's already)."""
    TRANSLATE = "translate"
    """A 2xx stream in the cloud's own framing, turned into SSE piece by piece."""
    MAP_ERROR = "map_error"
    """An error answer, read whole and replaced by the Anthropic shape and status."""


class CloudStream:
    """The state of one cloud-filter ext_proc stream (one attempt)."""

    def __init__(self, flights: Flights) -> None:
        self.flights = flights
        self.flight: Flight | None = None
        self.attempt: int | None = None
        """Envoy's number of the try (`x-envoy-attempt-count`): on the hedge route, it tells
        the hedge's try from the first (`hedge_tries.which`)."""
        self.which = hedge_tries.Try.FIRST
        """Which try of its request this stream's is (taken at the body phase)."""
        self.account: Account | None = None
        """The attempt's account, when it is a cloud account (taken at the body phase)."""
        self.headers: msg.Headers = {}
        self.handling = Handling.PASS
        self.status = 0
        self.response: list[tuple[bytes, bytes]] = []
        """The error answer's headers, names lowercased (a cloud may name its error there)."""
        self.translator: StreamTranslator | None = None
        self.replacement: tuple[int, bytes] | None = None
        """The error answer decided before the attempt went out (no credential)."""
        self.seen: set[str] = set()

    def answer(
        self, request: ep.ProcessingRequest
    ) -> ep.ProcessingResponse | Awaitable[ep.ProcessingResponse]:
        """The answer to `request`, given at once but for the request's body, which waits on
        the account's credential (a token's refresh): that one is awaited
        (`h2_stream.Handler`)."""
        kind = request.WhichOneof("request") or ""
        if kind in self.seen and kind != "response_body":
            out_of_order(kind)  # one stream is one attempt: each phase once
            return msg.empty_for(request)
        self.seen.add(kind)
        if kind == "request_headers":
            self.headers = msg.headers_of(request.request_headers, _READ_REQUEST)
            self.flight = self.flights.find(self.headers.get(REQUEST_ID_HEADER))
            self.attempt = hedge_tries.attempt_of(request)
            return msg.UNCHANGED_REQUEST_HEADERS
        if kind == "request_body":
            return self.on_request_body(request.request_body.body)
        if kind == "response_headers":
            return self.on_response_headers(request.response_headers)
        if kind == "response_body":
            return self.on_response_body(request.response_body)
        return msg.empty_for(request)

    async def on_request_body(self, body: bytes) -> ep.ProcessingResponse:
        """The attempt's body in the cloud's envelope, with the credential made over it."""
        flight = self.flight
        account = None if flight is None else self._account_of(flight)
        if flight is None or account is None or account.cloud is None:
            return msg.request_body()
        self.account = account
        path = self.headers.get(":path", b"").decode("latin-1").split("?", 1)[0]
        beta = self.headers.get("anthropic-beta")
        betas = [] if beta is None else [("anthropic-beta", beta.decode("latin-1"))]
        try:
            outbound = await account.outbound(path, body, betas)
        except WireError as exc:  # the request's own fault: no account could take it
            return _refuse(flight, exc.status, exc.error_type, exc.message)
        except CloudCredentialError as exc:
            return self._without_credential(account, path, exc)
        url = urlsplit(outbound.url)
        target = url.path + (f"?{url.query}" if url.query else "")
        sets = [(":path", target.encode()), (":authority", url.netloc.encode())]
        sets.append(("content-length", str(len(outbound.body)).encode()))
        sets += [(k.lower(), v.encode("latin-1")) for k, v in outbound.headers if k != "host"]
        return msg.request_body(msg.mutation(sets, _CALLER_CREDENTIALS), outbound.body)

    def _account_of(self, flight: Flight) -> Account | None:
        """The account this try goes out as: the request's attempt's (the first try's, or a
        retry's), or, on the hedge route, the hedge's for the hedge's try, none for a void
        try (it goes out as the retry filter left it: no credential, no prompt)."""
        machine = flight.machine
        if machine is None:
            return flight.ctx.account
        self.which = hedge_tries.which(flight.hedge, self.attempt)
        return hedge_tries.account_of(flight.hedge, machine, self.which)

    def _without_credential(
        self, account: Account, path: str, exc: CloudCredentialError
    ) -> ep.ProcessingResponse:
        """No credential: the attempt goes out empty (no prompt, no credential) and its
        answer, whatever the cloud says, is replaced by the forwarding app's: refused
        credentials a 401 (the account's fault for every model), a token endpoint that did
        not answer a 502. A local reply here would not do: Envoy sends an upstream filter's
        local reply straight to the client (measured), with no retry on the next account."""
        assert account.cloud is not None
        status, error_type = (401, "authentication_error") if exc.refused else (502, "api_error")
        self.replacement = status, anthropic_error_of(error_type, str(exc))
        url = urlsplit(account.cloud.cloud.envelope(path, b"{}", model="-").url)
        sets = [(":path", url.path.encode()), (":authority", url.netloc.encode())]
        sets.append(("content-length", b"2"))
        return msg.request_body(msg.mutation(sets, [*_CALLER_CREDENTIALS, "authorization"]), b"{}")

    def on_response_headers(self, http: ep.HttpHeaders) -> ep.ProcessingResponse:
        account = self.account
        if account is None:
            return msg.UNCHANGED_RESPONSE_HEADERS
        headers = msg.headers_of(http, _READ_RESPONSE)
        self.status = int(headers.get(":status", b"0") or 0)
        if self.status >= 300 or self.replacement is not None:
            self.response = [(k.encode(), v) for k, v in headers.items()]
            if http.end_of_stream:  # no body to read: mapped by its status and headers
                return self._mapped_headers(b"")
            self.handling = Handling.MAP_ERROR
            return ep.ProcessingResponse(
                response_headers=ep.HeadersResponse(), mode_override=msg.READ_BUFFERED
            )
        content_type = headers.get("content-type", b"").decode("latin-1")
        self.translator = account.stream_translator(content_type)
        if self.flight is not None:
            # A translated stream may still fail inside: its attempt is judged at its end.
            ending = Judged.AT_HEADERS if self.translator is None else Judged.AT_END
            self.flight.judged = ending
        if self.translator is None:
            return msg.UNCHANGED_RESPONSE_HEADERS  # Anthropic's JSON or SSE already
        self.handling = Handling.TRANSLATE
        change = msg.mutation(
            [("content-type", self.translator.content_type)], remove=["content-length"]
        )
        answer = msg.response_headers(change)
        answer.mode_override.CopyFrom(msg.READ_STREAMED)
        return answer

    def on_response_body(self, piece: ep.HttpBody) -> ep.ProcessingResponse:
        if self.handling is Handling.MAP_ERROR:
            return self._mapped_body(piece.body)
        translator = self.translator
        if self.handling is not Handling.TRANSLATE or translator is None:
            return msg.UNCHANGED_RESPONSE_BODY
        try:
            sse = translator.feed(piece.body)
            if piece.end_of_stream:
                sse += translator.end()
        except RemoteProtocolError as exc:
            # Not an event stream, or cut inside a frame: the client's stream ends with the
            # wire's error event, as the forwarding app ends it.
            self.translator = None
            self._report(_SSE_ERROR_STATUS)
            error = anthropic_error(_SSE_ERROR_STATUS, str(exc))
            sse = b"event: error\ndata: " + error + b"\n\n"
        else:
            if translator.failure is not None:
                # The cloud's stream carried its own error (its event given, nothing after it).
                self._report(translator.failure)
        answer = ep.ProcessingResponse()
        answer.response_body.response.body_mutation.body = sse
        return answer

    def _report(self, status: int) -> None:
        """The status the stream's own error stands for, told the request's attempt machine
        through the context (`RequestContext.report_upstream`, as the forwarding app tells
        it) while this stream's try is the request's attempt (its account's); while the
        hedged request's two tries race, kept for this try, to be judged as its own
        (`hedge_tries.report`)."""
        flight = self.flight
        if flight is not None:
            hedge_tries.report(flight.hedge, flight.ctx, self.account, self.which, status)

    def _mapped_body(self, body: bytes) -> ep.ProcessingResponse:
        """The buffered error answer replaced; its held headers get the status and length."""
        assert self.account is not None
        status, data = self.replacement or self.account.error_answer(
            self.status, body, self.response
        )
        answer = ep.ProcessingResponse()
        common = answer.response_body.response
        common.body_mutation.body = data
        common.header_mutation.CopyFrom(_error_headers(status, data))
        return answer

    def _mapped_headers(self, body: bytes) -> ep.ProcessingResponse:
        assert self.account is not None
        status, _ = self.replacement or self.account.error_answer(self.status, body, self.response)
        return msg.response_headers(msg.mutation([(":status", str(status).encode())]))


def _error_headers(status: int, data: bytes) -> ep.HeaderMutation:
    return msg.mutation(
        [
            (":status", str(status).encode()),
            ("content-type", b"application/json"),
            ("content-length", str(len(data)).encode()),
        ]
    )


def _refuse(flight: Flight, status: int, error_type: str, message: str) -> ep.ProcessingResponse:
    """A request no account of the cloud can take (another path, a body that is not JSON):
    answered to the client at once, as the forwarding app answers it."""
    view = flight.ctx.view
    wire = view.wire if view is not None else Wire.ANTHROPIC
    return msg.immediate(wire, status, error_type, message)
