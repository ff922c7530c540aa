"""`hedge_after_secs` (per account: seconds or "auto") and `hedge_max_ratio` ([server])."""

from __future__ import annotations

import pytest

from switchyard_mw.config import ConfigError, parse_config

ACCOUNT = """
[llm_clients.a]
base_url = "https://api.anthropic.com"
models = ["m"]
{line}
"""


def test_off_by_default_and_a_5_percent_budget() -> None:
    config = parse_config(ACCOUNT.format(line=""))
    assert config.llm_clients["a"].hedge_after_secs is None
    assert config.server.hedge_max_ratio == 0.05


@pytest.mark.parametrize(("line", "expected"), [("2.5", 2.5), ("3600", 3600), ('"auto"', "auto")])
def test_seconds_or_auto(line: str, expected: object) -> None:
    config = parse_config(ACCOUNT.format(line=f"hedge_after_secs = {line}"))
    assert config.llm_clients["a"].hedge_after_secs == expected


@pytest.mark.parametrize(("ratio", "expected"), [("0", 0.0), ("1", 1.0), ("0.25", 0.25)])
def test_the_ratio_s_bounds_are_allowed(ratio: str, expected: float) -> None:
    config = parse_config(ACCOUNT.format(line="") + f"[server]\nhedge_max_ratio = {ratio}\n")
    assert config.server.hedge_max_ratio == expected


BAD = {
    "hedge_after_secs = 0": "llm_clients.a.hedge_after_secs: must be > 0",
    "hedge_after_secs = 3601": "llm_clients.a.hedge_after_secs: must be <= 3600",
    'hedge_after_secs = "soon"': (
        'llm_clients.a.hedge_after_secs: expected a number of seconds (> 0, <= 3600) or "auto", '
        "got 'soon'"
    ),
    "hedge_after_secs = true": (
        'llm_clients.a.hedge_after_secs: expected a number of seconds (> 0, <= 3600) or "auto", '
        "got True"
    ),
    "[server]\nhedge_max_ratio = 1.5": "server.hedge_max_ratio: must be <= 1",
    "[server]\nhedge_max_ratio = -0.1": "server.hedge_max_ratio: must be >= 0",
}


@pytest.mark.parametrize("line", list(BAD))
def test_a_bad_value_says_what_is_expected(line: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config(ACCOUNT.format(line=line))
    assert refused.value.problems == (BAD[line],)
