"""The `switchyard-mw` command."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO
from urllib.parse import urlsplit

from .config import Config, State, load_config
from .errors import ConfigError

if TYPE_CHECKING:  # the extproc package imports grpc: only `extproc` itself needs it
    from .extproc import Transport

EXIT_OK = 0
EXIT_INVALID = 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="switchyard-mw",
        description="Policies for LLM gateways: deadlines, canary stickiness, fault cooling, "
        "judge timeouts.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    check = commands.add_parser("check-config", help="validate a config file and summarise it")
    check.add_argument("file", help="path to the TOML config")
    extproc = commands.add_parser("extproc", help="serve the policies to Envoy (ext_proc gRPC)")
    extproc.add_argument("--config", required=True, help="path to the TOML config")
    extproc.add_argument(
        "--listen",
        default="127.0.0.1:50051",
        help="HOST:PORT or unix:/path (default: 127.0.0.1:50051, loopback only)",
    )
    extproc.add_argument(
        "--workers",
        type=int,
        default=1,
        help="processes sharing the port (SO_REUSEPORT), one core each (default: 1)",
    )
    extproc.add_argument(
        "--transport",
        choices=["grpcio", "h2"],
        default="grpcio",
        help="grpcio (grpc.aio, the default) or h2: the same service over a plain asyncio "
        "HTTP/2 server, about a third of the CPU per request (no TLS, no compression)",
    )
    args = parser.parse_args(argv)
    if args.command == "check-config":
        return check_config(args.file, out=sys.stdout, err=sys.stderr)
    if args.command == "extproc":
        return run_extproc(
            args.config,
            args.listen,
            err=sys.stderr,
            workers=args.workers,
            transport=args.transport,
        )
    parser.error(f"unknown command {args.command}")  # argparse exits; kept for the type checker
    return EXIT_INVALID


def check_config(path: str, *, out: TextIO, err: TextIO) -> int:
    """Print OK and a one-screen summary (exit 0), or every problem (exit 2)."""
    try:
        config = load_config(path)
    except ConfigError as exc:
        print(f"{path}: {len(exc.problems)} problem(s)", file=err)
        for problem in exc.problems:
            print(f"  {problem}", file=err)
        return EXIT_INVALID
    print(f"OK {path}", file=out)
    print(summary(config), file=out)
    return EXIT_OK


def run_extproc(
    path: str,
    listen: str,
    *,
    err: TextIO,
    workers: int = 1,
    transport: Transport = "grpcio",
) -> int:
    """Serve ext_proc until SIGTERM; a bad config, listen address or key is exit 2."""
    import asyncio

    from .errors import StartupError
    from .extproc import ExtProcServer, parse_listen, serve

    try:
        config = load_config(path)
        parse_listen(listen)
    except ConfigError as exc:
        print(f"{path}: {len(exc.problems)} problem(s)", file=err)
        for problem in exc.problems:
            print(f"  {problem}", file=err)
        return EXIT_INVALID
    except ValueError as exc:
        print(f"--listen {exc}", file=err)
        return EXIT_INVALID

    if workers != 1:
        from .extproc.workers import run_workers

        return run_workers(config, listen, workers, err=err, transport=transport)

    def ready(server: ExtProcServer) -> None:
        where = listen if server.port is None else f"{listen.rpartition(':')[0]}:{server.port}"
        print(f"switchyard-mw extproc listening on {where}", file=err, flush=True)

    try:
        asyncio.run(serve(config, listen, ready=ready, transport=transport))
    except StartupError as exc:
        print(f"{path}: {exc}", file=err)
        return EXIT_INVALID
    except OSError as exc:
        print(str(exc), file=err)
        return 1
    return EXIT_OK


def summary(config: Config, environ: dict[str, str] | None = None) -> str:
    """Clients, models, canaries and routes; key variables shown as set or unset, never read out."""
    env = os.environ if environ is None else environ
    lines = [f"clients ({len(config.llm_clients)}):"]
    for name, c in config.llm_clients.items():
        if c.api_key_env is None:
            key = "no key"
        else:
            key = f"key ${c.api_key_env} {'set' if env.get(c.api_key_env) else 'NOT SET'}"
        lines.append(
            f"  {name}: {c.base_url} auth={c.auth} priority={c.priority} "
            f"timeout={c.timeout_secs:g}s idle={c.stream_idle_secs:g}s {key}"
        )
        lines.append(f"    models: {', '.join(c.models)}")
    lines.append(f"canaries ({len(config.canaries)}):")
    for model, canary in config.canaries.items():
        shares = ", ".join(f"{v} {p:g}%" for v, p in canary.variants.items())
        lines.append(f"  {model} -> {shares}")
    lines.append(f"routes ({len(config.routes)}):")
    for name, route in config.routes.items():
        deadline = (
            f"{route.judge_deadline_ms} ms" if route.judge_deadline_ms else "request budget only"
        )
        choices = ", ".join(f"{label}={model}" for label, model in route.choices.items())
        lines.append(
            f"  {name}: judge {route.judge}/{route.judge_model} within {deadline}; "
            f"{choices}; fallback {route.fallback}"
        )
    lines.append(f"state: {_state_summary(config.state)}")
    return "\n".join(lines)


def _state_summary(state: State) -> str:
    """Where cooling state lives; a Redis URL is shown without its credentials."""
    if state.backend == "memory":
        return "memory (each process cools accounts on its own)"
    assert state.url is not None  # required by validation for this backend
    url = urlsplit(state.url)
    where = f"{url.scheme}://{url.hostname or url.path}" + (f":{url.port}" if url.port else "")
    return (
        f"redis at {where}, key prefix {state.key_prefix!r}, timeout {state.timeout_ms} ms, "
        f"probe lease {state.probe_lease_secs:g}s (shared across replicas)"
    )


if __name__ == "__main__":
    raise SystemExit(main())
