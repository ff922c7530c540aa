"""`switchyard-mw check-config FILE` run as a user runs it (a subprocess): what `--no-env`
skips and says it skipped, an empty config refused, a summary of every table, and each
problem placed on the line of the file where its key is written."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from switchyard_mw.config import Config

ACCOUNT = """\
[llm_clients.a]
base_url = "http://127.0.0.1:9"
api_key_env = "SY_TEST_KEY_A"
models = ["m", "m2"]
"""


def check_config(
    path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SY_TEST_")}
    return subprocess.run(
        [sys.executable, "-m", "switchyard_mw.cli", "check-config", *args, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**environ, **(env or {})},
    )


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "switchyard.toml"
    path.write_text(text)
    return path


# -- --no-env: skips what reads this machine, and names it --

CLOUDS = (
    ACCOUNT
    + """
[llm_clients.g]
kind = "vertex"
models = ["m"]
vertex = {{ project = "p", region = "us-east5", credentials_file = "{key_file}" }}

[llm_clients.b]
kind = "bedrock"
models = ["m"]
bedrock = {{ region = "us-east-1", profile = "sy-test-no-such-profile" }}
"""
)


@pytest.fixture
def clouds(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    key_file = tmp_path / "missing-sa.json"
    aws = {  # shared AWS files that exist nowhere: no profile can be found in them
        "AWS_CONFIG_FILE": str(tmp_path / "aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "aws-credentials"),
    }
    return write(tmp_path, CLOUDS.format(key_file=key_file)), aws


def test_without_no_env_every_check_of_this_machine_runs(
    clouds: tuple[Path, dict[str, str]],
) -> None:
    path, aws = clouds
    done = check_config(path, env=aws)
    assert done.returncode == 2, done.stdout
    assert "llm_clients.a.api_key_env: environment variable SY_TEST_KEY_A is not set" in done.stderr
    assert "llm_clients.g.vertex.credentials_file: " in done.stderr
    assert "missing-sa.json: no such file" in done.stderr
    if importlib.util.find_spec("botocore") is not None:
        assert "llm_clients.b.bedrock.profile: no profile 'sy-test-no-such-profile'" in done.stderr
    else:
        assert "llm_clients.b.kind: \"bedrock\" needs the 'bedrock' extra" in done.stderr


def test_no_env_skips_them_and_names_each_one(clouds: tuple[Path, dict[str, str]]) -> None:
    path, aws = clouds
    done = check_config(path, "--no-env", env=aws)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith(f"OK {path}\n")
    skipped = out[out.index("skipped with --no-env") :].splitlines()
    assert skipped == [
        "skipped with --no-env (5: they read this machine):",
        "  llm_clients.a.api_key_env: $SY_TEST_KEY_A is set",
        "  llm_clients.g.kind: the 'vertex' extra is installed",
        f"  llm_clients.g.vertex.credentials_file: {path.parent}/missing-sa.json is a readable "
        "credentials file",
        "  llm_clients.b.kind: the 'bedrock' extra is installed",
        "  llm_clients.b.bedrock: the AWS profile and region resolve from the shared AWS files "
        "and the environment",
    ]
    # The summary does not read the variable either: it is not said to be set or unset.
    assert "key $SY_TEST_KEY_A priority" not in out
    assert re.search(r"key \$SY_TEST_KEY_A\n", out), out
    assert "NOT SET" not in out


def test_no_env_names_its_skipped_checks_beside_the_problems_too(tmp_path: Path) -> None:
    path = write(
        tmp_path, ACCOUNT.replace('models = ["m", "m2"]', 'models = ["m"]\npriority = "x"')
    )
    done = check_config(path, "--no-env")
    assert done.returncode == 2
    assert "llm_clients.a.priority: expected `int`, got `str`" in done.stderr
    assert "skipped with --no-env (1: they read this machine):" in done.stderr
    assert "  llm_clients.a.api_key_env: $SY_TEST_KEY_A is set" in done.stderr


def test_no_env_says_nothing_when_nothing_reads_this_machine(tmp_path: Path) -> None:
    path = write(tmp_path, ACCOUNT.replace('api_key_env = "SY_TEST_KEY_A"\n', ""))
    done = check_config(path, "--no-env")
    assert done.returncode == 0, done.stderr
    assert "skipped" not in done.stdout + done.stderr


# -- a config without accounts serves nothing --


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("", "  llm_clients: no accounts"),
        ("# nothing yet\n", "  llm_clients: no accounts"),
        ("[server]\nexpose_headers = false\n", "  llm_clients: no accounts"),
        ("\n[llm_clients]\n", "switchyard.toml:2: llm_clients: no accounts"),
    ],
)
def test_a_config_without_accounts_is_an_error(tmp_path: Path, text: str, shown: str) -> None:
    path = write(tmp_path, text)
    done = check_config(path, "--no-env")
    assert done.returncode == 2, done.stdout
    assert done.stdout == ""
    assert f"{path}: 1 problem(s)" in done.stderr
    assert shown in done.stderr
    assert "at least one [llm_clients.NAME] table" in done.stderr


# -- the summary covers every table --

EVERY_TABLE = (
    ACCOUNT
    + """\
hedge_after_secs = 1.5
retry_wait_max_secs = 2
first_token_secs = 8
min_tokens_per_sec = 5

[llm_clients.b]
base_url = "http://127.0.0.1:9"
models = ["m", "m2", "j"]
hedge_after_secs = "auto"
resume_streams = false
weight = 2

[canaries.m]
variants = { m2 = 10 }
shadow = { j = 5 }
guard = { max_fault_rate = 0.2, min_requests = 20, window_secs = 300 }

[routes.auto]
classifier = "llm"
judge = "b"
judge_model = "j"
choices = { simple = "m", complex = "m2" }
fallback = "m"

[fallbacks]
m = ["m2"]

[tenants.team-a]
keys = ["sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"]
keys_env = "SY_TEST_TENANT_KEYS"
models = ["m*"]
limits = [{ tokens = 2_000_000, per = "day" }, { usd = 50.0, per = "month", model = "m" }]

[[limits]]
model = "m2"
requests = 600
per = "minute"

[prices.m]
input = 15.0
output = 75.0
cache_read = 1.5

[server]
expose_headers = false
max_body_bytes = 1048576
generic_paths = ["/v1/embeddings"]
resume_streams = true
hedge_max_ratio = 0.1
tenant_header = "x-switchyard-tenant"

[state]
backend = "redis"
url = "redis://:secret@10.0.0.5:6379/0"
"""
)


def test_the_summary_names_every_table_of_the_file(tmp_path: Path) -> None:
    done = check_config(write(tmp_path, EVERY_TABLE), env={"SY_TEST_KEY_A": "k"})
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for field in msgspec.structs.fields(Config):  # a table added to the schema is shown too
        assert re.search(rf"^{field.encode_name}\b", out, re.M), (field.encode_name, out)
    assert "secret" not in out


def test_the_summary_shows_hedging_resume_retries_and_the_server_table(tmp_path: Path) -> None:
    out = check_config(write(tmp_path, EVERY_TABLE), env={"SY_TEST_KEY_A": "k"}).stdout
    assert "key $SY_TEST_KEY_A set" in out
    assert (
        "    cooling: after 3 faults for 30s up to 300s; a 429 holds it up to 60s; "
        "retried in place after a wait up to 2s\n"
    ) in out
    assert (
        "    streams: first token within 8s; at least 5 tokens/s over 10s; hedge after 1.5s; "
        "resume on ([server])\n"
    ) in out
    assert (
        "    streams: first token within 60s; hedge after its p95 time to first token; "
        "resume off (this account); weight 2\n"
    ) in out
    assert (
        "  m -> m2 10%; guard: rolled back above 20% faults over 300s (from 20 attempts); "
        "shadow j 5%\n"
    ) in out
    assert "fallbacks (1):\n  m -> m2 on unavailable, context_length\n" in out
    assert (
        "server: x-switchyard-* headers off; bodies up to 1048576 bytes read within 30s; "
        "generic paths /v1/embeddings; shadow in flight up to 16; resume streams on; "
        "hedges up to 10% of a model's requests a minute; tenant header x-switchyard-tenant\n"
    ) in out
    assert "state: redis at redis://10.0.0.5:6379, key prefix 'switchyard'" in out


def test_the_summary_shows_tenants_limits_and_prices_never_a_key(tmp_path: Path) -> None:
    env = {"SY_TEST_KEY_A": "k", "SY_TEST_TENANT_KEYS": "sk-raw-tenant-key"}
    out = check_config(write(tmp_path, EVERY_TABLE), env=env).stdout
    assert (
        "tenants (1):\n  team-a: 1 key + $SY_TEST_TENANT_KEYS set; models m*; "
        "2000000 tokens per day; 50 USD per month for m\n"
    ) in out
    assert "limits (1):\n  600 requests per minute for m2\n" in out
    assert (
        "prices (1):\n  m: input 15, output 75, cache read 1.5, cache write 15 USD per M tokens\n"
    ) in out
    assert "; tenant header x-switchyard-tenant\n" in out
    assert "sk-raw-tenant-key" not in out
    assert "9f86d0" not in out
    unset = check_config(write(tmp_path, EVERY_TABLE), env={"SY_TEST_KEY_A": "k"})
    assert "$SY_TEST_TENANT_KEYS NOT SET" in unset.stdout + unset.stderr


# -- every problem on the line of its key --

GUARD = "[canaries.m]\nvariants = { m2 = 10 }\n"
SENTINELS = '[state]\nbackend = "redis"\nmode = "sentinel"\n'


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        pytest.param(
            ACCOUNT + "timeout_sec = 5  # here\n",
            'llm_clients.a.timeout_sec: unknown key (did you mean "timeout_secs"?)',
            id="unknown key",
        ),
        pytest.param(
            ACCOUNT + 'timeout_secs = "5"  # here\n',
            "llm_clients.a.timeout_secs: expected `float`, got `str`",
            id="wrong type",
        ),
        pytest.param(
            ACCOUNT + "timeout_secs = 0  # here\n",
            "llm_clients.a.timeout_secs: must be > 0",
            id="bad value",
        ),
        pytest.param(
            '[llm_clients."my acct"]  # here\nbase_url = "http://h"\n\n' + ACCOUNT,
            'llm_clients."my acct".models: required',
            id="missing key: its table's header",
        ),
        pytest.param(
            ACCOUNT + GUARD + "[canaries.m.guard]\nmin_requests = 1\nmax_fault_rate = 2  # here\n"
            "window_secs = 1\n",
            "canaries.m.guard.max_fault_rate: must be <= 1",
            id="nested table",
        ),
        pytest.param(
            ACCOUNT + '[canaries.m]\nsalt = "s"\nvariants = { m2 = 10, ghost = 5 }  # here\n',
            'canaries.m.variants.ghost: no llm_clients entry serves model "ghost"',
            id="inline table",
        ),
        pytest.param(
            ACCOUNT
            + GUARD
            + "guard = { min_requests = 1, window_secs = 1, max_fault_rate = -1 }  # here\n",
            "canaries.m.guard.max_fault_rate: must be >= 0",
            id="a table inline in a table",
        ),
        pytest.param(
            '[llm_clients]\nb.models = ["m"]\nb.base_url = "ftp://h"  # here\n',
            "llm_clients.b.base_url: must start with http:// or https://",
            id="dotted keys",
        ),
        pytest.param(
            ACCOUNT + SENTINELS + 'sentinels = [\n  "h:1",\n  "nope",  # here\n]\n',
            "state.sentinels[1]: 'nope' is not host:port",
            id="array element",
        ),
        pytest.param(
            ACCOUNT + "\n[[canaries]]  # here\nvariants = { m2 = 1 }\n",
            "canaries: expected a table",
            id="array of tables",
        ),
        pytest.param(
            ACCOUNT.replace('"SY_TEST_KEY_A"', '"SY_TEST_KEY_A"  # here'),
            "llm_clients.a.api_key_env: environment variable SY_TEST_KEY_A is not set",
            id="the environment's check",
        ),
    ],
)
def test_each_problem_carries_the_line_of_its_key(tmp_path: Path, text: str, problem: str) -> None:
    path = write(tmp_path, text)
    line = next(n for n, source in enumerate(text.splitlines(), 1) if source.endswith("# here"))
    done = check_config(path)
    assert done.returncode == 2, done.stdout
    assert f"  {path}:{line}: {problem}\n" in done.stderr, done.stderr


def test_problems_of_the_whole_file_have_no_line(tmp_path: Path) -> None:
    path = write(tmp_path, ACCOUNT + "timeout_secs = \n")
    done = check_config(path)
    assert done.returncode == 2
    assert f"  {path}: invalid TOML: " in done.stderr
    assert "(at line 5, column 16)" in done.stderr  # tomllib's own position


def test_the_summary_names_each_envoy_failover_aggregate_in_order(tmp_path: Path) -> None:
    text = """
[llm_clients.a]
base_url = "http://127.0.0.1:9100"
api_key_env = "SY_TEST_KEY_A"
models = ["m"]
envoy_cluster = "one"

[llm_clients.b]
base_url = "http://127.0.0.1:9100"
api_key_env = "SY_TEST_KEY_A"
models = ["m"]
envoy_cluster = "two"

[server.envoy_failover]
"one-then-two" = ["one", "two"]
"two-then-one" = ["two", "one"]
"""
    out = check_config(write(tmp_path, text), env={"SY_TEST_KEY_A": "k"}).stdout
    assert (
        "; envoy failover one-then-two = one then two; envoy failover two-then-one = two then one\n"
    ) in out
