"""`[tenants.NAME]`, `[[limits]]`, `[prices."MODEL"]`, `[server] tenant_header` and `[state]
replicas_hint` in the config: the design's shapes load, and every bad input is a problem at its
key path."""

from __future__ import annotations

import hashlib

import pytest

from switchyard_mw.config import config_warnings, parse_config
from switchyard_mw.config_tenants import tenant_keys
from switchyard_mw.errors import ConfigError, StartupError

ACCOUNTS = """
[llm_clients.a]
base_url = "https://a.example.test"
models = ["claude-opus-5", "claude-haiku-5", "gpt-5"]
"""


def sha(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


DESIGN = (
    ACCOUNTS
    + f"""
[tenants.team-a]
keys = ["{sha("sk-team-a")}"]
models = ["claude-*", "gpt-5*"]
limits = [
  {{ tokens = 2_000_000, per = "day" }},
  {{ tokens = 200_000, per = "minute", model = "claude-opus-5" }},
  {{ requests = 600, per = "minute" }},
  {{ usd = 50.0, per = "month" }},
]
[server]
tenant_header = "x-switchyard-tenant"
[prices."claude-opus-5"]
input = 15.0
output = 75.0
cache_read = 1.5
cache_write = 18.75
[prices."claude-haiku-5"]
input = 1.0
output = 5.0
[prices."gpt-5"]
input = 1.25
output = 10.0
[[limits]]
model = "claude-opus-5"
tokens = 5_000_000
per = "minute"
[state]
replicas_hint = 3
"""
)


def test_the_design_s_example_loads() -> None:
    config = parse_config(DESIGN)
    team = config.tenants["team-a"]
    assert team.keys == [sha("sk-team-a")]
    assert team.models == ["claude-*", "gpt-5*"]
    assert [(lim.measure(), lim.amount(), lim.per, lim.model) for lim in team.limits] == [
        ("tokens", 2_000_000, "day", None),
        ("tokens", 200_000, "minute", "claude-opus-5"),
        ("requests", 600, "minute", None),
        ("usd", 50.0, "month", None),
    ]
    assert config.server.tenant_header == "x-switchyard-tenant"
    assert config.prices["claude-opus-5"].cache_write == 18.75
    assert config.prices["claude-haiku-5"].cache_read is None
    assert [(lim.model, lim.tokens, lim.per) for lim in config.limits] == [
        ("claude-opus-5", 5_000_000, "minute")
    ]
    assert config.state.replicas_hint == 3


def test_a_tenant_may_use_every_model_by_default() -> None:
    config = parse_config(ACCOUNTS + '[tenants.t]\nkeys_env = "T_KEYS"\n')
    assert config.tenants["t"].models == ["*"]
    assert config.tenants["t"].limits == []


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ('[tenants.t]\nkeys = ["sha256:abc"]', "tenants.t.keys[0]: a sha256: entry takes 64"),
        ('[tenants.t]\nkeys = [""]', "tenants.t.keys[0]: an empty key"),
        ('[tenants.t]\nkeys_env = "1BAD"', "tenants.t.keys_env: '1BAD' is not an environment"),
        ("[tenants.t]\nmodels = []", "tenants.t.models: must name at least one pattern"),
        (
            '[tenants.t]\nlimits = [{ per = "day" }]',
            "tenants.t.limits[0]: give exactly one of tokens, requests, usd",
        ),
        (
            '[tenants.t]\nlimits = [{ tokens = 5, requests = 5, per = "day" }]',
            "tenants.t.limits[0]: give exactly one of tokens, requests, usd",
        ),
        ('[tenants.t]\nlimits = [{ tokens = 5, per = "week" }]', "tenants.t.limits"),
        ('[tenants.t]\nlimits = [{ tokens = 0, per = "day" }]', "must be > 0"),
        ("[tenants.t]\nlimits = [{ tokens = 5 }]", "per: required"),
        (
            '[tenants.t]\nlimits = [{ tokens = 5, per = "day", model = "nope" }]',
            'tenants.t.limits[0].model: no llm_clients entry serves model "nope"',
        ),
        (
            '[tenants.t]\nlimits = [{ usd = 5.0, per = "day" }]',
            'tenants.t.limits[0].usd: no [prices] for "claude-haiku-5", "claude-opus-5", "gpt-5"',
        ),
        (
            '[tenants.t]\nmodels = ["claude-*"]\nlimits = [{ usd = 5.0, per = "day" }]\n'
            '[prices."claude-opus-5"]\ninput = 1.0\noutput = 2.0',
            'tenants.t.limits[0].usd: no [prices] for "claude-haiku-5"',
        ),
        ("[tenants.t]\nkey = []", 'tenants.t.key: unknown key (did you mean "keys"?)'),
        ('[[limits]]\nrequests = 5\nper = "hour"\nmodel = "x"', "limits[0].model: no llm_clients"),
        ('[prices."gpt-5"]\ninput = -1.0\noutput = 1.0', "prices.gpt-5.input: must be >= 0"),
        ('[prices."gpt-5"]\ninput = 1.0', "prices.gpt-5.output: required"),
        ('[server]\ntenant_header = "X Tenant"', "server.tenant_header: 'X Tenant' is not"),
        ("[state]\nreplicas_hint = 0", "state.replicas_hint: must be > 0"),
    ],
)
def test_each_bad_input_names_its_key_path(extra: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(ACCOUNTS + extra)
    assert any(expected in problem for problem in info.value.problems), info.value.problems


def test_limits_must_be_an_array_of_tables() -> None:
    with pytest.raises(ConfigError, match="limits: expected an array of tables"):
        parse_config("limits = 5\n" + ACCOUNTS)


def test_one_key_in_two_tenants_is_refused() -> None:
    text = ACCOUNTS + f'[tenants.a]\nkeys = ["{sha("x")}"]\n[tenants.b]\nkeys = ["{sha("x")}"]\n'
    with pytest.raises(ConfigError, match=r"tenants\.b\.keys\[0\]: the same key is tenant a's too"):
        parse_config(text)


def test_warnings_for_a_tenant_nothing_can_name_and_a_pattern_that_matches_nothing() -> None:
    config = parse_config(ACCOUNTS + '[tenants.t]\nmodels = ["mistral-*"]\n')
    warnings = config_warnings(config)
    assert any("tenants.t: no keys and no [server] tenant_header" in w for w in warnings)
    assert any('tenants.t.models[0]: "mistral-*" matches no model served' in w for w in warnings)


def test_keys_from_the_environment_are_hashed_and_never_shown() -> None:
    config = parse_config(ACCOUNTS + f'[tenants.t]\nkeys = ["{sha("a")}"]\nkeys_env = "T_KEYS"\n')
    found = tenant_keys(config.tenants, {"T_KEYS": f"b, {sha('c')} ,"})
    assert found == {"t": [sha("a"), sha("b"), sha("c")]}
    with pytest.raises(StartupError, match=r"tenants\.t\.keys_env: environment variable T_KEYS"):
        tenant_keys(config.tenants, {})
    with pytest.raises(StartupError) as info:
        tenant_keys(config.tenants, {"T_KEYS": "sha256:secretbutshort"})
    assert "entry 1 of T_KEYS" in str(info.value)
    assert "secretbutshort" not in str(info.value)
