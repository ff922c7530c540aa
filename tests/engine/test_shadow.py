"""Shadow config: validated with key paths; ASGI only (the ext_proc server says it ignores it)."""

from __future__ import annotations

import logging

import pytest

from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.errors import ConfigError
from switchyard_mw.extproc import Policies

BASE = """
[llm_clients.a]
base_url = "http://a"
models = ["m", "s"]
envoy_cluster = "c"
[canaries.m]
variants = {}
"""


@pytest.mark.parametrize(
    ("shadow", "expected"),
    [
        ("{ s = 120.0 }", "canaries.m.shadow.s: must be between 0 and 100"),
        ("{ ghost = 5.0 }", 'canaries.m.shadow.ghost: no llm_clients entry serves model "ghost"'),
        ("{ m = 5.0 }", "canaries.m.shadow.m: is the base model itself"),
    ],
)
def test_shadow_rules_name_their_key_path(shadow: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(BASE + f"shadow = {shadow}\n")
    assert expected in info.value.problems


def test_a_canary_needs_a_variant_or_a_shadow() -> None:
    with pytest.raises(ConfigError, match="must name at least one variant"):
        parse_config(BASE)
    assert parse_config(BASE + "shadow = { s = 5.0 }\n").canaries["m"].shadow == {"s": 5.0}


def test_the_extproc_server_says_once_that_it_ignores_shadow(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = parse_config(BASE + "shadow = { s = 5.0 }\n")
    with caplog.at_level(logging.WARNING):
        Policies(config, build_accounts(config, {}))
    ignored = [r for r in caplog.records if "ignores `shadow`" in r.getMessage()]
    assert len(ignored) == 1
