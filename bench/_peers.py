"""Section 3: peers and floors, side by side, all in front of the same mock upstream.

The mock upstream is Envoy answering every request at once (`direct_response`, one worker),
pinned to core 1 with wrk; each server under test runs alone on core 0, one process. Every row
posts the same OpenAI Chat conversation of each body size (`gpt-4o-mini`, a model in
LiteLLM's price list).

Rows: a bare Starlette pass-through (no policy) with each outbound client (aiohttp: the floor;
httpx; httpx over `httpx_aiohttp.AiohttpTransport`; httpx2), the example gateway
(`uvicorn examples.starlette_app:app`, the full stack) with each httpx-API client, and the
LiteLLM proxy (two deployments of the model plus a fallback group, in its own virtualenv under
`bench/.peers/`, installed on first use).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path

from _harness import (
    BENCH,
    MASTER_KEY,
    OPENAI_PATH,
    PYTHON,
    SERVER_CORE,
    SIZES,
    Processes,
    Result,
    Skip,
    Target,
    compare,
    free_port,
    measure_side_by_side,
    openai_body,
    pinned,
    uvicorn_cmd,
)

SECTION = "3 peers"
MODEL = "gpt-4o-mini"
PEERS = BENCH / ".peers"
LITELLM_VENV = PEERS / "litellm"
FLOOR = "pass-through aiohttp"
NECESSARY = "pass-through aiohttp + read_request (necessary work)"

GATEWAY_CONFIG = """
[llm_clients.up-a]
base_url = "{mock}"
api_key_env = "BENCH_KEY_A"
models = ["gpt-4o-mini", "gpt-4o-mini-canary", "gpt-judge"]
[llm_clients.up-b]
base_url = "{mock}"
api_key_env = "BENCH_KEY_B"
auth = "x-api-key"
models = ["gpt-4o-mini", "gpt-4o-mini-canary"]
priority = 1
[canaries."gpt-4o-mini"]
variants = {{ "gpt-4o-mini-canary" = 10.0 }}
[routes.auto]
classifier = "llm"
judge = "up-a"
judge_model = "gpt-judge"
judge_deadline_ms = 800
choices = {{ simple = "gpt-4o-mini", complex = "gpt-4o-mini-canary" }}
fallback = "gpt-4o-mini"
"""


def shipped_transport() -> str:
    """What `make_http_client()` builds today, in words."""
    import httpx
    from httpx_aiohttp import AiohttpTransport

    from switchyard_mw.clients.outbound import make_http_client

    transport = make_http_client()._transport
    if isinstance(transport, AiohttpTransport):
        return "httpx+aiohttp"
    if isinstance(transport, httpx.AsyncHTTPTransport):
        return "httpx"
    return type(transport).__name__


def ensure_litellm(log: Path) -> Path | str:
    """The `litellm` command of the peers' virtualenv, installed on first use; else why not."""
    exe = LITELLM_VENV / "bin" / "litellm"
    if exe.exists():
        return exe
    print("  installing litellm[proxy] into bench/.peers/litellm (first use only) ...", flush=True)
    try:
        with log.open("wb") as out:
            subprocess.run([PYTHON, "-m", "venv", str(LITELLM_VENV)], check=True, stdout=out)
            pip = [str(LITELLM_VENV / "bin" / "pip"), "install", "-q", "litellm[proxy]"]
            subprocess.run(pip, check=True, stdout=out, stderr=subprocess.STDOUT, timeout=1200)
    except (subprocess.SubprocessError, OSError) as exc:
        return f"litellm[proxy] could not be installed ({type(exc).__name__}; see {log})"
    return exe if exe.exists() else "litellm[proxy] installed no `litellm` command"


def litellm_config(mock: str) -> str:
    def deployment(name: str, key: str) -> dict[str, object]:
        params = {"model": f"openai/{MODEL}", "api_base": f"{mock}/v1", "api_key": key}
        return {"model_name": name, "litellm_params": params}

    config = {
        "model_list": [
            deployment(MODEL, "sk-upstream-a"),
            deployment(MODEL, "sk-upstream-b"),
            deployment(f"{MODEL}-fallback", "sk-upstream-c"),
        ],
        "router_settings": {
            "routing_strategy": "simple-shuffle",
            "fallbacks": [{MODEL: [f"{MODEL}-fallback"]}],
            "num_retries": 1,
        },
        "litellm_settings": {"telemetry": False, "set_verbose": False},
        "general_settings": {"master_key": MASTER_KEY},
    }
    return json.dumps(config, indent=1)  # JSON is YAML


def environment(workdir: Path, mock: str) -> dict[str, str]:
    """What the pass-throughs and the example gateway read (`_apps`), all in front of `mock`;
    `BENCH_CLIENT` picks the outbound client of each."""
    config = workdir / "gateway.toml"
    config.write_text(GATEWAY_CONFIG.format(mock=mock))
    return {
        "BENCH_UPSTREAM": mock,
        "BENCH_KEY_A": "sk-upstream-a",
        "BENCH_KEY_B": "sk-upstream-b",
        "SWITCHYARD_CONFIG": str(config),
        "SWITCHYARD_START_MOCK": "0",
    }


def run(
    procs: Processes,
    mock: str,
    *,
    conns: list[int],
    secs: float,
    warmup: float,
    repeat: int = 1,
    litellm: bool,
    smoke: bool = False,
    sizes: Sequence[str] = ("1KB",),
) -> tuple[list[Result], list[Skip]]:
    workdir = procs.workdir
    bodies = {size: openai_body(MODEL, SIZES[size]) for size in sizes}
    shipped = shipped_transport()
    base_env = environment(workdir, mock)
    servers: list[tuple[str, list[str] | None, dict[str, str], str]] = []
    # A smoke run keeps the two floors and the shipped gateway only.
    passthrough_kinds = ["aiohttp"] if smoke else ["aiohttp", "httpx", "httpx-aiohttp", "httpx2"]
    for kind in passthrough_kinds:
        servers.append(
            (
                f"pass-through {kind}",
                None,
                {"BENCH_CLIENT": kind},
                "_apps:passthrough_app",
            )
        )
    # The necessary-work floor: the aiohttp pass-through plus the one validating read of the
    # body switchyard cannot do without, the body sent on as the gateway sends it, so the
    # gateway's own cost shows apart from it (`_apps.passthrough`).
    servers.append((NECESSARY, None, {"BENCH_CLIENT": "aiohttp-read"}, "_apps:passthrough_app"))
    # The example gateway with httpx's own pool (as before the choice), with httpx2 standing in
    # for httpx, and with `make_http_client()` as shipped.
    gateways = [("httpx", "httpx"), ("httpx2", "httpx2")]
    gateways = [*([] if smoke else gateways), ("default", f"shipped ({shipped})")]
    for kind, label in gateways:
        name = f"example gateway, {label}"
        servers.append((name, None, {"BENCH_CLIENT": kind}, "_apps:gateway_app"))
    skips: list[Skip] = []
    if litellm:
        exe = ensure_litellm(workdir / "litellm-install.log")
        if isinstance(exe, str):
            skips.append(Skip(SECTION, f"LiteLLM proxy skipped: {exe}"))
        else:
            cfg = workdir / "litellm.yaml"
            cfg.write_text(litellm_config(mock))
            cmd = [str(exe), "--config", str(cfg), "--host", "127.0.0.1", "--num_workers", "1"]
            env = {
                "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                "LITELLM_LOG": "ERROR",
                "LITELLM_MODE": "PRODUCTION",
                "DISABLE_ADMIN_UI": "True",
                "NO_DOCS": "True",
            }
            servers.append(("LiteLLM proxy", cmd, env, ""))
    targets: list[Target] = []
    started: list[subprocess.Popen[bytes]] = []
    try:
        # Every server up at once (idle but for its turn), so that each round measures the
        # floors and the gateways under the same conditions (`measure_interleaved`).
        for name, command, extra_env, target in servers:
            port = free_port()
            if command is None:
                cmd = uvicorn_cmd(target, port)
            else:
                cmd = pinned(SERVER_CORE, [*command, "--port", str(port)])
            env = {**base_env, **extra_env}
            try:
                proc = procs.start(_slug(name), cmd, port=port, env=env, timeout=180)
            except (RuntimeError, TimeoutError) as exc:
                skips.append(Skip(SECTION, f"{name} did not start: {str(exc)[:300]}"))
                continue
            started.append(proc)
            targets.append(Target(name, f"http://127.0.0.1:{port}{OPENAI_PATH}", proc.pid))
        results = measure_side_by_side(
            procs,
            targets,
            bodies,
            section=SECTION,
            conns=conns,
            secs=secs,
            warmup=warmup,
            repeat=repeat,
            expect_header=lambda name: "x-switchyard-model" if "gateway" in name else None,
        )
    finally:
        for proc in started:
            procs.stop(proc)
    compare(results, FLOOR)
    return results, skips


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in name).strip("-")
