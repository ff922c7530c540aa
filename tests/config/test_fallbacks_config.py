"""`[fallbacks]` in the config: both forms, and every bad input reported at its key path and
refused by `check-config`, at start and at reload."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from switchyard_mw.asgi.stack import switchyard_stack
from switchyard_mw.cli import main
from switchyard_mw.config import FALLBACK_REASONS, Fallback, parse_config
from switchyard_mw.errors import ConfigError

ACCOUNTS = """
[llm_clients.a]
base_url = "https://a.example.test"
models = ["gpt-x", "gpt-x-mini", "claude-opus-5", "claude-sonnet-5"]
"""
GOOD = (
    ACCOUNTS
    + """
[fallbacks]
"gpt-x" = ["gpt-x-mini"]                                   # tried in order
"claude-opus-5" = { models = ["claude-sonnet-5"], on = ["unavailable", "context_length"] }
"""
)


def chains(text: str) -> str:
    return ACCOUNTS + "[fallbacks]\n" + textwrap.dedent(text)


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    return list(info.value.problems)


def test_both_forms_as_the_design_shows_them() -> None:
    config = parse_config(GOOD)
    assert config.fallbacks == {
        "gpt-x": Fallback(models=["gpt-x-mini"], on=FALLBACK_REASONS),
        "claude-opus-5": Fallback(models=["claude-sonnet-5"], on=("unavailable", "context_length")),
    }


def test_the_list_form_means_both_reasons_and_the_table_may_name_one() -> None:
    config = parse_config(chains('"gpt-x" = { models = ["gpt-x-mini"], on = ["unavailable"] }'))
    assert config.fallbacks["gpt-x"].on == ("unavailable",)
    assert parse_config(chains('"gpt-x" = ["gpt-x-mini"]')).fallbacks["gpt-x"].on == (
        "unavailable",
        "context_length",
    )


def test_a_config_without_fallbacks_has_none() -> None:
    assert parse_config(ACCOUNTS).fallbacks == {}


@pytest.mark.parametrize(
    ("entries", "expected"),
    [
        ('"gpt-x" = ["gpt-y"]', 'fallbacks.gpt-x: no llm_clients entry serves model "gpt-y"'),
        (
            '"gpt-y" = ["gpt-x"]',
            'fallbacks.gpt-y: no llm_clients entry serves model "gpt-y" (the chain would never '
            "apply)",
        ),
        (
            '"gpt-x" = { models = ["gpt-x-mini"], on = ["unavailable", "overloaded"] }',
            'fallbacks.gpt-x.on: unknown reason "overloaded" (expected "unavailable", '
            '"context_length" or "budget")',
        ),
        ('"gpt-x" = { models = ["gpt-x-mini"], on = [] }', "fallbacks.gpt-x.on: must name at"),
        ('"gpt-x" = []', "fallbacks.gpt-x: must name at least one model"),
        ('"gpt-x" = ["gpt-x"]', 'fallbacks.gpt-x: a cycle through the chains: "gpt-x" -> "gpt-x"'),
        (
            '"gpt-x" = ["gpt-x-mini"]\n"gpt-x-mini" = ["claude-opus-5"]\n'
            '"claude-opus-5" = { models = ["gpt-x"], on = ["context_length"] }',
            'fallbacks.gpt-x: a cycle through the chains: "gpt-x" -> "gpt-x-mini" -> '
            '"claude-opus-5" -> "gpt-x"',
        ),
        (
            '"gpt-x" = ["gpt-x-mini", "gpt-x-mini"]',
            'fallbacks.gpt-x: "gpt-x-mini" is named more than once',
        ),
        ('"gpt-x" = [1]', "fallbacks.gpt-x: expected a list of model names"),
        ('"gpt-x" = "gpt-x-mini"', "fallbacks.gpt-x: expected a table, got str"),
        ('"gpt-x" = { model = ["gpt-x-mini"] }', "fallbacks.gpt-x.model: unknown key (did you"),
        ('"gpt-x" = { on = ["unavailable"] }', "fallbacks.gpt-x.models: required"),
    ],
)
def test_each_bad_chain_names_its_key_path(entries: str, expected: str) -> None:
    found = problems(chains(entries))
    assert any(p.startswith(expected) for p in found), found


def test_fallbacks_must_be_a_table_and_a_typo_is_named() -> None:
    assert problems('fallbacks = ["gpt-x"]\n' + ACCOUNTS) == ["fallbacks: expected a table"]
    assert problems(ACCOUNTS + "[fallback]\n") == [
        'fallback: unknown key (did you mean "fallbacks"?)'
    ]


def test_a_cycle_is_reported_once() -> None:
    found = problems(chains('"gpt-x" = ["gpt-x-mini"]\n"gpt-x-mini" = ["gpt-x"]'))
    assert [p for p in found if "cycle" in p] == [
        'fallbacks.gpt-x: a cycle through the chains: "gpt-x" -> "gpt-x-mini" -> "gpt-x"'
    ]


def test_a_wildcard_account_serves_any_chain() -> None:
    wildcard = '[llm_clients.any]\nbase_url = "https://p.example.test"\nmodels = ["*"]\n'
    config = parse_config(wildcard + '[fallbacks]\n"x" = ["y"]\n')
    assert config.fallbacks["x"].models == ["y"]


def test_check_config_refuses_a_bad_chain_and_summarises_a_good_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.toml"
    path.write_text(chains('"gpt-x" = ["gpt-x"]'))
    assert main(["check-config", str(path)]) == 2
    assert "fallbacks.gpt-x: a cycle through the chains" in capsys.readouterr().err
    path.write_text(GOOD)
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "gpt-x -> gpt-x-mini on unavailable, context_length" in out


def test_a_stack_refuses_to_start_with_a_bad_chain(tmp_path: Path) -> None:
    path = tmp_path / "switchyard.toml"
    path.write_text(chains('"gpt-x" = ["nope"]'))
    with pytest.raises(ConfigError, match=r"fallbacks\.gpt-x: no llm_clients entry serves"):
        switchyard_stack(lambda *a: None, config=path, environ={}, reload_on_signal=False)


async def test_a_reload_with_a_bad_chain_is_refused_and_the_old_config_stays(
    tmp_path: Path,
) -> None:
    path = tmp_path / "switchyard.toml"
    path.write_text(GOOD)
    stack = switchyard_stack(lambda *a: None, config=path, environ={}, reload_on_signal=False)
    before = stack.config
    path.write_text(chains('"gpt-x" = { models = ["gpt-x-mini"], on = ["sometimes"] }'))
    assert stack.reload() == [
        'fallbacks.gpt-x.on: unknown reason "sometimes" (expected "unavailable", '
        '"context_length" or "budget")'
    ]
    assert stack.config is before
    assert stack.engine.chains is not None
    await stack.aclose()
