"""Chaos soak: steady traffic through the example gateway and through Envoy while faults are
injected on a schedule; at the end, nothing lost, nothing left in a wrong state, nothing piled up.

    python bench/chaos.py                  # 10 minutes, the run docs/operations.md reports
    python bench/chaos.py --smoke          # under a minute: the mode CI runs
    python bench/chaos.py --minutes 30     # any length: the schedule scales with it

What runs, all on loopback and started by this script: the bundled mock provider (in this
process), a redis-server (the `[state]` both fronts share), the example gateway
(`uvicorn examples.starlette_app:app`), the ext_proc server (`switchyard-mw extproc`) and Envoy
(examples/envoy/envoy.yaml, ports swapped). Three accounts of one model, `a` and `b` first,
`c` behind them, all on the mock under keys of their own; under Envoy `a` and `b` are on one
provider cluster and `c` on the other (`mock-other`), with the example's aggregate clusters
over both, so a retry through Envoy moves across providers.

The schedule (fractions of the run): each account in turn refuses its key (401), fails (503),
resets connections, stalls mid-stream and starts its first token late; Redis restarts; the
config is reloaded by SIGHUP (both fronts) and by the POST route, once with an invalid file
(refused, the old config stays); a hostile HTTP/2 peer resets streams as fast as it can at the
processor. The last fifth of the run is calm, so every account can come back. Throughout,
some streaming clients leave after their first chunk.

Every client is a tenant (its key in `x-api-key` or `Authorization: Bearer`): most are
`everyone` (no limit); a quarter of the faulty run's requests (JSON Messages calls through
both fronts) are `metered`, whose tokens limit (`METERED_TOKENS` a day, shared through Redis,
`replicas_hint` 2) runs out long before Redis restarts, so the restart comes while it is
spent.

Every answer a client got is sorted: a whole answer; a documented error (a JSON error body in
the wire's shape with its type, or a started stream ended by the wire's error event); on the
Envoy front, an answer cut after its headers (Envoy passes a provider's cut on as a cut: its
documented limit, counted apart); or a defect (a transport error, a client time-out: something
hung, an answer cut without an error event, a body that is not the wire's). Targets, each
printed with its figure:
  - defects: 0 (every request got a success or a documented error);
  - accounts after the calm: every one closed, no probe left in flight, no hold in force;
  - RSS of the gateway and the processor within 5 % of their value after warm-up;
  - the gateway's asyncio tasks and both processes' open file descriptors back to their start
    (the connections a pool keeps to Redis, and Envoy's to the processor: within two of their
    start);
  - the invalid config refused; no traceback in any log;
  - Envoy's retries through an aggregate served (by Envoy's counters): failovers across
    providers happened.
  - the metered tenant: every request a whole answer, a 429 `rate_limit_error` with
    `retry-after`, or a documented error of the faults (none lost), and the tokens its whole
    answers used within its limit plus the degraded mode's bound for the one outage (with
    `replicas_hint` = the 2 replicas, one limit more: docs/policies/tenants.md).
Exit code 0 when every target is met, 1 otherwise. `--report FILE` also writes the tables as
Markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import h2.config
import h2.connection
import httpx
import uvicorn
from soak import free_port, rss_kib, wait_for

from switchyard_mw.testing import Behaviour, MockProvider
from switchyard_mw.testing.envoy import envoy_binary, with_ports

ROOT = Path(__file__).resolve().parents[1]
MODEL = "chaos-model"
KEYS = {"a": "chaos-key-a", "b": "chaos-key-b", "c": "chaos-key-c"}
CLIENT_KEY = "client"
METERED_KEY = "chaos-metered"
METERED_TOKENS = 600
"""About 18 requests' use (each about 25 input and 8 output tokens, reserving about 100): spent
within the first few seconds of the faulty run, long before Redis restarts (0.42 of it)."""
METERED_SHARE = 0.25
"""Of the faulty run's requests, those of the metered tenant."""
CLIENT_TIMEOUT_SECS = 45.0
"""Longer than any answer may take (the accounts' deadlines and cooling): past it, it hung."""

CONFIG = """
[server]
expose_headers = true

[server.envoy_failover]
"mock-then-other" = ["mock", "mock-other"]
"other-then-mock" = ["mock-other", "mock"]

[state]
backend = "redis"
url = "redis://127.0.0.1:{redis}"
replicas_hint = 2  # the gateway and the processor

[tenants.everyone]
keys = ["{everyone}"]

[tenants.metered]
keys = ["{metered}"]
limits = [{{ tokens = {metered_tokens}, per = "day" }}]

[llm_clients.a]
base_url = "{mock}"
api_key_env = "CHAOS_KEY_A"
auth = "x-api-key"
models = ["{model}"]
priority = 0
timeout_secs = {timeout}
stream_idle_secs = 2
failure_threshold = 2
cooldown_secs = 1
max_cooldown_secs = 4
envoy_cluster = "mock"

[llm_clients.b]
base_url = "{mock}"
api_key_env = "CHAOS_KEY_B"
auth = "bearer"
models = ["{model}"]
priority = 0
timeout_secs = {timeout}
stream_idle_secs = 2
failure_threshold = 2
cooldown_secs = 1
max_cooldown_secs = 4
envoy_cluster = "mock"

[llm_clients.c]
base_url = "{mock}"
api_key_env = "CHAOS_KEY_C"
auth = "x-api-key"
models = ["{model}"]
priority = 1
timeout_secs = {timeout}
stream_idle_secs = 2
failure_threshold = 2
cooldown_secs = 1
max_cooldown_secs = 4
envoy_cluster = "mock-other"
"""

ENV = {"CHAOS_KEY_A": KEYS["a"], "CHAOS_KEY_B": KEYS["b"], "CHAOS_KEY_C": KEYS["c"]}


# --- what clients saw -------------------------------------------------------------------------


@dataclass
class Seen:
    """One request's end, sorted: `kind` is ok | error | left | cut | defect, `what` the
    detail (`cut`: an answer Envoy passed on cut, its documented limit)."""

    kind: str
    what: str
    at: float
    metered_tokens: int | None = None
    """A metered tenant's request: the tokens its whole answer used (0 for any other end)."""


def classify(path: str, stream: bool, status: int, body: bytes) -> tuple[str, str]:
    """Sort one whole answer: a success, a documented error, or a defect."""
    if status == 200 and stream:
        return _stream_end(path, body)
    try:
        data = json.loads(body)
    except ValueError:
        return "defect", f"{status} body that is not JSON"
    if status == 200:
        whole = data.get("type") == "message" or data.get("object") == "chat.completion"
        return ("ok", "200") if whole else ("defect", "200 that is not a whole answer")
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and isinstance(error.get("type"), str):
        return "error", f"{status} {error['type']}"
    return "defect", f"{status} without the wire's error shape"


def _stream_end(path: str, body: bytes) -> tuple[str, str]:
    if path == "/v1/messages":
        if b"event: message_stop" in body:
            return "ok", "200 stream"
        if b"event: error" in body:
            return "error", "stream error event: " + _error_type(body)
        return "defect", "stream cut without an error event"
    if b"data: [DONE]" in body:
        return "ok", "200 stream"
    if b'data: {"error"' in body:
        return "error", "stream error event: " + _error_type(body)
    return "defect", "stream cut without an error event"


def _error_type(body: bytes) -> str:
    for line in body.splitlines():
        if line.startswith(b"data: ") and b'"error"' in line:
            with contextlib.suppress(ValueError, AttributeError, KeyError):
                return str(json.loads(line[6:])["error"]["type"])
    return "?"


def request_body(path: str, stream: bool, n: int) -> dict[str, object]:
    messages = [{"role": "user", "content": f"chaos {n}"}]
    if path == "/v1/messages":
        return {"model": MODEL, "max_tokens": 64, "stream": stream, "messages": messages}
    return {"model": MODEL, "stream": stream, "messages": messages}


async def metered(http: httpx.AsyncClient, base: str, n: int) -> Seen:
    """A metered tenant's JSON Messages call: a whole answer (its usage counted), its limit's
    429 with `retry-after`, or a documented error of the faults."""
    started = time.monotonic()
    body = request_body("/v1/messages", False, n)
    try:
        response = await http.post(
            base + "/v1/messages", json=body, headers={"x-api-key": METERED_KEY}
        )
    except httpx.TimeoutException as exc:
        return Seen("defect", f"metered: client time-out ({type(exc).__name__})", started, 0)
    except httpx.HTTPError as exc:
        return Seen("defect", f"metered: transport error {type(exc).__name__}", started, 0)
    kind, what = classify("/v1/messages", False, response.status_code, response.content)
    if response.status_code == 429:
        if what != "429 rate_limit_error" or "retry-after" not in response.headers:
            return Seen("defect", f"metered: {what} without retry-after", started, 0)
        return Seen("error", "metered: 429 rate_limit_error", started, 0)
    used = 0
    if kind == "ok":
        usage = response.json().get("usage", {})
        used = int(usage.get("input_tokens", 0)) + int(usage.get("output_tokens", 0))
    return Seen(kind, f"metered: {what}", started, used)


async def one(
    http: httpx.AsyncClient, base: str, rng: random.Random, n: int, *, envoy: bool
) -> Seen:
    path = "/v1/messages" if rng.random() < 0.5 else "/v1/chat/completions"
    stream = rng.random() < 0.4
    leave = stream and rng.random() < 0.1  # a client that goes away mid-stream
    headers = (
        {"x-api-key": CLIENT_KEY}
        if path == "/v1/messages"
        else {"authorization": f"Bearer {CLIENT_KEY}"}
    )
    started = time.monotonic()
    status = None
    try:
        async with http.stream(
            "POST", base + path, json=request_body(path, stream, n), headers=headers
        ) as response:
            status = response.status_code
            if leave and status == 200:
                async for _ in response.aiter_raw():
                    break
                return Seen("left", "client left mid-stream", started)
            body = await response.aread()
    except httpx.TimeoutException as exc:
        return Seen("defect", f"client time-out ({type(exc).__name__}): hung", started)
    except httpx.HTTPError as exc:
        if envoy and status == 200 and isinstance(exc, httpx.RemoteProtocolError):
            # Envoy passes an upstream's cut on as a cut (docs/envoy.md): nothing can append
            # an error event once the answer's headers went out.
            return Seen("cut", "answer cut after its headers (Envoy)", started)
        return Seen("defect", f"transport error {type(exc).__name__}", started)
    kind, what = classify(path, stream, response.status_code, body)
    return Seen(kind, what, started)


async def drive(
    fronts: dict[str, str],
    secs: float,
    rate: float,
    seed: int,
    seen: dict[str, list[Seen]],
    metered_share: float = 0.0,
) -> None:
    """`rate` requests a second to each front for `secs`, each on its own task; of them,
    `metered_share` the metered tenant's."""
    rng = random.Random(seed)
    timeout = httpx.Timeout(CLIENT_TIMEOUT_SECS, connect=5)
    async with httpx.AsyncClient(timeout=timeout) as http:
        tasks: set[asyncio.Task[None]] = set()
        end = time.monotonic() + secs
        n = 0
        while time.monotonic() < end:
            for front, base in fronts.items():
                n += 1

                async def run(front: str = front, base: str = base, n: int = n) -> None:
                    if rng.random() < metered_share:
                        seen[front].append(await metered(http, base, n))
                    else:
                        seen[front].append(await one(http, base, rng, n, envoy=front == "envoy"))

                task = asyncio.create_task(run())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.sleep(1 / rate)
        if tasks:
            await asyncio.wait(tasks)


# --- the processes ------------------------------------------------------------------------------


@dataclass
class Fleet:
    workdir: Path
    mock: MockProvider
    mock_port: int
    redis_port: int
    config: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    invalid_reload_refused: bool | None = None

    def spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> None:
        log = self.workdir / f"{name}.log"
        self.logs[name] = log
        with log.open("ab") as out:
            self.procs[name] = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
            )

    def stop(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def start_redis(self) -> None:
        cmd = ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1"]
        cmd += ["--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        self.spawn("redis", cmd)
        wait_for(self.redis_port)

    def write_config(self, *, timeout: float = 5, broken: bool = False) -> None:
        text = CONFIG.format(
            mock=f"http://127.0.0.1:{self.mock_port}",
            redis=self.redis_port,
            model=MODEL,
            timeout=timeout,
            everyone=_digest(CLIENT_KEY),
            metered=_digest(METERED_KEY),
            metered_tokens=METERED_TOKENS,
        )
        if broken:  # a reload with this must be refused, the config in force kept
            text = text.replace("cooldown_secs = 1\n", "cooldown_secs = -1\n", 1)
        self.config.write_text(text)


def _digest(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


@contextlib.contextmanager
def mock_provider() -> Iterator[tuple[MockProvider, int]]:
    mock = MockProvider()
    port = free_port()
    # Its injected faults raise on purpose: uvicorn's report of each is no finding.
    config = uvicorn.Config(mock, host="127.0.0.1", port=port, log_level="critical")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(port)
    try:
        yield mock, port
    finally:
        server.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def fleet(workdir: Path) -> Iterator[Fleet]:
    with mock_provider() as (mock, mock_port):
        f = Fleet(workdir, mock, mock_port, free_port(), workdir / "chaos.toml")
        try:
            f.write_config()
            f.start_redis()
            env = {**os.environ, **ENV, "SWITCHYARD_CONFIG": str(f.config)}
            env["SWITCHYARD_START_MOCK"] = "0"
            f.ports = {n: free_port() for n in ("gateway", "listener", "admin", "processor")}
            gw = [sys.executable, "-m", "uvicorn", "examples.starlette_app:app"]
            gw += ["--host", "127.0.0.1", "--port", str(f.ports["gateway"])]
            gw += ["--log-level", "warning", "--no-access-log"]
            f.spawn("gateway", gw, env)
            cli = str(Path(sys.executable).with_name("switchyard-mw"))
            listen = f"127.0.0.1:{f.ports['processor']}"
            f.spawn(
                "processor", [cli, "extproc", "--config", str(f.config), "--listen", listen], env
            )
            wait_for(f.ports["gateway"])
            wait_for(f.ports["processor"])
            ports = {n: f.ports[n] for n in ("listener", "admin", "processor")}
            ports.update(upstream=mock_port, otel=free_port())
            yaml = with_ports((ROOT / "examples/envoy/envoy.yaml").read_text(), ports)
            (workdir / "envoy.yaml").write_text(yaml)
            envoy = [envoy_binary(), "-c", str(workdir / "envoy.yaml"), "--disable-hot-restart"]
            f.spawn("envoy", [*envoy, "--concurrency", "1", "-l", "warning"])
            wait_for(f.ports["listener"])
            yield f
        finally:
            for name in ("envoy", "gateway", "processor", "redis"):
                f.stop(name)


# --- the faults ---------------------------------------------------------------------------------


def set_key(f: Fleet, account: str, behaviour: Behaviour | None) -> str:
    key = KEYS[account]
    if behaviour is None:
        f.mock.clear_behaviour(key)
        return f"account {account}: healthy again"
    f.mock.set_behaviour(key, behaviour)
    return f"account {account}: {describe(behaviour)}"


def describe(b: Behaviour) -> str:
    if b.fail != "none":
        return b.fail.replace("_", " ")
    if b.status != 200:
        return f"answers {b.status}"
    if b.body_stall_secs:
        return f"stalls {b.body_stall_secs:g} s after {b.stall_after_chunks} chunks"
    return f"first token after {b.headers_delay_secs:g} s"


def restart_redis(f: Fleet) -> str:
    f.stop("redis")
    time.sleep(1.5)
    f.start_redis()
    return "redis restarted (1.5 s down, its data gone)"


def sighup(f: Fleet) -> str:
    f.write_config(timeout=4)
    for name in ("gateway", "processor"):
        f.procs[name].send_signal(signal.SIGHUP)
    return "SIGHUP to gateway and processor (timeout_secs 5 -> 4)"


def post_reload(f: Fleet, *, broken: bool) -> str:
    f.write_config(timeout=5, broken=broken)
    url = f"http://127.0.0.1:{f.ports['gateway']}/switchyard/reload"
    answer = httpx.post(url, timeout=10)
    if broken:
        f.write_config(timeout=5)  # put the good file back for the SIGHUPs to come
        refused = f.invalid_reload_refused = answer.status_code >= 400
        return (
            f"POST reload, invalid file: {answer.status_code} ({'refused' if refused else 'TAKEN'})"
        )
    return f"POST reload, valid file: {answer.status_code}"


def rapid_reset(f: Fleet, secs: float = 3.0) -> str:
    """A peer that opens and resets streams as fast as it can (a hundred per write), and
    reconnects each time the processor sends it away."""
    path = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
    end, streams, connections, sent_away = time.monotonic() + secs, 0, 0, 0
    while time.monotonic() < end:
        connections += 1
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", f.ports["processor"]), timeout=2) as sock,
        ):
            conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
            conn.initiate_connection()
            sock.sendall(conn.data_to_send())
            sock.settimeout(0.005)
            while time.monotonic() < end:
                for _ in range(100):
                    sid = conn.get_next_available_stream_id()
                    conn.send_headers(sid, _grpc_headers(path))
                    conn.reset_stream(sid)
                streams += 100
                try:
                    sock.sendall(conn.data_to_send())
                except OSError:  # closed on us
                    sent_away += 1
                    break
                if _sent_away(sock, conn):
                    sent_away += 1
                    break
            else:  # time is up: a GOAWAY may still be on its way
                sent_away += _sent_away_within(sock, conn, 1.0)
    return (
        f"hostile HTTP/2 peer: {streams} streams opened and reset on {connections} "
        f"connections, {sent_away} sent away"
    )


def _grpc_headers(path: str) -> list[tuple[str, str]]:
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "processor"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]


def _sent_away_within(sock: socket.socket, conn: h2.connection.H2Connection, secs: float) -> bool:
    end = time.monotonic() + secs
    while time.monotonic() < end:
        if _sent_away(sock, conn):
            return True
    return False


def _sent_away(sock: socket.socket, conn: h2.connection.H2Connection) -> bool:
    try:
        data = sock.recv(65536)
    except TimeoutError:
        return False
    except OSError:
        return True
    if not data:
        return True
    with contextlib.suppress(Exception):
        for event in conn.receive_data(data):
            if type(event).__name__ == "ConnectionTerminated":
                return True
    return False


def schedule(f: Fleet) -> list[tuple[float, Callable[[], str]]]:
    """(fraction of the run, injection): the calm last fifth lets every account come back."""
    b = Behaviour
    return [
        (0.05, lambda: set_key(f, "a", b(status=401))),
        (0.12, lambda: set_key(f, "b", b(status=503))),
        (0.18, lambda: set_key(f, "a", None)),
        (0.20, lambda: set_key(f, "b", b(fail="reset_before_headers"))),
        (0.25, lambda: set_key(f, "c", b(chunks=6, stall_after_chunks=2, body_stall_secs=4))),
        (0.30, lambda: set_key(f, "b", None)),
        (0.32, lambda: set_key(f, "a", b(headers_delay_secs=7))),
        (0.38, lambda: set_key(f, "c", b(chunks=6, stall_after_chunks=3, fail="reset_mid_stream"))),
        (0.42, lambda: restart_redis(f)),
        (0.45, lambda: set_key(f, "a", None)),
        (0.48, lambda: sighup(f)),
        (0.52, lambda: set_key(f, "c", None)),
        (0.55, lambda: post_reload(f, broken=False)),
        (0.58, lambda: set_key(f, "a", b(status=503))),
        (0.60, lambda: set_key(f, "b", b(status=503))),
        (0.62, lambda: post_reload(f, broken=True)),
        (0.66, lambda: rapid_reset(f)),
        (0.70, lambda: set_key(f, "a", None)),
        (0.72, lambda: set_key(f, "b", None)),
        (0.74, lambda: rapid_reset(f)),
    ]


async def inject(f: Fleet, secs: float, started: float, log: list[tuple[float, str]]) -> None:
    for fraction, action in schedule(f):
        await asyncio.sleep(max(0.0, started + fraction * secs - time.monotonic()))
        what = await asyncio.to_thread(action)
        log.append((time.monotonic() - started, what))


# --- the checks ---------------------------------------------------------------------------------


def _tcp_ports() -> dict[str, tuple[int, int]]:
    """Every TCP socket of this machine's loopback: inode -> (local port, remote port)."""
    found = {}
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                local, remote = (int(a.rsplit(":", 1)[1], 16) for a in fields[1:3])
                found[fields[9]] = (local, remote)
    return found


def _socket_inodes(pid: int) -> list[str]:
    inodes = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            inodes.append(target[len("socket:[") : -1] if target.startswith("socket:[") else "")
    return inodes


def fds_by_peer(pid: int, peers: dict[int, str], owners: dict[int, str]) -> Counter[str]:
    """`pid`'s open descriptors by what they reach: a TCP connection to a port of `peers`, or
    from a socket a process of `owners` holds, is counted under that name (a pool's
    connections); the rest as "files, listeners, clients"."""
    ports = _tcp_ports()
    owned = {
        ports[inode][0]: name
        for owner, name in owners.items()
        for inode in _socket_inodes(owner)
        if inode in ports
    }
    kinds: Counter[str] = Counter()
    for inode in _socket_inodes(pid):
        remote = ports.get(inode, (0, 0))[1]
        kinds[peers.get(remote) or owned.get(remote) or "files, listeners, clients"] += 1
    return kinds


def gateway_health(f: Fleet) -> dict[str, int]:
    time.sleep(0.5)  # let the load client's connections close and finished tasks go
    url = f"http://127.0.0.1:{f.ports['gateway']}/switchyard/health"
    data: dict[str, int] = httpx.get(url, timeout=5).json()
    return data


def accounts(f: Fleet) -> list[dict[str, object]]:
    url = f"http://127.0.0.1:{f.ports['gateway']}/switchyard/accounts"
    found: list[dict[str, object]] = httpx.get(url, timeout=5).json()["accounts"]
    return found


def accounts_settled(found: list[dict[str, object]]) -> tuple[bool, str]:
    wrong = [
        f"{a['name']}: {a['state']}, probe {a['probe_in_flight']}, held {a['held_for_secs']}"
        for a in found
        if a["state"] != "closed" or a["probe_in_flight"] or a["held_for_secs"]
    ]
    return not wrong, "; ".join(wrong) or ", ".join(f"{a['name']} closed" for a in found)


def tracebacks(f: Fleet) -> list[str]:
    return [name for name, log in f.logs.items() if b"Traceback" in log.read_bytes()]


@dataclass
class Snapshot:
    rss: dict[str, int]
    fds: dict[str, Counter[str]]
    tasks: int


IDLE_SECS = 6.0
"""Quiet before each snapshot, past the gateway's keep-alive expiry (httpx's 5 s): its idle
connections to the provider close, so that what stays open is what the load left behind."""


AGGREGATES = ("mock-then-other", "other-then-mock")


def envoy_counters(f: Fleet) -> dict[str, int]:
    """Envoy's own counters of requests per provider cluster and of retries served through
    an aggregate (each such retry went to another provider's cluster than the attempt
    before it)."""
    url = f"http://127.0.0.1:{f.ports['admin']}/stats"
    stats = httpx.get(url, params={"filter": "upstream_rq_(total|retry_success)$"}).text
    found = {}
    for line in stats.splitlines():
        name, _, value = line.partition(": ")
        found[name.removeprefix("cluster.")] = int(value)
    return {
        "mock": found.get("mock.upstream_rq_total", 0),
        "mock-other": found.get("mock-other.upstream_rq_total", 0),
        "retried across": sum(found.get(f"{a}.upstream_rq_retry_success", 0) for a in AGGREGATES),
    }


def snapshot(f: Fleet) -> Snapshot:
    time.sleep(IDLE_SECS)
    health = gateway_health(f)
    pids = {n: f.procs[n].pid for n in ("gateway", "processor")}
    peers = {f.redis_port: "redis", f.mock_port: "provider"}
    owners = {f.procs["envoy"].pid: "envoy"}  # Envoy's pool of connections to the processor
    return Snapshot(
        rss={n: rss_kib(pid) for n, pid in pids.items()},
        fds={n: fds_by_peer(pid, peers, owners) for n, pid in pids.items()},
        tasks=health["tasks"],
    )


# --- the report ---------------------------------------------------------------------------------


def windows(
    injected: list[tuple[float, str]], seen: dict[str, list[Seen]], started: float, secs: float
) -> list[tuple[str, str, dict[str, Counter[str]]]]:
    """The run cut at each injection: what was injected, and what each front's clients saw."""
    edges = [(0.0, "start: all accounts healthy"), *injected, (secs + CLIENT_TIMEOUT_SECS, "")]
    rows = []
    for (begin, what), (end, _) in itertools.pairwise(edges):
        counts: dict[str, Counter[str]] = {}
        for front, items in seen.items():
            counts[front] = Counter(
                s.what for s in items if begin <= s.at - started < end and s.kind != "left"
            )
            counts[front]["client left"] = sum(
                1 for s in items if begin <= s.at - started < end and s.kind == "left"
            )
        rows.append((f"{begin:6.1f} s", what, counts))
    return rows


def markdown(rows: list[tuple[str, str, dict[str, Counter[str]]]], targets: list[list[str]]) -> str:
    out = ["| from | injected | gateway clients saw | Envoy clients saw |", "|---|---|---|---|"]
    for at, what, counts in rows:
        cells = [_cell(counts[front]) for front in ("gateway", "envoy")]
        out.append(f"| {at.strip()} | {what} | {cells[0]} | {cells[1]} |")
    out += ["", "| target | figure | goal | met |", "|---|---|---|---|"]
    out += [f"| {' | '.join(row)} |" for row in targets]
    return "\n".join(out) + "\n"


def _cell(counter: Counter[str]) -> str:
    return ", ".join(f"{what} x{n}" for what, n in counter.most_common() if n) or "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="under a minute, for CI")
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the faulty run")
    parser.add_argument("--rate", type=float, default=None, help="requests/s to each front")
    parser.add_argument("--report", type=Path, default=None, help="also write Markdown here")
    args = parser.parse_args()
    if shutil.which("redis-server") is None:
        print("chaos.py needs redis-server (Debian: apt-get install redis-server)")
        return 1
    # The smoke run: the whole schedule in 24 s at twice the rate (about the requests of a
    # minute at 4/s), then a calm longer than the cooling's cap (4 s) after the last fault.
    secs = 24.0 if args.smoke else args.minutes * 60
    rate = args.rate or (8.0 if args.smoke else 6.0)
    calm = 6.0 if args.smoke else 30.0
    with tempfile.TemporaryDirectory(prefix="switchyard-chaos-") as tmp, fleet(Path(tmp)) as f:
        fronts = {
            "gateway": f"http://127.0.0.1:{f.ports['gateway']}",
            "envoy": f"http://127.0.0.1:{f.ports['listener']}",
        }
        warm: dict[str, list[Seen]] = {front: [] for front in fronts}
        asyncio.run(drive(fronts, 5.0, rate, 1, warm))
        start = snapshot(f)
        seen: dict[str, list[Seen]] = {front: [] for front in fronts}
        injected: list[tuple[float, str]] = []
        started = time.monotonic()

        async def run() -> None:
            await asyncio.gather(
                drive(fronts, secs, rate, 2, seen, METERED_SHARE),
                inject(f, secs, started, injected),
            )

        asyncio.run(run())
        # The calm: a little traffic so every cooled account is probed and closes again.
        asyncio.run(drive(fronts, calm, 2.0, 3, warm))
        end = snapshot(f)
        settled, account_text = accounts_settled(accounts(f))
        counters = envoy_counters(f)
        traced = tracebacks(f)
        logs = {name: log.read_text(errors="replace")[-3000:] for name, log in f.logs.items()}
    everything = [s for items in (*seen.values(), *warm.values()) for s in items]
    defects = Counter(s.what for s in everything if s.kind == "defect")
    total = Counter(s.kind for s in everything)
    growth = {n: (end.rss[n] - start.rss[n]) / start.rss[n] * 100 for n in start.rss}
    targets = [
        [
            "requests",
            f"{sum(total.values())}: {total['ok']} whole, {total['error']} documented errors, "
            f"{total['cut']} cut by Envoy after their headers, {total['left']} clients left",
            "",
            "",
        ],
        ["defects", str(sum(defects.values())), "0", _met(not defects)],
        ["accounts after the calm", account_text, "closed, no probe, no hold", _met(settled)],
    ]
    for name in ("gateway", "processor"):
        rss = f"{start.rss[name]} -> {end.rss[name]} KiB ({growth[name]:+.1f} %)"
        targets.append([f"RSS, {name}", rss, "within 5 %", _met(abs(growth[name]) <= 5)])
        targets += fd_targets(name, start.fds[name], end.fds[name])
    refused = f.invalid_reload_refused
    targets.append(
        [
            "invalid config reloaded",
            "refused" if refused else "taken",
            "refused",
            _met(bool(refused)),
        ]
    )
    tasks = f"{start.tasks} -> {end.tasks}"
    targets.append(
        ["asyncio tasks, gateway", tasks, "back to start", _met(end.tasks <= start.tasks)]
    )
    targets.append(["tracebacks in logs", ", ".join(traced) or "none", "none", _met(not traced)])
    across = (
        f"{counters['retried across']} (requests sent to mock {counters['mock']}, "
        f"to mock-other {counters['mock-other']})"
    )
    targets.append(
        [
            "Envoy retries served on another provider's cluster",
            across,
            "at least 1",
            _met(counters["retried across"] > 0),
        ]
    )
    targets += metered_targets([s for items in seen.values() for s in items])
    rows = windows(injected, seen, started, secs)
    text = markdown(rows, targets)
    print(f"chaos soak: {secs:.0f} s at {rate:g} requests/s to each front, then {calm:.0f} s calm")
    print(text)
    if defects:
        print("defects:", dict(defects))
    for name in traced:
        print(f"--- end of {name}.log ---\n{logs[name]}")
    if args.report is not None:
        args.report.write_text(text)
    ok = all(row[3] == "yes" for row in targets if row[3])
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def metered_targets(seen: list[Seen]) -> list[list[str]]:
    """The metered tenant's requests (both fronts): each ended as it may, its limit spent, and
    the tokens charged within the limit plus one limit for the one outage (Redis's restart:
    each of the 2 replicas its share, half the limit, beyond what it last read)."""
    mine = [s for s in seen if s.metered_tokens is not None]
    ends = Counter(s.what for s in mine)
    charged = sum(s.metered_tokens or 0 for s in mine)
    refused = ends["metered: 429 rate_limit_error"]
    bound = 2 * METERED_TOKENS
    lost = sum(1 for s in mine if s.kind == "defect")
    return [
        ["metered tenant's requests", _cell(ends), "none lost", _met(bool(mine) and not lost)],
        ["metered tenant's limit spent", f"{refused} refused (429)", "some", _met(refused > 0)],
        [
            "metered tenant's tokens charged",
            f"{charged} of {METERED_TOKENS}",
            f"at most {bound}",
            _met(0 < charged <= bound),
        ],
    ]


POOLED_SLACK = 2
"""Connections a pool may hold beyond its count after warm-up: a pool opens one on demand
when all of its are busy (a Redis restart makes the store reconnect) and keeps it."""
POOLS = ("redis", "envoy")
"""Connections kept open however long they idle (the Redis clients', Envoy's to the processor);
the gateway's to the provider close after the keep-alive expiry, before each snapshot."""


def fd_targets(name: str, start: Counter[str], end: Counter[str]) -> list[list[str]]:
    """Open descriptors: those of no pool back to their start; each pool's within its slack."""
    rows = []
    for kind in sorted(set(start) | set(end)):
        pooled = kind in POOLS
        bound = start[kind] + (POOLED_SLACK if pooled else 0)
        goal = f"at most {bound} (a pool)" if pooled else "back to start"
        figure = f"{start[kind]} -> {end[kind]}"
        rows.append([f"open fds, {name}: {kind}", figure, goal, _met(end[kind] <= bound)])
    return rows


def _met(ok: bool) -> str:
    return "yes" if ok else "**no**"


if __name__ == "__main__":
    raise SystemExit(main())
