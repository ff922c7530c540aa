"""Account kinds in the config: `kind` (api, vertex, bedrock), each cloud's own table, and every
bad combination reported at its key path; an account without `kind` is the api account it was."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from switchyard_mw.cli import main
from switchyard_mw.config import (
    BedrockSettings,
    LLMClient,
    VertexSettings,
    parse_config,
)
from switchyard_mw.errors import ConfigError

THREE = """
[llm_clients.anthropic]
base_url = "https://api.anthropic.com"
api_key_env = "ANTHROPIC_API_KEY"
auth = "x-api-key"
models = ["claude-opus-5"]

[llm_clients.gcp]
kind = "vertex"
vertex = { project = "my-project", region = "us-east5", credentials_file = "/etc/sa.json" }
models = { "claude-opus-5" = "claude-opus-5@20260101" }

[llm_clients.aws]
kind = "bedrock"
bedrock = { region = "us-east-1", profile = "prod" }
models = { "claude-opus-5" = "anthropic.claude-opus-5-v1:0" }
"""


def problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(textwrap.dedent(text))
    return list(info.value.problems)


def test_three_kinds_of_account_serve_one_model() -> None:
    config = parse_config(THREE)
    assert config.clients_serving("claude-opus-5") == ["anthropic", "gcp", "aws"]
    api, gcp, aws = (config.llm_clients[n] for n in ("anthropic", "gcp", "aws"))
    assert (api.kind, api.vertex, api.bedrock) == ("api", None, None)
    assert gcp.kind == "vertex"
    assert gcp.vertex == VertexSettings(
        project="my-project", region="us-east5", credentials_file="/etc/sa.json"
    )
    assert gcp.vertex.token_timeout_secs == 10.0
    assert aws.bedrock == BedrockSettings(region="us-east-1", profile="prod")
    assert gcp.provider_model("claude-opus-5") == "claude-opus-5@20260101"


def test_cloud_settings_default_to_the_clouds_own_lookup() -> None:
    config = parse_config(
        '[llm_clients.a]\nkind = "bedrock"\nbedrock = {}\nmodels = ["m"]\n'
        '[llm_clients.g]\nkind = "vertex"\nvertex = { project = "p", region = "global" }\n'
        'models = ["m"]\n'
    )
    assert config.llm_clients["a"].bedrock == BedrockSettings(region=None, profile=None)
    assert config.llm_clients["g"].vertex is not None
    assert config.llm_clients["g"].vertex.credentials_file is None  # application default


def test_an_account_without_kind_is_the_api_account_it_was() -> None:
    spec = LLMClient(base_url="https://p.example.test", models=["m"])
    assert spec.kind == "api"
    assert problems('[llm_clients.c]\nmodels = ["m"]\n') == ["llm_clients.c.base_url: required"]


def test_a_cloud_kind_needs_its_table_and_takes_no_other() -> None:
    text = """
    [llm_clients.v]
    kind = "vertex"
    models = ["m"]
    [llm_clients.b]
    kind = "bedrock"
    bedrock = { region = "us-east-1" }
    vertex = { project = "p", region = "r" }
    models = ["m"]
    """
    assert problems(text) == [
        'llm_clients.v.vertex: required when kind = "vertex"',
        'llm_clients.b.vertex: only with kind = "vertex"',
    ]


def test_missing_project_or_region_is_named_at_its_key() -> None:
    text = """
    [llm_clients.v]
    kind = "vertex"
    vertex = { region = "us-east5" }
    models = ["m"]
    [llm_clients.w]
    kind = "vertex"
    vertex = { project = "p" }
    models = ["m"]
    """
    assert problems(text) == [
        "llm_clients.v.vertex.project: required",
        "llm_clients.w.vertex.region: required",
    ]


def test_keys_the_cloud_decides_are_refused_on_a_cloud_account() -> None:
    text = """
    [llm_clients.v]
    kind = "vertex"
    vertex = { project = "p", region = "us-east5" }
    models = { "m" = "m@1" }
    path = "/x/{model}"
    api_key_env = "KEY"
    auth = "x-api-key"
    """
    assert problems(text) == [
        'llm_clients.v.path: not used with kind = "vertex" (the cloud decides it)',
        'llm_clients.v.api_key_env: not used with kind = "vertex" (the cloud decides it)',
        'llm_clients.v.auth: not used with kind = "vertex" (the cloud decides it)',
    ]


def test_an_unknown_kind_lists_the_kinds() -> None:
    found = problems('[llm_clients.c]\nkind = "azure"\nbase_url = "https://x"\nmodels = ["m"]\n')
    assert found == ['llm_clients.c.kind: expected one of "api", "vertex", "bedrock"']


def test_a_cloud_account_may_set_base_url_to_reach_a_private_endpoint() -> None:
    text = """
    [llm_clients.v]
    kind = "vertex"
    base_url = "ftp://psc.example.test"
    vertex = { project = "p", region = "us-east5" }
    models = ["m"]
    """
    assert problems(text) == ["llm_clients.v.base_url: must start with http:// or https://"]


def test_a_cloud_account_may_be_routed_by_envoy_but_is_no_judge() -> None:
    text = """
    [llm_clients.v]
    kind = "vertex"
    vertex = { project = "p", region = "us-east5" }
    models = ["m"]
    envoy_cluster = "vertex"
    [routes.auto]
    classifier = "llm"
    judge = "v"
    judge_model = "m"
    choices = { a = "m" }
    fallback = "m"
    """
    assert problems(text) == [
        'routes.auto.judge: llm_clients.v is a kind = "vertex" account; the judge speaks '
        'OpenAI Chat to a kind = "api" account',
    ]


VERTEX_FILE = """
[llm_clients.gcp]
kind = "vertex"
vertex = {{ project = "p", region = "us-east5", credentials_file = "{path}" }}
models = ["m"]
"""


def check(tmp_path: Path, key_file: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code, _, err = check_out(tmp_path, key_file, capsys)
    return code, err


def check_out(
    tmp_path: Path, key_file: Path, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str, str]:
    config = tmp_path / "c.toml"
    config.write_text(VERTEX_FILE.format(path=key_file))
    code = main(["check-config", str(config)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (None, "no such file"),
        ("{not json", "not JSON (a service-account key file is)"),
        ('{"client_email": "x"}', 'no "type" (not a Google credentials file)'),
        ('{"type": "service_account", "client_email": "x"}', "service account without"),
    ],
)
def test_check_config_names_the_account_whose_key_file_is_unusable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, said: str
) -> None:
    key_file = tmp_path / "sa.json"
    if content is not None:
        key_file.write_text(content)
    code, err = check(tmp_path, key_file, capsys)
    assert code == 2
    assert f"llm_clients.gcp.vertex.credentials_file: {key_file}: {said}" in err


def test_check_config_accepts_a_well_formed_key_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key_file = tmp_path / "sa.json"
    fields = {"type": "service_account", "client_email": "a@b", "private_key": "k"}
    key_file.write_text(json.dumps({**fields, "token_uri": "https://oauth2.example.test/token"}))
    code, out, err = check_out(tmp_path, key_file, capsys)
    assert (code, err) == (0, "")
    assert (
        "  gcp: vertex https://us-east5-aiplatform.googleapis.com project=p region=us-east5 "
        f"credentials={key_file} priority=0 timeout=60s idle=60s\n"
    ) in out
    assert "private" not in out
