"""The `switchyard-mw` command: version, check-config in one pass, warnings, env, extproc guard."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from switchyard_mw.cli import main
from switchyard_mw.config import config_warnings, parse_config
from switchyard_mw.errors import ConfigError

CONFIG = """
[llm_clients.a]
base_url = "http://127.0.0.1:9"
api_key_env = "KEY_A"
models = ["m", "m2"]
envoy_cluster = "up"

[llm_clients.j]                  # the judge: the ext_proc server calls it itself, not via Envoy
base_url = "http://127.0.0.1:9"
models = ["judge"]

[canaries.m]
variants = { m2 = 10 }

[routes.auto]
classifier = "llm"
judge = "j"
judge_model = "judge"
choices = { simple = "m", complex = "m2" }
fallback = "m"
"""


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    return info.value.problems


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return str(path)


def test_version_flag_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"switchyard-mw {version('switchyard-mw')}"


def test_version_through_the_installed_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "switchyard_mw.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("switchyard-mw ")


# -- one pass: a section that fails its own checks still gets its cross checks --


def test_a_broken_client_does_not_hide_a_canary_naming_an_unserved_model() -> None:
    text = CONFIG.replace('models = ["m", "m2"]', 'models = ["m", "m2"]\ntimeout_secs = 0')
    text = text.replace("variants = { m2 = 10 }", "variants = { m2 = 10, ghost = 5 }")
    found = problems(text)
    assert "llm_clients.a.timeout_secs: must be > 0" in found
    assert 'canaries.m.variants.ghost: no llm_clients entry serves model "ghost"' in found


def test_a_broken_route_still_has_its_models_checked() -> None:
    text = CONFIG.replace('fallback = "m"', 'fallback = "ghost"\njudge_deadline_ms = 0')
    found = problems(text)
    assert "routes.auto.judge_deadline_ms: must be > 0" in found
    assert 'routes.auto.fallback: no llm_clients entry serves model "ghost"' in found


def test_a_client_whose_models_are_broken_keeps_cross_checks_quiet() -> None:
    # Which models it serves is unknown, so "no client serves m2" would be a guess.
    text = CONFIG.replace('models = ["m", "m2"]', 'models = "m"')
    found = problems(text)
    assert any(p.startswith("llm_clients.a.models:") for p in found), found
    assert not any("no llm_clients entry serves" in p for p in found), found


# -- did you mean --


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (
            'envoy_cluster = "up"\n\n[llm_clients.j]',
            'envoy_cluster = "up"\ntimeout_sec = 5\n\n[llm_clients.j]',
            'llm_clients.a.timeout_sec: unknown key (did you mean "timeout_secs"?)',
        ),
        (
            "[canaries.m]",
            "[canary.x]\n[canaries.m]",
            'canary: unknown key (did you mean "canaries"?)',
        ),
        (
            'fallback = "m"',
            'fallback = "m"\njudge_deadline = 5',
            'routes.auto.judge_deadline: unknown key (did you mean "judge_deadline_ms"?)',
        ),
    ],
)
def test_a_misspelt_key_gets_a_suggestion(old: str, new: str, expected: str) -> None:
    assert expected in problems(CONFIG.replace(old, new, 1))


def test_an_unknown_key_with_no_near_name_gets_no_suggestion() -> None:
    assert "bogus: unknown key" in problems(CONFIG + "\n[bogus]\nx = 1\n")


# -- warnings --


def test_no_warnings_for_a_clean_config() -> None:
    assert config_warnings(parse_config(CONFIG)) == []


@pytest.mark.parametrize("url", ["http://x/v1", "http://x/v1/", "https://api.openai.com/v1"])
def test_a_base_url_ending_in_v1_is_a_warning(url: str) -> None:
    config = parse_config(
        CONFIG.replace('base_url = "http://127.0.0.1:9"', f'base_url = "{url}"', 1)
    )
    (warning,) = config_warnings(config)
    assert warning.startswith("llm_clients.a.base_url: ends in /v1")
    assert "/v1/v1/messages" in warning


def test_an_account_without_envoy_cluster_beside_ones_with_it_is_a_warning() -> None:
    other = '[llm_clients.b]\nbase_url = "http://h"\nmodels = ["m"]\nenvoy_cluster = "up"\n'
    config = parse_config(CONFIG.replace('envoy_cluster = "up"\n', "", 1) + other)
    (warning,) = config_warnings(config)
    assert warning.startswith("llm_clients.a.envoy_cluster: not set")


def test_check_config_prints_warnings_and_still_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEY_A", "k")
    path = write(tmp_path, CONFIG.replace("127.0.0.1:9", "127.0.0.1:9/v1", 1))
    assert main(["check-config", path]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(f"OK {path}")
    assert "warning: llm_clients.a.base_url: ends in /v1" in captured.err


# -- the environment --


def test_check_config_fails_on_an_unset_key_variable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KEY_A", raising=False)
    path = write(tmp_path, CONFIG)
    assert main(["check-config", path]) == 2
    err = capsys.readouterr().err
    assert "llm_clients.a.api_key_env: environment variable KEY_A is not set" in err
    assert "Traceback" not in err


def test_check_config_no_env_skips_the_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KEY_A", raising=False)
    path = write(tmp_path, CONFIG)
    assert main(["check-config", "--no-env", path]) == 0
    assert capsys.readouterr().out.startswith(f"OK {path}")


def test_schema_problems_and_unset_variables_come_in_one_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KEY_A", raising=False)
    path = write(tmp_path, CONFIG.replace('fallback = "m"', 'fallback = "ghost"'))
    assert main(["check-config", path]) == 2
    err = capsys.readouterr().err
    assert f"{path}: 2 problem(s)" in err
    assert "routes.auto.fallback" in err
    assert "environment variable KEY_A is not set" in err


# -- extproc refuses a config Envoy cannot route --


def test_extproc_refuses_a_config_without_any_envoy_cluster(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, CONFIG.replace('envoy_cluster = "up"\n', ""))
    assert main(["extproc", "--config", path, "--listen", "127.0.0.1:0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "no llm_clients entry sets envoy_cluster" in err[0]


# -- the mock provider as a user tool --


@pytest.mark.integration
def test_mock_command_serves_the_mock_provider_and_its_control_api() -> None:
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "switchyard_mw.cli", "mock", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=5) as http:
            for _ in range(100):
                try:
                    if http.get("/_mock/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                subprocess.run(["sleep", "0.05"], check=True)
            else:
                pytest.fail("the mock did not start")
            body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
            ok = http.post("/v1/messages", json=body, headers={"x-api-key": "k1"})
            assert ok.status_code == 200
            assert ok.json()["model"] == "m"
            assert http.put("/_mock/behaviours/k1", json={"status": 401}).status_code < 300
            refused = http.post("/v1/messages", json=body, headers={"x-api-key": "k1"})
            assert refused.status_code == 401
            assert refused.json()["type"] == "error"
            other = http.post("/v1/messages", json=body, headers={"x-api-key": "k2"})
            assert other.status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def test_every_behaviour_the_mock_docs_show_is_accepted() -> None:
    import re

    import httpx

    from switchyard_mw.testing import MockProvider

    doc = (Path(__file__).parents[2] / "docs" / "mock-provider.md").read_text()
    calls = re.findall(r"curl -X PUT \$M/(\S+) -d '(\{.*?\})'", doc)
    assert len(calls) >= 7, calls
    mock = MockProvider()
    transport = httpx.ASGITransport(app=mock)
    async with httpx.AsyncClient(transport=transport, base_url="http://mock") as http:
        for key, body in calls:
            answer = await http.put(f"/_mock/behaviours/{key}", content=body)
            assert answer.status_code == 200, (key, body, answer.text)
    assert set(mock.behaviours) == {key for key, _ in calls}
