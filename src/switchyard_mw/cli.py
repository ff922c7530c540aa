"""The `switchyard-mw` command."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO
from urllib.parse import urlsplit

from .clouds.checks import EnvironmentCheck, environment_checks
from .clouds.kinds import base_url_of
from .config import (
    Canary,
    Config,
    LLMClient,
    Server,
    State,
    config_warnings,
    diagnose_config,
    load_config,
)
from .config_tenants import Limit
from .errors import ConfigError
from .toml_lines import key_lines, line_of, parse_key_path

if TYPE_CHECKING:  # the extproc package imports grpc: only `extproc` itself needs it
    from .extproc import Transport
    from .telemetry.logs import LogFormat

EXIT_OK = 0
EXIT_INVALID = 2
_extproc_log = logging.getLogger("switchyard_mw.extproc")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="switchyard-mw",
        description="Policies for LLM gateways: deadlines, canary stickiness, fault cooling, "
        "judge timeouts.",
    )
    parser.add_argument("--version", action="version", version=f"switchyard-mw {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    check = commands.add_parser("check-config", help="validate a config file and summarise it")
    check.add_argument("file", help="path to the TOML config")
    check.add_argument(
        "--no-env",
        action="store_true",
        help="skip the checks that read this machine (each api_key_env variable, a cloud "
        "account's credentials file, AWS profile and extra) and list them",
    )
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
        choices=["frames", "h2", "grpcio"],
        default="frames",
        help="h2 (the default: a plain asyncio HTTP/2 server, no TLS, no compression) or "
        "grpcio (grpc.aio), the same service at two to three times the CPU per request",
    )
    _add_log_flags(extproc)
    mock = commands.add_parser(
        "mock",
        help="serve the bundled mock LLM provider (Anthropic/OpenAI wire formats, offline)",
        description="Serve the bundled mock provider and its control API "
        "(PUT /_mock/behaviours/{key} to make a key answer 401, stall, reset...).",
    )
    mock.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1")
    mock.add_argument("--port", type=int, default=9100, help="default: 9100")
    mock.add_argument("--reply", default=None, help="the reply text of every answer")
    _add_serve(commands)
    litellm = commands.add_parser(
        "from-litellm",
        help="print a LiteLLM proxy config.yaml as a switchyard config (TOML)",
        description="Translate a LiteLLM proxy config: the TOML goes to stdout, what could not "
        "be translated to stderr (and the TOML's opening comment). Needs the 'migrate' extra.",
    )
    litellm.add_argument("file", help="path to LiteLLM's config.yaml")
    args = parser.parse_args(argv)
    if args.command in ("serve", "extproc"):
        from .engine.early_signal import hold_early

        hold_early()  # a SIGHUP while the server loads must not end it
    if args.command == "serve":
        return run_serve(args, err=sys.stderr)
    if args.command == "check-config":
        return check_config(args.file, out=sys.stdout, err=sys.stderr, check_env=not args.no_env)
    if args.command == "mock":
        return run_mock(args.host, args.port, args.reply)
    if args.command == "from-litellm":
        return from_litellm(args.file, out=sys.stdout, err=sys.stderr)
    if args.command == "extproc":
        return run_extproc(
            args.config,
            args.listen,
            err=sys.stderr,
            workers=args.workers,
            transport=args.transport,
            log_format=args.log_format,
            log_level=args.log_level,
        )
    parser.error(f"unknown command {args.command}")  # argparse exits; kept for the type checker
    return EXIT_INVALID


def check_config(path: str, *, out: TextIO, err: TextIO, check_env: bool = True) -> int:
    """Print OK and a one-screen summary (exit 0), or every problem in one list (exit 2).

    Warnings (`warning:` lines on stderr) never change the exit code. A check that reads this
    machine (a key variable, a credentials file, an extra) is a problem unless `check_env` is
    off: the server would refuse to start. Off, each check skipped is named.
    """
    config, problems = diagnose_config(path)
    skipped: list[EnvironmentCheck] = []
    if config is not None:
        checks = environment_checks(config)
        if check_env:
            problems.extend(problem for check in checks for problem in check.run())
        else:
            skipped = checks
    if problems or config is None:
        code = _problems(path, problems, err)
        _skipped(skipped, err)
        return code
    for warning in config_warnings(config):
        print(f"warning: {warning}", file=err)
    print(f"OK {path}", file=out)
    print(summary(config, keys_checked=check_env), file=out)
    _skipped(skipped, out)
    return EXIT_OK


def _skipped(checks: Sequence[EnvironmentCheck], file: TextIO) -> None:
    if checks:
        print(f"skipped with --no-env ({len(checks)}: they read this machine):", file=file)
    for check in checks:
        print(f"  {check.at}: {check.what}", file=file)


def _problems(path: str, problems: Sequence[str], err: TextIO) -> int:
    return _listed(path, located(path, problems), err)


def _listed(path: str, problems: Sequence[str], err: TextIO) -> int:
    print(f"{path}: {len(problems)} problem(s)", file=err)
    for problem in problems:
        print(f"  {problem}", file=err)
    return EXIT_INVALID


def located(path: str, problems: Sequence[str]) -> list[str]:
    """Each problem naming a key of the file, opened with `FILE:LINE:` where the key (or, for a
    missing key, its table) is written; the others as they are."""
    try:
        lines = key_lines(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return list(problems)
    shown = []
    for problem in problems:
        key = parse_key_path(problem)
        line = None if key is None else line_of(lines, key)
        shown.append(problem if line is None else f"{path}:{line}: {problem}")
    return shown


def from_litellm(path: str, *, out: TextIO, err: TextIO) -> int:
    """The translation on `out` (exit 0), what it left out on `err`; a file that is not a
    LiteLLM config is exit 2, a missing `migrate` extra exit 1. The problems name YAML, not
    TOML, keys: they are listed as they are, without `check-config`'s FILE:LINE."""
    from .errors import MissingExtraError
    from .migrate import translate_litellm

    try:
        text = Path(path).read_text(encoding="utf-8")
        translation = translate_litellm(text, source=path)
    except FileNotFoundError:
        return _listed(path, [f"{path}: no such file"], err)
    except (OSError, UnicodeDecodeError) as exc:
        return _listed(path, [f"{path}: cannot read: {exc}"], err)
    except MissingExtraError as exc:
        print(str(exc), file=err)
        return 1
    except ConfigError as exc:
        return _listed(path, exc.problems, err)
    out.write(translation.toml)
    for line in translation.untranslated:
        print(f"not translated: {line}", file=err)
    return EXIT_OK


def run_mock(host: str, port: int, reply: str | None) -> int:
    """Serve the bundled mock provider until Ctrl-C (needs uvicorn, as the example does)."""
    from .testing.mock_provider import main as mock_main

    argv = ["--host", host, "--port", str(port)]
    mock_main([*argv, "--reply", reply] if reply is not None else argv)
    return EXIT_OK


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("switchyard-mw")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def run_extproc(
    path: str,
    listen: str,
    *,
    err: TextIO,
    workers: int = 1,
    transport: Transport = "frames",
    log_format: LogFormat = "text",
    log_level: str = "info",
) -> int:
    """Serve ext_proc until SIGTERM; a bad config, listen address or key is exit 2."""
    import asyncio
    import functools

    from .errors import MissingExtraError, StartupError
    from .telemetry import logs

    try:
        from .extproc import ExtProcServer, parse_listen, serve
        from .extproc.reloading import NO_CLUSTER, load_extproc_config
    except MissingExtraError as exc:
        print(str(exc), file=err)
        return 1

    try:
        config = load_config(path)
        parse_listen(listen)
    except ConfigError as exc:
        return _problems(path, exc.problems, err)
    except ValueError as exc:
        print(f"--listen {exc}", file=err)
        return EXIT_INVALID
    if not any(client.envoy_cluster for client in config.llm_clients.values()):
        print(f"{path}: {NO_CLUSTER}", file=err)
        return EXIT_INVALID
    loader = functools.partial(load_extproc_config, path)  # SIGHUP reads the file again
    log_config = logs.configure(log_format, level=log_level)

    def announce(where: str, count: int) -> None:
        """The line a script waits for; in JSON, a record like every other line."""
        if log_format == "json":
            logs.decision(
                _extproc_log,
                logging.INFO,
                "extproc.listening",
                "listening",
                listen=where,
                workers=count,
            )
            return
        many = f" ({count} workers)" if count != 1 else ""
        print(f"switchyard-mw extproc listening on {where}{many}", file=err, flush=True)

    if workers != 1:
        from .extproc.workers import run_workers

        return run_workers(
            config,
            listen,
            workers,
            err=err,
            transport=transport,
            loader=loader,
            log_config=log_config,
            announce=announce,
        )

    def ready(server: ExtProcServer) -> None:
        where = listen if server.port is None else f"{listen.rpartition(':')[0]}:{server.port}"
        announce(where, 1)

    try:
        asyncio.run(serve(config, listen, ready=ready, transport=transport, loader=loader))
    except OSError as exc:  # `ListenError` too, a StartupError but not the config's fault
        print(str(exc), file=err)
        return 1
    except StartupError as exc:
        print(f"{path}: {exc}", file=err)
        return EXIT_INVALID
    return EXIT_OK


def _add_serve(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve the forwarding gateway on uvicorn (keep-alive, graceful stop, SIGHUP reload)",
        description="Serve the forwarding gateway: /v1/messages (and its count_tokens), "
        "/v1/chat/completions and /v1/responses through the policies, /v1/models from the "
        "config, /metrics and the operator routes (loopback). "
        "SIGHUP reloads the config (in every worker); SIGTERM stops it gracefully.",
    )
    serve.add_argument("config", help="path to the TOML config")
    serve.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1 (loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="default: 8000")
    serve.add_argument(
        "--workers",
        type=_at_least_one,
        default=1,
        help="worker processes on one port; they share account health only with [state] "
        'backend = "redis" (default: 1)',
    )
    _add_log_flags(serve)
    serve.add_argument(
        "--no-access-log", action="store_true", help="leave out uvicorn's line per request"
    )
    serve.add_argument(
        "--graceful-secs",
        type=int,
        default=30,
        help="on SIGTERM, how long requests under way (streams too) may finish (default: 30)",
    )


def _add_log_flags(command: argparse.ArgumentParser) -> None:
    """`--log-format` and `--log-level`, alike on `serve` and `extproc`."""
    command.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="text lines, or one JSON object per line (switchyard's records and the server's)",
    )
    command.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default="info",
        help="default: info (decision records are INFO and above)",
    )


def _at_least_one(text: str) -> int:
    number = int(text)
    if number < 1:
        raise argparse.ArgumentTypeError(f"{number}: must be at least 1")
    return number


def run_serve(args: argparse.Namespace, *, err: TextIO) -> int:
    """`serve`: the gateway needs the `gateway` extra (aiohttp, uvicorn): said, exit 1."""
    from .errors import MissingExtraError

    # The checks of `check-config` (each problem at its FILE:LINE), before anything loads.
    config, problems = diagnose_config(args.config)
    if config is not None:
        problems.extend(p for check in environment_checks(config) for p in check.run())
    if problems or config is None:
        return _problems(args.config, problems, err)
    try:
        from .gateway.serve import serve
    except MissingExtraError as exc:
        print(str(exc), file=err)
        return 1
    except ImportError as exc:  # uvicorn
        print(str(MissingExtraError("switchyard-mw serve", "gateway", exc)), file=err)
        return 1
    return serve(
        args.config,
        host=args.host,
        port=args.port,
        workers=args.workers,
        log_format=args.log_format,
        log_level=args.log_level,
        access_log=not args.no_access_log,
        graceful_secs=args.graceful_secs,
        err=err,
    )


def _endpoint(c: LLMClient) -> str:
    """Where an account is called and how it authenticates, credentials never read out."""
    if c.vertex is not None and c.kind == "vertex":
        v = c.vertex
        credentials = v.credentials_file or "application default"
        return (
            f"vertex {base_url_of(c)} project={v.project} region={v.region} "
            f"credentials={credentials}"
        )
    if c.bedrock is not None and c.kind == "bedrock":
        b = c.bedrock
        where = base_url_of(c) or "https://bedrock-runtime.{region}.amazonaws.com"
        profile = b.profile or "default chain"
        return f"bedrock {where} region={b.region or 'from AWS'} profile={profile}"
    return f"{c.base_url} auth={c.auth}"


def summary(
    config: Config, environ: dict[str, str] | None = None, *, keys_checked: bool = True
) -> str:
    """Every table of the config, one header each (named as in the file); key variables
    shown as set or unset (unless not `keys_checked`), never read out."""
    env = os.environ if environ is None else environ
    lines = [f"llm_clients ({len(config.llm_clients)}):"]
    for name, c in config.llm_clients.items():
        if c.kind != "api":
            key = ""
        elif c.api_key_env is None:
            key = " no key"
        elif not keys_checked:
            key = f" key ${c.api_key_env}"
        else:
            key = f" key ${c.api_key_env} {'set' if env.get(c.api_key_env) else 'NOT SET'}"
        lines.append(
            f"  {name}: {_endpoint(c)} priority={c.priority} "
            f"timeout={c.timeout_secs:g}s idle={c.stream_idle_secs:g}s{key}"
        )
        names = [
            m if c.provider_model(m) == m else f"{m} (as {c.provider_model(m)})" for m in c.models
        ]
        lines.append(f"    models: {', '.join(names)}")
        if c.path is not None:
            lines.append(f"    path: {c.path}")
        lines.append(f"    cooling: {_cooling(c)}")
        lines.append(f"    streams: {_streams(c, config.server)}")
    lines.append(f"canaries ({len(config.canaries)}):")
    for model, canary in config.canaries.items():
        lines.append(f"  {model} -> {_canary(canary)}")
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
    lines.append(f"fallbacks ({len(config.fallbacks)}):")
    for model, chain in config.fallbacks.items():
        lines.append(f"  {model} -> {', '.join(chain.models)} on {', '.join(chain.on)}")
    lines.extend(_tenants_summary(config, env, keys_checked=keys_checked))
    lines.append(f"server: {_server_summary(config.server)}")
    lines.append(f"state: {_state_summary(config.state)}")
    return "\n".join(lines)


def _tenants_summary(config: Config, env: Mapping[str, str], *, keys_checked: bool) -> list[str]:
    """`[tenants]`, `[[limits]]` and `[prices]`: key counts and variables (never a key or its
    digest), model patterns, each limit."""
    lines = [f"tenants ({len(config.tenants)}):"]
    if not config.tenants:
        lines.append("  none: anyone who reaches the gateway spends its keys")
    for name, tenant in config.tenants.items():
        keys = [f"{len(tenant.keys)} key{'' if len(tenant.keys) == 1 else 's'}"]
        if tenant.keys_env is not None:
            state = "" if not keys_checked else (" set" if env.get(tenant.keys_env) else " NOT SET")
            keys.append(f"${tenant.keys_env}{state}")
        limits = "; ".join(_limit(limit) for limit in tenant.limits) or "no limits"
        lines.append(f"  {name}: {' + '.join(keys)}; models {', '.join(tenant.models)}; {limits}")
    lines.append(f"limits ({len(config.limits)}):")
    lines.extend(f"  {_limit(limit)}" for limit in config.limits)
    lines.append(f"prices ({len(config.prices)}):")
    for model, price in config.prices.items():
        cache = ""
        if price.cache_read is not None or price.cache_write is not None:
            read = price.input if price.cache_read is None else price.cache_read
            write = price.input if price.cache_write is None else price.cache_write
            cache = f", cache read {read:g}, cache write {write:g}"
        lines.append(
            f"  {model}: input {price.input:g}, output {price.output:g}{cache} USD per M tokens"
        )
    return lines


def _limit(limit: Limit) -> str:
    amount = limit.amount()
    what = f"{amount:g} USD" if limit.usd is not None else f"{amount:.0f} {limit.measure()}"
    return f"{what} per {limit.per}" + ("" if limit.model is None else f" for {limit.model}")


def _cooling(c: LLMClient) -> str:
    retry = (
        f"retried in place after a wait up to {c.retry_wait_max_secs:g}s"
        if c.retry_wait_max_secs
        else "no retry in place"
    )
    return (
        f"after {c.failure_threshold} faults for {c.cooldown_secs:g}s up to "
        f"{c.max_cooldown_secs:g}s; a 429 holds it up to {c.max_throttle_secs:g}s; {retry}"
    )


def _streams(c: LLMClient, server: Server) -> str:
    """The opt-in stream policies as they apply to this account (hedging, resuming)."""
    first = c.first_token_secs if c.first_token_secs is not None else c.timeout_secs
    parts = [f"first token within {first:g}s"]
    if c.min_tokens_per_sec is not None:
        parts.append(
            f"at least {c.min_tokens_per_sec:g} tokens/s over {c.throughput_window_secs:g}s"
        )
    if c.hedge_after_secs == "auto":
        parts.append("hedge after its p95 time to first token")
    elif c.hedge_after_secs is not None:
        parts.append(f"hedge after {c.hedge_after_secs:g}s")
    else:
        parts.append("no hedge")
    resume = server.resume_streams if c.resume_streams is None else c.resume_streams
    origin = "[server]" if c.resume_streams is None else "this account"
    parts.append(f"resume {'on' if resume else 'off'} ({origin})")
    if c.weight != 1:
        parts.append(f"weight {c.weight:g}")
    if c.envoy_cluster is not None:
        parts.append(f"envoy cluster {c.envoy_cluster}")
    return "; ".join(parts)


def _canary(canary: Canary) -> str:
    parts = [", ".join(f"{v} {p:g}%" for v, p in canary.variants.items()) or "no variant"]
    if canary.guard is not None:
        g = canary.guard
        parts.append(
            f"guard: rolled back above {g.max_fault_rate:.0%} faults over {g.window_secs:g}s "
            f"(from {g.min_requests} attempts)"
        )
    if canary.shadow:
        parts.append("shadow " + ", ".join(f"{m} {p:g}%" for m, p in canary.shadow.items()))
    return "; ".join(parts)


def _server_summary(server: Server) -> str:
    headers = "on" if server.expose_headers else "off"
    generic = ", ".join(server.generic_paths) or "none"
    return (
        f"x-switchyard-* headers {headers}; bodies up to {server.max_body_bytes} bytes read "
        f"within {server.body_read_timeout_secs:g}s; generic paths {generic}; "
        f"shadow in flight up to {server.shadow_max_inflight}; "
        f"resume streams {'on' if server.resume_streams else 'off'}; "
        f"hedges up to {server.hedge_max_ratio:.0%} of a model's requests a minute"
        + ("" if server.tenant_header is None else f"; tenant header {server.tenant_header}")
        + "".join(
            f"; envoy failover {name} = {' then '.join(members)}"
            for name, members in server.envoy_failover.items()
        )
    )


def _state_summary(state: State) -> str:
    """Where cooling state lives; a Redis URL is shown without its credentials."""
    if state.backend == "memory":
        return "memory (each process cools accounts on its own)"
    if state.mode == "sentinel":
        where = f"sentinel {state.service!r} via {', '.join(state.sentinels)}"
    else:
        assert state.url is not None  # required by validation outside sentinel mode
        url = urlsplit(state.url)
        where = f"{url.scheme}://{url.hostname or url.path}" + (f":{url.port}" if url.port else "")
        where = f"cluster {where}" if state.mode == "cluster" else where
    return (
        f"redis at {where}, key prefix {state.key_prefix!r}, timeout {state.timeout_ms} ms, "
        f"probe lease {state.probe_lease_secs:g}s (shared across replicas)"
    )


if __name__ == "__main__":
    raise SystemExit(main())
