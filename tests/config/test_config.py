"""Config loading: every rule reports its key path, and `check-config` exits cleanly."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from switchyard_mw.accounts import build_accounts
from switchyard_mw.cli import main
from switchyard_mw.config import Config, load_config, parse_config, read_api_keys
from switchyard_mw.errors import ConfigError, StartupError

VALID = """
[llm_clients.a]
base_url = "http://127.0.0.1:9"
api_key_env = "KEY_A"
auth = "x-api-key"
models = ["m", "m2"]
[llm_clients.j]
base_url = "http://127.0.0.1:9"
models = ["judge"]
[canaries.m]
variants = { m2 = 10 }
[routes.auto]
classifier = "llm"
judge = "j"
judge_model = "judge"
judge_deadline_ms = 800
choices = { simple = "m", complex = "m2" }
fallback = "m"
"""


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(textwrap.dedent(text))
    return list(info.value.problems)


def with_extra(old: str, new: str) -> str:
    assert old in VALID
    return VALID.replace(old, new)


def test_valid_config_loads_with_defaults() -> None:
    config = parse_config(VALID)
    a = config.llm_clients["a"]
    assert (a.timeout_secs, a.stream_idle_secs, a.failure_threshold) == (60.0, 60.0, 3)
    assert (a.cooldown_secs, a.max_cooldown_secs, a.priority) == (30.0, 300.0, 0)
    assert config.server.max_body_bytes == 32 * 1024 * 1024
    assert config.server.expose_headers is True
    assert config.routes["auto"].judge_deadline_ms == 800
    assert config.clients_serving("m2") == ["a"]


def test_config_is_frozen() -> None:
    config = parse_config(VALID)
    with pytest.raises(AttributeError):
        config.llm_clients["a"].timeout_secs = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (
            'auth = "x-api-key"',
            'auth = "x-api-key"\ntimeout_secs = 0',
            "llm_clients.a.timeout_secs: must be > 0",
        ),
        (
            'auth = "x-api-key"',
            'auth = "x-api-key"\nstream_idle_secs = -1',
            "llm_clients.a.stream_idle_secs: must be > 0",
        ),
        (
            'auth = "x-api-key"',
            'auth = "x-api-key"\nfailure_threshold = 0',
            "llm_clients.a.failure_threshold: must be > 0",
        ),
        (
            'auth = "x-api-key"',
            'auth = "x-api-key"\ncooldown_secs = 0',
            "llm_clients.a.cooldown_secs: must be > 0",
        ),
        (
            'auth = "x-api-key"',
            'auth = "x-api-key"\ndefault_max_tokens = 0',
            "llm_clients.a.default_max_tokens: must be > 0",
        ),
        ('auth = "x-api-key"', 'auth = "basic"', "llm_clients.a.auth: expected one of"),
        (
            'auth = "x-api-key"',
            'auth = "x-api-key"\nmax_tokens = 5',
            "llm_clients.a.max_tokens: unknown key",
        ),
        (
            'auth = "x-api-key"',
            'auth = "x-api-key"\ntimeout_secs = "60"',
            "llm_clients.a.timeout_secs: expected `float`, got `str`",
        ),
        (
            'auth = "x-api-key"',
            'auth = "x-api-key"\ncooldown_secs = 60\nmax_cooldown_secs = 30',
            "llm_clients.a.max_cooldown_secs: must be >= cooldown_secs",
        ),
        (
            'base_url = "http://127.0.0.1:9"\napi_key_env',
            'base_url = "ftp://x"\napi_key_env',
            "llm_clients.a.base_url: must start with http:// or https://",
        ),
        (
            'api_key_env = "KEY_A"',
            'api_key_env = "NOT A NAME"',
            "llm_clients.a.api_key_env: not an environment variable name",
        ),
        ('models = ["judge"]', "models = []", "llm_clients.j.models: must list at least one model"),
        (
            "judge_deadline_ms = 800",
            "judge_deadline_ms = 0",
            "routes.auto.judge_deadline_ms: must be > 0",
        ),
        (
            "judge_deadline_ms = 800",
            "judge_deadline_ms = -5",
            "routes.auto.judge_deadline_ms: must be > 0",
        ),
        ('judge = "j"', 'judge = "nobody"', 'routes.auto.judge: no llm_clients entry "nobody"'),
        (
            'judge_model = "judge"',
            'judge_model = "other"',
            'routes.auto.judge_model: llm_clients.j does not serve "other"',
        ),
        (
            'fallback = "m"',
            'fallback = "ghost"',
            'routes.auto.fallback: no llm_clients entry serves model "ghost"',
        ),
        (
            'complex = "m2"',
            'complex = "ghost"',
            'routes.auto.choices.complex: no llm_clients entry serves model "ghost"',
        ),
        ('classifier = "llm"', 'classifier = "regex"', "routes.auto.classifier: expected one of"),
        (
            "variants = { m2 = 10 }",
            "variants = { m2 = 130 }",
            "canaries.m.variants.m2: must be between 0 and 100",
        ),
        (
            "variants = { m2 = 10 }",
            "variants = { m2 = 70, m = 0 }",
            "canaries.m.variants.m: is the base model itself",
        ),
        (
            "variants = { m2 = 10 }",
            "variants = { m2 = 10, ghost = 5 }",
            'canaries.m.variants.ghost: no llm_clients entry serves model "ghost"',
        ),
        (
            "[canaries.m]",
            "[canaries.ghost]",
            'canaries.ghost: no llm_clients entry serves model "ghost"',
        ),
        ("[canaries.m]", "[canaries.m]\nshare = 3", "canaries.m.share: unknown key"),
    ],
)
def test_each_rule_names_its_key_path(old: str, new: str, expected: str) -> None:
    found = problems(with_extra(old, new))
    assert any(p.startswith(expected) for p in found), found


def test_percentages_over_100_are_summed_in_the_message() -> None:
    text = VALID.replace('models = ["m", "m2"]', 'models = ["m", "m2", "m3"]').replace(
        "variants = { m2 = 10 }", "variants = { m2 = 70, m3 = 60 }"
    )
    assert "canaries.m.variants: percentages sum to 130 > 100" in problems(text)


def test_unknown_top_level_key_and_server_keys() -> None:
    found = problems(VALID + "\n[bogus]\nx = 1\n[server]\nmax_body_bytes = 0\nport = 1\n")
    assert "bogus: unknown key" in found
    assert "server.max_body_bytes: must be > 0" in found
    assert "server.port: unknown key" in found


def test_every_problem_is_reported_not_just_the_first() -> None:
    text = with_extra('auth = "x-api-key"', 'auth = "x-api-key"\ntimeout_secs = 0\nfoo = 1')
    text = text.replace("judge_deadline_ms = 800", "judge_deadline_ms = 0")
    found = problems(text)
    assert "llm_clients.a.timeout_secs: must be > 0" in found
    assert "llm_clients.a.foo: unknown key" in found
    assert "routes.auto.judge_deadline_ms: must be > 0" in found


def test_wildcard_client_serves_any_model() -> None:
    config = parse_config(
        '[llm_clients.any]\nbase_url = "http://x"\nmodels = ["*"]\n'
        "[canaries.a]\nvariants = { b = 50 }\n"
    )
    assert config.llm_clients["any"].serves("whatever")


def test_missing_file_and_invalid_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[llm_clients.a\nbase_url=")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)


def test_missing_key_variable_is_a_startup_error_naming_it() -> None:
    config = parse_config(VALID)
    with pytest.raises(
        StartupError, match=r"llm_clients\.a\.api_key_env: environment variable KEY_A is not set"
    ):
        read_api_keys(config, {})
    accounts = build_accounts(config, {"KEY_A": "sk-secret-123"})
    assert accounts["a"].auth_headers() == [("x-api-key", "sk-secret-123")]
    assert accounts["j"].auth_headers() == []
    assert "sk-secret-123" not in repr(accounts["a"])


def test_bearer_auth_header() -> None:
    config = parse_config(VALID.replace('auth = "x-api-key"', 'auth = "bearer"'))
    accounts = build_accounts(config, {"KEY_A": "k"})
    assert accounts["a"].auth_headers() == [("authorization", "Bearer k")]
    assert accounts["a"].url("/v1/messages") == "http://127.0.0.1:9/v1/messages"


def test_check_config_ok_prints_summary_without_key_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEY_A", "sk-very-secret")
    path = tmp_path / "ok.toml"
    path.write_text(VALID)
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"OK {path}")
    assert "a: http://127.0.0.1:9" in out
    assert "key $KEY_A set" in out
    assert "m -> m2 10%" in out
    assert "auto: judge j/judge within 800 ms" in out
    assert "sk-very-secret" not in out


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "no such file"),
        ("[[[", "invalid TOML"),
        (
            VALID.replace("judge_deadline_ms = 800", "judge_deadline_ms = 0"),
            "routes.auto.judge_deadline_ms: must be > 0",
        ),
    ],
)
def test_check_config_errors_exit_2_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, expected: str
) -> None:
    path = tmp_path / "c.toml"
    if content is not None:
        path.write_text(content)
    assert main(["check-config", str(path)]) == 2
    captured = capsys.readouterr()
    assert expected in captured.err
    assert "Traceback" not in captured.err + captured.out


def test_example_config_is_valid() -> None:
    config = load_config(Path(__file__).parents[2] / "examples" / "switchyard.toml")
    assert isinstance(config, Config)
    assert "auto" in config.routes
