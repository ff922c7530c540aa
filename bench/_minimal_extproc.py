"""The least a Python ext_proc processor does: a reference floor for section 4, not a product.

Same gRPC stack as `switchyard-mw extproc` (grpc.aio, one stream per request) and the same
three phases the example's router-level filter sends (request headers, buffered body,
response headers). Its only work: decode the body's model and write it back, with the
`content-length` Envoy needs for a body mutation. No policy, no telemetry, no account.

    python bench/_minimal_extproc.py --listen 127.0.0.1:PORT
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import AsyncIterator

import grpc  # type: ignore[import-untyped]  # grpcio ships no type hints
import msgspec

from switchyard_mw._protos.envoy.config.core.v3 import base_pb2
from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from switchyard_mw._protos.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

_HEADERS_DONE = ep.ProcessingResponse(request_headers=ep.HeadersResponse())
_RESPONSE_DONE = ep.ProcessingResponse(response_headers=ep.HeadersResponse())
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


def _rewritten(body: bytes) -> ep.ProcessingResponse:
    document = _decode(body)
    document["model"] = document.get("model", "")  # read and written back: a no-op rewrite
    new = _encode(document)
    length = base_pb2.HeaderValue(key="content-length", raw_value=str(len(new)).encode())
    return ep.ProcessingResponse(
        request_body=ep.BodyResponse(
            response=ep.CommonResponse(
                header_mutation=ep.HeaderMutation(
                    set_headers=[base_pb2.HeaderValueOption(header=length)]
                ),
                body_mutation=ep.BodyMutation(body=new),
            )
        )
    )


class MinimalProcessor(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    async def Process(  # the gRPC method's name
        self, requests: AsyncIterator[ep.ProcessingRequest], _context: object
    ) -> AsyncIterator[ep.ProcessingResponse]:
        async for request in requests:
            phase = request.WhichOneof("request")
            if phase == "request_headers":
                yield _HEADERS_DONE
            elif phase == "request_body":
                yield _rewritten(request.request_body.body)
            elif phase == "response_headers":
                yield _RESPONSE_DONE
            else:
                yield ep.ProcessingResponse()


async def _serve(listen: str) -> None:
    server = grpc.aio.server()
    ep_grpc.add_ExternalProcessorServicer_to_server(MinimalProcessor(), server)
    server.add_insecure_port(listen)
    await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT")
    asyncio.run(_serve(parser.parse_args().listen))


if __name__ == "__main__":
    main()
