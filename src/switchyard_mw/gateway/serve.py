"""`switchyard-mw serve CONFIG`: the forwarding gateway on uvicorn, as docs/operations.md
recommends running it.

- keep-alive 75 s, above the 5 s idle expiry of httpx under the official SDKs (a request sent
  as the server closes an idle connection is reset: docs/operations.md, "Keep-alive");
- graceful shutdown: on SIGTERM or Ctrl-C, requests under way (streams too) get up to
  `graceful_secs` to finish, then what is left is cut;
- SIGHUP reloads the config in place: in each worker with `--workers N` (the command passes the
  signal on, rather than uvicorn's replacing of its workers, which forgets account health
  unless it is shared), as `switchyard-mw extproc` does;
- workers share account health through `[state]` (each worker cools accounts on its own with
  the `memory` backend; the banner says which);
- logs in one format, switchyard's records and uvicorn's lines alike
  (`switchyard_mw.telemetry.logs`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import uvicorn
from uvicorn.supervisors.multiprocess import Multiprocess

from ..clouds.kinds import base_url_of
from ..config import Config, State, load_config, missing_api_keys
from ..engine.early_signal import blocked_for_children
from ..errors import ConfigError
from ..telemetry import logs
from .app import CONFIG_ENV, OPERATOR_ROUTES, allowed_from_env
from .forwarder import WIRE_ROUTES
from .routes import LOCAL_ROUTES

KEEP_ALIVE_SECS = 75
"""uvicorn's idle keep-alive: longer than clients keep an idle connection (httpx: 5 s)."""
GRACEFUL_SECS = 30
"""How long a stop waits for requests under way before cutting them (default)."""
FACTORY = f"{__name__.rpartition('.')[0]}.app:gateway_from_env"
EXIT_INVALID = 2

_log = logging.getLogger("switchyard_mw.serve")


def serve(
    path: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    workers: int = 1,
    log_format: logs.LogFormat = "text",
    log_level: str = "info",
    access_log: bool = True,
    graceful_secs: int = GRACEFUL_SECS,
    err: TextIO = sys.stderr,
) -> int:
    """Serve the gateway on the config at `path` until SIGTERM or Ctrl-C; exit 2 when the
    config is invalid or an account's key variable is unset (nothing is served then)."""
    try:
        config = load_config(path)
    except ConfigError as exc:
        return _problems(path, exc.problems, err)
    if missing := missing_api_keys(config):
        return _problems(path, missing, err)
    log_config = logs.configure(log_format, level=log_level)
    # Each worker builds the app from this variable (uvicorn's factory takes no argument).
    os.environ[CONFIG_ENV] = str(Path(path).resolve())
    server_config = uvicorn.Config(
        FACTORY,
        factory=True,
        host=host,
        port=port,
        workers=workers,
        log_config=log_config,
        access_log=access_log,
        timeout_keep_alive=KEEP_ALIVE_SECS,
        timeout_graceful_shutdown=graceful_secs,
    )
    banner(config, os.environ[CONFIG_ENV], url=f"http://{host}:{port}", workers=workers)
    if workers > 1:
        sock = server_config.bind_socket()
        ReloadingWorkers(server_config, sockets=[sock]).run()
        return 0
    server = uvicorn.Server(server_config)
    server.run()
    return 0 if server.started else 1


def _problems(path: str, problems: Sequence[str], err: TextIO) -> int:
    print(f"{path}: {len(problems)} problem(s)", file=err)
    for problem in problems:
        print(f"  {problem}", file=err)
    return EXIT_INVALID


def banner(config: Config, path: str, *, url: str, workers: int) -> None:
    """What the gateway serves, as records on `switchyard_mw.serve` (INFO): the config, each
    account and its models, the state backend, the routes it answers."""
    event = "serve.start"
    fields: dict[str, logs.Value] = {"config": path, "url": url, "workers": workers}
    logs.decision(_log, logging.INFO, event, "serving", **fields)
    for name, client in config.llm_clients.items():
        logs.decision(
            _log,
            logging.INFO,
            event,
            "account",
            account=name,
            base_url=base_url_of(client),
            priority=client.priority,
            models=sorted(client.models),
        )
    for name, route in config.routes.items():
        choices = sorted(route.choices.values())
        logs.decision(
            _log, logging.INFO, event, "judge route", model=name, choices=choices, judge=route.judge
        )
    logs.decision(_log, logging.INFO, event, "state", **_state(config.state, workers))
    allow = allowed_from_env()
    operator = [f"{','.join(m)} {p}" for p, m in OPERATOR_ROUTES.items()]
    logs.decision(
        _log,
        logging.INFO,
        event,
        "routes",
        llm=[f"POST {path}" for path in WIRE_ROUTES],
        local=LOCAL_ROUTES,
        operator=operator,
        operator_clients=["loopback", *allow],
    )


def _state(state: State, workers: int) -> dict[str, logs.Value]:
    """The state backend, and whether the workers share account health through it."""
    if state.backend == "memory":
        shared = "no: each process cools accounts on its own" if workers > 1 else None
        return {"backend": "memory", "shared": shared}
    where = state.url if state.mode != "sentinel" else ",".join(state.sentinels)
    return {
        "backend": state.backend,
        "mode": state.mode,
        "where": _without_credentials(where or ""),
        "shared": "yes: every worker and replica",
    }


def _without_credentials(url: str) -> str:
    """A Redis URL without its user and password."""
    scheme, sep, rest = url.rpartition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}"


class ReloadingWorkers(Multiprocess):
    """uvicorn's workers, but a SIGHUP reloads each worker's config in place (the stack's own
    SIGHUP handler in each) instead of replacing the workers: streams go on, health is kept."""

    def init_processes(self) -> None:
        # A SIGHUP passed on to a worker still starting waits until it takes it (its factory's
        # `hold_early`), rather than ending it; a replaced worker too.
        with blocked_for_children():
            super().init_processes()

    def keep_subprocess_alive(self) -> None:
        with blocked_for_children():
            super().keep_subprocess_alive()

    def handle_hup(self) -> None:
        for process in self.processes:
            pid = process.process.pid
            if pid is not None and process.process.is_alive():
                os.kill(pid, signal.SIGHUP)
        logs.decision(
            _log,
            logging.INFO,
            "serve.reload",
            "SIGHUP passed on to the workers",
            workers=len(self.processes),
        )
