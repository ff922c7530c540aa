"""An LLM gateway in front of Anthropic/OpenAI-style providers, wrapped by switchyard_stack().

    python examples/starlette_app.py            # serves 127.0.0.1:8000, mock provider on :9100
    switchyard-mw serve my.toml --workers 4     # your own config: the same app, no mock
        # (`serve` sets keep-alive, graceful stop and SIGHUP reload as docs/operations.md says;
        # with `[state] backend = "redis"` in my.toml the workers share account cooling)
    SWITCHYARD_CONFIG=my.toml uvicorn examples.starlette_app:app --timeout-keep-alive 75
        # the same app under your own uvicorn command line

The app itself is `switchyard_mw.gateway.app.gateway_app` (what `switchyard-mw serve` runs);
this file adds the mock provider, in process, whose log goes to its own file
(SWITCHYARD_MOCK_LOG, default mock-provider.log in the temp folder), never to the gateway's.

Environment:
    SWITCHYARD_CONFIG      the config file (default: examples/switchyard.toml, on the mock)
    SWITCHYARD_START_MOCK  1 to start the bundled mock provider in this process (default: 1
                           with the default config, else 0); SWITCHYARD_MOCK_PORT (9100)
                           moves it (and the default config's accounts with it)
    SWITCHYARD_OPERATOR_ALLOW  client addresses (comma-separated) that may call the operator
                           routes besides loopback: /metrics, /switchyard/* (default: none)
    HOST, PORT, LOG_LEVEL  where `python examples/starlette_app.py` serves (127.0.0.1, 8000)
    LOG_FORMAT             text (default) or json: one JSON object per line
    OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME, ...   the standard OpenTelemetry variables:
                           with an endpoint, traces and metrics also go out over OTLP
                           (`switchyard_mw.telemetry.otel.configure`); metrics are always on
                           /metrics

Reloading the config (docs/operations.md): `kill -HUP <pid>` of each process serving it (each
uvicorn worker; `/switchyard/health` names the pid that answered), or `POST /switchyard/reload`
from loopback, which reloads the worker that takes the request.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from pathlib import Path

from switchyard_mw.config import Config, load_config, parse_config
from switchyard_mw.gateway.app import allowed_from_env, gateway_app

DEFAULT_CONFIG = Path(__file__).with_name("switchyard.toml")
CONFIG = os.environ.get("SWITCHYARD_CONFIG", str(DEFAULT_CONFIG))
USING_DEFAULT = str(DEFAULT_CONFIG) == CONFIG
START_MOCK = os.environ.get("SWITCHYARD_START_MOCK", "1" if USING_DEFAULT else "0")
MOCK_THREAD = "mock-provider"
MOCK_LOG = os.environ.get(
    "SWITCHYARD_MOCK_LOG", str(Path(tempfile.gettempdir()) / "mock-provider.log")
)


def _start_mock_provider() -> None:
    """The bundled mock, on its own thread and event loop, so the example runs offline.

    Its server leaves the logging config alone (`log_config=None`): its records (a fault it
    was told to play ends in a traceback) are told apart by its thread's name and go to
    MOCK_LOG (see the end of this file)."""
    import uvicorn

    from switchyard_mw.testing import Behaviour, MockProvider

    port = int(os.environ.get("SWITCHYARD_MOCK_PORT", "9100"))
    mock = MockProvider()
    # The judge of the `auto` route is the mock too: have it answer with one of the labels.
    mock.set_behaviour(os.environ["MOCK_JUDGE_KEY"], Behaviour(reply="complex"))
    config = uvicorn.Config(mock, host="127.0.0.1", port=port, log_config=None)
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, name=MOCK_THREAD, daemon=True).start()


class _MockApart(logging.Filter):
    """Passes every record but the mock thread's, which it writes to MOCK_LOG instead."""

    def __init__(self) -> None:
        super().__init__()
        self.file = logging.FileHandler(MOCK_LOG)
        self.file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))

    def filter(self, record: logging.LogRecord) -> bool:
        if record.threadName != MOCK_THREAD:
            return True
        self.file.handle(record)
        return False


def _config() -> Config:
    """The config (read again at each reload); the default one pointed at wherever the
    bundled mock runs."""
    if not USING_DEFAULT:
        return load_config(CONFIG)
    port = os.environ.get("SWITCHYARD_MOCK_PORT", "9100")
    text = DEFAULT_CONFIG.read_text().replace("127.0.0.1:9100", f"127.0.0.1:{port}")
    return parse_config(text, source=CONFIG)


if START_MOCK == "1":
    # The mock accepts any key; the default config names these variables.
    os.environ.setdefault("MOCK_KEY_A", "mock-key-a")
    os.environ.setdefault("MOCK_KEY_B", "mock-key-b")
    os.environ.setdefault("MOCK_JUDGE_KEY", "mock-judge-key")
    if __name__ != "__main__":
        # Under a uvicorn command line of your own, its logging config is in force: the mock's
        # records are taken off its loggers here, to MOCK_LOG (the `__main__` block below does
        # the same through its config).
        apart = _MockApart()
        for name in ("", "uvicorn.error", "uvicorn.access"):  # where the mock's server logs
            logging.getLogger(name).addFilter(apart)
    _start_mock_provider()

# Operator routes (/metrics, /switchyard/*): loopback only unless SWITCHYARD_OPERATOR_ALLOW
# names more (SECURITY.md).
app = gateway_app(_config(), reload_from=_config, allow=allowed_from_env())

if __name__ == "__main__":
    import uvicorn

    from switchyard_mw.gateway.serve import KEEP_ALIVE_SECS
    from switchyard_mw.telemetry.logs import logging_config

    log_format = "json" if os.environ.get("LOG_FORMAT") == "json" else "text"
    level = os.environ.get("LOG_LEVEL", "info").upper()
    uvicorn.run(
        app,
        # Longer than clients keep an idle connection (httpx, under the OpenAI and Anthropic
        # SDKs: 5 s, uvicorn's own default): else a request sent as uvicorn closes an idle
        # connection is reset. docs/operations.md, "Keep-alive".
        timeout_keep_alive=KEEP_ALIVE_SECS,
        host=os.environ.get("HOST", "127.0.0.1"),
        port=int(os.environ.get("PORT", "8000")),
        # The gateway's records and uvicorn's in one format; the mock's to its own file.
        log_config=logging_config(log_format, level=level, apart={MOCK_THREAD: MOCK_LOG}),
    )
