"""Provider model names in the config: `models` as a table, the `path` template, and every
bad input reported at its key path (and refused by `check-config`)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from switchyard_mw.accounts import Account, build_accounts
from switchyard_mw.asgi.stack import switchyard_stack
from switchyard_mw.cli import main
from switchyard_mw.config import parse_config
from switchyard_mw.errors import ConfigError

VENDOR = "vendor.claude-opus-5-v1:0"
MAPPED = """
[llm_clients.direct]
base_url = "https://api.example.test"
models = ["claude-opus-5"]
[llm_clients.cloud]
base_url = "https://cloud.example.test"
models = { "claude-opus-5" = "vendor.claude-opus-5-v1:0", "gpt-x" = "gpt-x-2026" }
path = "/openai/deployments/{model}/chat/completions?api-version=2025-04-01"
"""


EMPTY = "llm_clients.c.models.a: the provider's model name must not be empty"


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(textwrap.dedent(text))
    return list(info.value.problems)


def client(models: str, path: str | None = None) -> str:
    extra = "" if path is None else f"path = {path}\n"
    return f'[llm_clients.c]\nbase_url = "https://p.example.test"\nmodels = {models}\n{extra}'


def accounts(text: str = MAPPED) -> dict[str, Account]:
    return build_accounts(parse_config(textwrap.dedent(text)), {})


def test_a_table_maps_public_names_and_the_list_form_keeps_working() -> None:
    config = parse_config(MAPPED)
    assert config.clients_serving("claude-opus-5") == ["direct", "cloud"]
    assert config.clients_serving("gpt-x") == ["cloud"]
    assert config.clients_serving("gpt-x-2026") == []  # the provider's name is not public
    cloud, direct = config.llm_clients["cloud"], config.llm_clients["direct"]
    assert cloud.provider_model("claude-opus-5") == "vendor.claude-opus-5-v1:0"
    assert direct.provider_model("claude-opus-5") == "claude-opus-5"
    assert direct.path is None


def test_a_bound_account_fills_its_path_template_with_the_providers_name() -> None:
    cloud = accounts()["cloud"].for_model("claude-opus-5")
    assert cloud.provider_model == "vendor.claude-opus-5-v1:0"
    assert cloud.url("/v1/chat/completions") == (
        "https://cloud.example.test/openai/deployments/vendor.claude-opus-5-v1:0"
        "/chat/completions?api-version=2025-04-01"
    )
    assert (
        accounts()["cloud"]
        .for_model("gpt-x")
        .url("/v1/chat/completions")
        .startswith("https://cloud.example.test/openai/deployments/gpt-x-2026/")
    )


def test_an_account_that_renames_nothing_is_its_own_binding_and_keeps_the_request_path() -> None:
    direct = accounts()["direct"]
    assert direct.for_model("claude-opus-5") is direct
    assert direct.url("/v1/messages") == "https://api.example.test/v1/messages"


def test_binding_is_kept_per_model_so_ctx_account_is_stable() -> None:
    cloud = accounts()["cloud"]
    assert cloud.for_model("gpt-x") is cloud.for_model("gpt-x")
    assert cloud.for_model("gpt-x") is not cloud.for_model("claude-opus-5")


def test_an_unbound_account_with_a_model_in_its_path_says_how_to_bind_it() -> None:
    with pytest.raises(ValueError, match=r"account 'cloud' puts the model in its path"):
        accounts()["cloud"].url("/v1/chat/completions")


def test_a_provider_name_is_escaped_as_one_path_segment() -> None:
    text = client('["*"]', '"/deployments/{model}/chat/completions"')
    wild = accounts(text)["c"].for_model("a/b?c")
    assert wild.url("/v1/chat/completions") == (
        "https://p.example.test/deployments/a%2Fb%3Fc/chat/completions"
    )


def test_a_template_without_model_is_a_fixed_path_for_a_list_account() -> None:
    text = client('["m"]', '"/api/v2/chat"')
    assert accounts(text)["c"].url("/v1/chat/completions") == "https://p.example.test/api/v2/chat"


@pytest.mark.parametrize(
    ("models", "path", "expected"),
    [
        (
            '{ a = "p", b = "p" }',
            None,
            'llm_clients.c.models.b: "p" is also the provider name of "a" '
            "(two public names on one provider name)",
        ),
        ('{ a = "" }', None, EMPTY),
        ('{ a = "  " }', None, EMPTY),
        (
            '{ "*" = "p" }',
            None,
            'llm_clients.c.models."*": "*" serves any model in the list form only, not a table',
        ),
        (
            '{ a = "p" }',
            '"/openai/deployments/x/chat/completions"',
            "llm_clients.c.path: must contain {model} where models maps names to the provider's",
        ),
        (
            '["m"]',
            '"https://host.test/openai/deployments/{model}"',
            'llm_clients.c.path: must be a path starting with "/" (base_url gives the scheme '
            "and host)",
        ),
        (
            '["m"]',
            '"openai/deployments/{model}"',
            'llm_clients.c.path: must be a path starting with "/" (base_url gives the scheme '
            "and host)",
        ),
        (
            '["m"]',
            '"//host.test/{model}"',
            'llm_clients.c.path: must be a path starting with "/" (base_url gives the scheme '
            "and host)",
        ),
        (
            '["m"]',
            '"/deployments/{model}/chat completions"',
            "llm_clients.c.path: must not contain spaces, control characters or a #fragment",
        ),
        (
            '["m"]',
            '"/deployments/{deployment}/chat"',
            "llm_clients.c.path: {model} is the only placeholder, found {deployment}",
        ),
        ('["m"]', '"/deployments/{model/chat"', "llm_clients.c.path: unbalanced { or }"),
        ("{ a = 1 }", None, "llm_clients.c.models[...]: expected `str`, got `int`"),
    ],
)
def test_bad_model_names_and_paths_are_reported_at_their_key_path(
    models: str, path: str | None, expected: str
) -> None:
    assert expected in problems(client(models, path)), problems(client(models, path))


def test_check_config_names_the_key_path_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(client('{ a = "p", b = "p" }', '"/x/chat"'))
    assert main(["check-config", str(config)]) != 0
    out = capsys.readouterr()
    text = out.out + out.err
    assert 'llm_clients.c.models.b: "p" is also the provider name of "a"' in text
    assert "llm_clients.c.path: must contain {model}" in text


def test_the_readme_and_the_example_config_show_a_provider_with_its_own_names() -> None:
    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    block = readme.split("```toml\n", 1)[1].split("```", 1)[0]
    # The commented-out account is shown as a user would write it: it must be valid too.
    shown = parse_config("\n".join(line.removeprefix("# ") for line in block.splitlines()))
    example = parse_config((root / "examples" / "switchyard.toml").read_text())
    assert example.llm_clients["mock-cloud"] == shown.llm_clients["mock-cloud"]
    assert shown.llm_clients["azure"].path is not None
    assert example.llm_clients["mock-cloud"].provider_model("claude-opus-5") == VENDOR
    assert example.fallbacks == shown.fallbacks  # the two-provider setup's fallback chain
    assert shown.fallbacks["claude-opus-5"].models == ["claude-haiku-5"]


def test_check_config_shows_each_accounts_names_and_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "good.toml"
    config.write_text(textwrap.dedent(MAPPED))
    assert main(["check-config", str(config)]) == 0
    out = capsys.readouterr().out
    assert f"models: claude-opus-5 (as {VENDOR}), gpt-x (as gpt-x-2026)" in out
    assert "path: /openai/deployments/{model}/chat/completions?api-version=2025-04-01" in out


COLLIDING = client('{ a = "p", b = "p" }', '"/d/{model}/chat"')


def test_a_stack_refuses_to_start_with_a_bad_mapping(tmp_path: Path) -> None:
    path = tmp_path / "switchyard.toml"
    path.write_text(COLLIDING)
    with pytest.raises(ConfigError, match=r'llm_clients\.c\.models\.b: "p" is also'):
        switchyard_stack(lambda *a: None, config=path, environ={}, reload_on_signal=False)


async def test_a_reload_with_a_bad_path_template_is_refused_and_the_old_config_stays(
    tmp_path: Path,
) -> None:
    path = tmp_path / "switchyard.toml"
    path.write_text(client('{ a = "p" }', '"/d/{model}/chat"'))
    stack = switchyard_stack(lambda *a: None, config=path, environ={}, reload_on_signal=False)
    before = stack.config
    path.write_text(client('{ a = "p" }', '"https://elsewhere.test/{model}"'))
    assert stack.reload() == [
        'llm_clients.c.path: must be a path starting with "/" (base_url gives the scheme and host)'
    ]
    assert stack.config is before
    await stack.aclose()
