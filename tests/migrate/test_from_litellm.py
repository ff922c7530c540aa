"""`switchyard-mw from-litellm`: LiteLLM proxy configs, in the shapes LiteLLM's own docs show,
translated and loaded by the real config loader (and `check-config`, as a user runs it)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from io import StringIO
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from switchyard_mw.cli import main
from switchyard_mw.config import Config, Fallback, parse_config
from switchyard_mw.errors import ConfigError
from switchyard_mw.migrate import Translation, translate_litellm


def translate(yaml_text: str, environ: dict[str, str] | None = None) -> Translation:
    return translate_litellm(textwrap.dedent(yaml_text), environ=environ or {})


def loaded(yaml_text: str, environ: dict[str, str] | None = None) -> tuple[Config, list[str]]:
    """The translation through the real loader, and what it could not translate."""
    translation = translate(yaml_text, environ)
    return parse_config(translation.toml), list(translation.untranslated)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "switchyard_mw.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# -- several deployments of one model: load balanced -------------------------------------

LOAD_BALANCED = """
model_list:
  - model_name: gpt-4o
    litellm_params:
      model: azure/gpt-4o-eu
      api_base: https://my-endpoint-europe-berri-992.openai.azure.com/
      api_key: "os.environ/AZURE_API_KEY_EU"
      api_version: "2024-06-01"
      rpm: 6
  - model_name: gpt-4o
    litellm_params:
      model: azure/gpt-4o-ca
      api_base: https://my-endpoint-canada-berri992.openai.azure.com/
      api_key: "os.environ/AZURE_API_KEY_CA"
      api_version: "2024-06-01"
      rpm: 18
"""


def test_deployments_of_one_model_become_accounts_sharing_it_by_their_rpm() -> None:
    config, _ = loaded(LOAD_BALANCED)
    eu = config.llm_clients["azure-my-endpoint-europe-berri-992"]
    ca = config.llm_clients["azure-my-endpoint-canada-berri992"]
    assert config.clients_serving("gpt-4o") == [
        "azure-my-endpoint-europe-berri-992",
        "azure-my-endpoint-canada-berri992",
    ]
    assert (eu.weight, ca.weight) == (6.0, 18.0)
    assert (eu.priority, ca.priority) == (0, 0)  # one priority: they share the traffic
    assert eu.provider_model("gpt-4o") == "gpt-4o-eu"
    assert ca.provider_model("gpt-4o") == "gpt-4o-ca"
    assert (eu.api_key_env, ca.api_key_env) == ("AZURE_API_KEY_EU", "AZURE_API_KEY_CA")


def test_deployments_without_weights_keep_the_default_share() -> None:
    config, _ = loaded(
        """
        model_list:
          - model_name: zephyr-beta
            litellm_params: {model: hosted_vllm/HuggingFaceH4/zephyr-7b-beta, api_base: http://0.0.0.0:8001/v1}
          - model_name: zephyr-beta
            litellm_params: {model: hosted_vllm/HuggingFaceH4/zephyr-7b-beta, api_base: http://0.0.0.0:8002/v1}
        """
    )
    clients = config.llm_clients
    assert [c.base_url for c in clients.values()] == ["http://0.0.0.0:8001", "http://0.0.0.0:8002"]
    assert {c.weight for c in clients.values()} == {1.0}
    assert {c.provider_model("zephyr-beta") for c in clients.values()} == {
        "HuggingFaceH4/zephyr-7b-beta"
    }
    assert {c.api_key_env for c in clients.values()} == {None}


def test_weights_over_the_configs_bound_are_scaled_keeping_their_ratio() -> None:
    config, _ = loaded(
        """
        model_list:
          - model_name: m
            litellm_params: {model: openai/m, api_base: https://a.example/v1, tpm: 2000000}
          - model_name: m
            litellm_params: {model: openai/m, api_base: https://b.example/v1, tpm: 4000000}
        """
    )
    weights = [c.weight for c in config.llm_clients.values()]
    assert weights == [500000.0, 1000000.0]


def test_deployments_on_one_key_join_into_one_account_serving_each_model() -> None:
    config, _ = loaded(
        """
        model_list:
          - model_name: gpt-4o
            litellm_params: {model: openai/gpt-4o, api_key: os.environ/OPENAI_API_KEY}
          - model_name: gpt-4o-mini
            litellm_params: {model: gpt-4o-mini}
          - model_name: claude-opus
            litellm_params: {model: claude-3-opus-20240229, api_key: os.environ/ANTHROPIC_API_KEY}
        """
    )
    assert list(config.llm_clients) == ["openai", "anthropic"]
    openai, anthropic = config.llm_clients["openai"], config.llm_clients["anthropic"]
    assert openai.models == ["gpt-4o", "gpt-4o-mini"]
    assert (openai.base_url, openai.api_key_env, openai.auth) == (
        "https://api.openai.com",
        "OPENAI_API_KEY",
        "bearer",
    )
    assert anthropic.models == {"claude-opus": "claude-3-opus-20240229"}
    assert (anthropic.base_url, anthropic.auth) == ("https://api.anthropic.com", "x-api-key")


def test_a_wildcard_deployment_serves_any_model() -> None:
    config, notes = loaded(
        """
        model_list:
          - model_name: "*"
            litellm_params: {model: openai/*, api_key: os.environ/OPENAI_API_KEY}
          - model_name: "claude-*"
            litellm_params: {model: anthropic/claude-*}
        """
    )
    assert config.llm_clients["openai"].models == ["*"]
    assert len(config.llm_clients) == 1
    assert any("model_list[1]" in n and "wildcard" in n for n in notes)


# -- fallbacks ------------------------------------------------------------------------------

TWO_MODELS = """
model_list:
  - model_name: gpt-3.5-turbo
    litellm_params:
      model: azure/chatgpt-v-2
      api_base: https://r.openai.azure.com/
      api_version: "2024-06-01"
      azure_ad_token: os.environ/AZURE_AD_TOKEN
  - model_name: gpt-4
    litellm_params:
      model: azure/gpt-4-ca
      api_base: https://r.openai.azure.com/
      api_version: "2024-06-01"
      azure_ad_token: os.environ/AZURE_AD_TOKEN
  - model_name: gpt-4-32k
    litellm_params: {model: openai/gpt-4-32k}
"""


def test_router_fallbacks_become_a_chain_on_unavailability() -> None:
    config, _ = loaded(
        TWO_MODELS + 'router_settings:\n  fallbacks: [{"gpt-3.5-turbo": ["gpt-4"]}]\n'
    )
    assert config.fallbacks == {"gpt-3.5-turbo": Fallback(models=["gpt-4"], on=("unavailable",))}


def test_context_window_fallbacks_become_a_chain_on_context_length() -> None:
    config, _ = loaded(
        TWO_MODELS
        + "litellm_settings:\n"
        + '  context_window_fallbacks: [{"gpt-3.5-turbo": ["gpt-4", "gpt-4-32k"]}]\n'
    )
    assert config.fallbacks == {
        "gpt-3.5-turbo": Fallback(models=["gpt-4", "gpt-4-32k"], on=("context_length",))
    }


def test_the_same_chain_for_both_is_one_chain_for_both_reasons() -> None:
    config, notes = loaded(
        TWO_MODELS
        + "litellm_settings:\n"
        + '  fallbacks: [{"gpt-4": ["gpt-4-32k"]}]\n'
        + '  context_window_fallbacks: [{"gpt-4": ["gpt-4-32k"]}]\n'
    )
    assert config.fallbacks == {
        "gpt-4": Fallback(models=["gpt-4-32k"], on=("unavailable", "context_length"))
    }
    assert not [n for n in notes if "fallbacks" in n]


def test_different_chains_for_one_model_keep_the_fallbacks_and_list_the_other() -> None:
    config, notes = loaded(
        TWO_MODELS
        + "litellm_settings:\n"
        + '  fallbacks: [{"gpt-4": ["gpt-3.5-turbo"]}]\n'
        + '  context_window_fallbacks: [{"gpt-4": ["gpt-4-32k"]}]\n'
    )
    assert config.fallbacks == {"gpt-4": Fallback(models=["gpt-3.5-turbo"], on=("unavailable",))}
    assert (
        "litellm_settings.context_window_fallbacks (gpt-4): switchyard keeps one chain per "
        "model: gpt-4's chain is its fallbacks, for unavailability only"
    ) in notes


def test_chains_both_ways_lose_the_link_closing_the_cycle() -> None:
    config, notes = loaded(
        TWO_MODELS + '  \nlitellm_settings:\n  fallbacks: [{"gpt-4": ["gpt-3.5-turbo"]}, '
        '{"gpt-3.5-turbo": ["gpt-4", "gpt-4-32k"]}]\n'
    )
    assert config.fallbacks == {
        "gpt-4": Fallback(models=["gpt-3.5-turbo"], on=("unavailable",)),
        "gpt-3.5-turbo": Fallback(models=["gpt-4-32k"], on=("unavailable",)),
    }
    assert (
        "fallbacks (gpt-3.5-turbo -> gpt-4): closes a cycle through the chains, which "
        "switchyard refuses"
    ) in notes


def test_a_chain_through_a_model_not_translated_skips_that_model() -> None:
    config, notes = loaded(
        TWO_MODELS
        + "  - model_name: local\n    litellm_params: {model: ollama/llama3}\n"
        + "litellm_settings:\n"
        + '  fallbacks: [{"gpt-4": ["local", "gpt-4-32k"]}, {"local": ["gpt-4"]}]\n'
    )
    assert config.fallbacks == {"gpt-4": Fallback(models=["gpt-4-32k"], on=("unavailable",))}
    assert "fallbacks (gpt-4 -> local): no deployment of local was translated" in notes
    assert "fallbacks (local): no deployment of local was translated: its chain is dropped" in notes


def test_a_chain_to_another_wire_is_kept_and_said() -> None:
    config, notes = loaded(
        """
        model_list:
          - model_name: gpt-4o
            litellm_params: {model: openai/gpt-4o}
          - model_name: claude
            litellm_params: {model: anthropic/claude-sonnet-4-20250514}
          - model_name: claude
            litellm_params: {model: bedrock/anthropic.claude-sonnet-4-20250514-v1:0}
          - model_name: gpt-4o-mini
            litellm_params: {model: openai/gpt-4o-mini}
        litellm_settings:
          fallbacks: [{"gpt-4o": ["claude", "gpt-4o-mini"]}]
        """
    )
    assert config.fallbacks == {
        "gpt-4o": Fallback(models=["claude", "gpt-4o-mini"], on=("unavailable",))
    }
    assert [n for n in notes if n.startswith("fallbacks")] == [
        "fallbacks (gpt-4o -> claude): claude's accounts take Anthropic Messages requests "
        "only: a request for gpt-4o in the OpenAI format that falls back reaches them in it"
    ]


def test_default_fallbacks_become_the_chain_of_every_model_without_one() -> None:
    config, _ = loaded(
        TWO_MODELS
        + "litellm_settings:\n"
        + '  fallbacks: [{"gpt-4": ["gpt-3.5-turbo"]}]\n'
        + '  default_fallbacks: ["gpt-4-32k"]\n'
    )
    assert config.fallbacks == {
        "gpt-4": Fallback(models=["gpt-3.5-turbo"], on=("unavailable",)),
        "gpt-3.5-turbo": Fallback(models=["gpt-4-32k"], on=("unavailable",)),
    }


def test_content_policy_fallbacks_are_listed_as_not_translated() -> None:
    config, notes = loaded(
        TWO_MODELS + 'router_settings:\n  content_policy_fallbacks: [{"gpt-4": ["gpt-4-32k"]}]\n'
    )
    assert config.fallbacks == {}
    assert any(n.startswith("router_settings.content_policy_fallbacks (gpt-4)") for n in notes)


# -- providers ------------------------------------------------------------------------------


def test_an_azure_deployment_puts_its_name_and_api_version_in_the_path() -> None:
    config, notes = loaded(
        """
        model_list:
          - model_name: gpt-4-team1
            litellm_params:
              model: azure/chatgpt-v-2
              api_base: https://openai-gpt-4-test-v-1.openai.azure.com/
              api_version: "2023-05-15"
              api_key: os.environ/AZURE_NORTH_AMERICA_API_KEY
        """
    )
    (azure,) = config.llm_clients.values()
    assert azure.base_url == "https://openai-gpt-4-test-v-1.openai.azure.com"
    assert azure.path == "/openai/deployments/{model}/chat/completions?api-version=2023-05-15"
    assert azure.models == {"gpt-4-team1": "chatgpt-v-2"}
    assert azure.api_key_env == "AZURE_NORTH_AMERICA_API_KEY"
    # Azure's API keys go in an `api-key` header: the account's auth scheme says so.
    assert azure.auth == "api-key"
    assert not any("api-key" in n for n in notes)


def test_azure_endpoint_and_version_from_the_environment_litellm_reads() -> None:
    yaml_text = """
        model_list:
          - model_name: gpt-4o
            litellm_params:
              model: azure/prod-4o
              api_base: os.environ/AZURE_API_BASE
              azure_ad_token: os.environ/AZURE_AD_TOKEN
        """
    environ = {"AZURE_API_BASE": "https://res.openai.azure.com/openai/", "AZURE_API_VERSION": "v9"}
    config, notes = loaded(yaml_text, environ)
    (azure,) = config.llm_clients.values()
    assert azure.base_url == "https://res.openai.azure.com"
    assert azure.path == "/openai/deployments/{model}/chat/completions?api-version=v9"
    assert azure.api_key_env == "AZURE_AD_TOKEN"  # an Entra ID token is a bearer token
    assert azure.auth == "bearer"
    assert not any("api-key" in n for n in notes)

    with pytest.raises(ConfigError) as info:
        translate(yaml_text, {})
    assert (
        "config.yaml: model_list[0] (gpt-4o: azure/prod-4o) api_base: os.environ/AZURE_API_BASE: "
        "AZURE_API_BASE is not set here; set it and convert again"
    ) in info.value.problems


def test_a_bedrock_deployment_is_a_bedrock_account_in_its_region() -> None:
    config, notes = loaded(
        """
        model_list:
          - model_name: claude-sonnet
            litellm_params:
              model: bedrock/us.anthropic.claude-3-5-sonnet-20241022-v2:0
              aws_region_name: us-west-2
              aws_profile_name: prod
              aws_access_key_id: os.environ/AWS_ACCESS_KEY_ID
              aws_secret_access_key: os.environ/AWS_SECRET_ACCESS_KEY
          - model_name: claude-sonnet
            litellm_params:
              model: bedrock/converse/anthropic.claude-3-5-sonnet-20241022-v2:0
              aws_region_name: os.environ/AWS_REGION_NAME
              aws_access_key_id: os.environ/TEAM_B_AWS_KEY
          - model_name: bedrock-cohere
            litellm_params: {model: bedrock/cohere.command-text-v14, aws_region_name: us-west-2}
        """,
        {"AWS_REGION_NAME": "eu-west-1"},
    )
    west, eu = config.llm_clients["bedrock-us-west-2"], config.llm_clients["bedrock-eu-west-1"]
    assert west.kind == eu.kind == "bedrock"
    assert west.bedrock is not None
    assert eu.bedrock is not None
    assert (west.bedrock.region, west.bedrock.profile) == ("us-west-2", "prod")
    assert (eu.bedrock.region, eu.bedrock.profile) == ("eu-west-1", None)
    assert west.provider_model("claude-sonnet") == "us.anthropic.claude-3-5-sonnet-20241022-v2:0"
    assert eu.provider_model("claude-sonnet") == "anthropic.claude-3-5-sonnet-20241022-v2:0"
    assert "bedrock-cohere" not in {m for c in config.llm_clients.values() for m in c.models}
    assert any("aws_access_key_id" in n and "AWS_ACCESS_KEY_ID" in n for n in notes)
    assert any("bedrock-cohere" in n and "Claude models only" in n for n in notes)
    assert not any("model_list[0]" in n and "aws_" in n for n in notes)


def test_a_vertex_deployment_is_a_vertex_account_of_its_project_and_location() -> None:
    config, notes = loaded(
        """
        model_list:
          - model_name: claude-opus
            litellm_params:
              model: vertex_ai/claude-3-opus@20240229
              vertex_project: adroit-crow-1234
              vertex_location: us-east5
              vertex_credentials: /etc/keys/vertex.json
          - model_name: claude-haiku
            litellm_params:
              model: vertex_ai/claude-3-haiku@20240307
              vertex_credentials: os.environ/VERTEX_JSON
          - model_name: gemini-pro
            litellm_params:
              model: vertex_ai/gemini-1.5-pro
              vertex_project: p
              vertex_location: us-east1
        """,
        {
            "VERTEXAI_PROJECT": "from-env",
            "VERTEXAI_LOCATION": "europe-west1",
            "VERTEX_JSON": '{"type": "service_account"}',
        },
    )
    east, europe = config.llm_clients["vertex-us-east5"], config.llm_clients["vertex-europe-west1"]
    assert east.vertex is not None
    assert europe.vertex is not None
    assert (east.vertex.project, east.vertex.region) == ("adroit-crow-1234", "us-east5")
    assert east.vertex.credentials_file == "/etc/keys/vertex.json"
    assert (europe.vertex.project, europe.vertex.credentials_file) == ("from-env", None)
    assert east.models == {"claude-opus": "claude-3-opus@20240229"}
    assert any("gemini-pro" in n and "Claude models only" in n for n in notes)
    assert any("vertex_credentials" in n and "write it to a file" in n for n in notes)


def test_a_key_written_in_the_file_is_never_copied_out() -> None:
    translation = translate(
        """
        model_list:
          - model_name: gpt-4-team2
            litellm_params:
              model: azure/gpt-4
              api_key: sk-123-very-secret
              api_base: https://t.openai.azure.com/
              api_version: "1"
          - model_name: local
            litellm_params:
              model: openai/facebook/opt-125m
              api_base: http://0.0.0.0:4000/v1
              api_key: none
        """
    )
    everything = translation.toml + "\n".join(translation.untranslated)
    assert "sk-123-very-secret" not in everything
    config = parse_config(translation.toml)
    assert [c.api_key_env for c in config.llm_clients.values()] == [
        "AZURE_API_KEY_0",
        "OPENAI_API_KEY_1",
    ]
    assert any("export it as AZURE_API_KEY_0" in n for n in translation.untranslated)


def test_an_api_base_without_v1_is_kept_and_said() -> None:
    config, notes = loaded(
        """
        model_list:
          - model_name: tgi
            litellm_params: {model: openai/tgi, api_base: "http://10.0.0.7:8080"}
        """
    )
    assert config.llm_clients["openai-10-0-0-7-8080"].base_url == "http://10.0.0.7:8080"
    assert any("does not end in /v1" in n for n in notes)


# -- timeouts, cooling, retries ----------------------------------------------------------------

RELIABILITY = """
model_list:
  - model_name: zephyr-beta
    litellm_params: {model: hosted_vllm/zephyr, api_base: http://0.0.0.0:8001/v1}
  - model_name: gpt-3.5-turbo
    litellm_params: {model: gpt-3.5-turbo, timeout: 300, stream_timeout: 45, order: 2}
litellm_settings:
  num_retries: 3
  request_timeout: 10
  fallbacks: [{"zephyr-beta": ["gpt-3.5-turbo"]}]
  allowed_fails: 3
  cooldown_time: 30
"""


def test_timeouts_cooling_and_retries_map_to_the_nearest_account_settings() -> None:
    config, _ = loaded(RELIABILITY)
    zephyr, gpt = config.llm_clients.values()
    assert zephyr.timeout_secs == 10  # request_timeout
    assert (gpt.timeout_secs, gpt.first_token_secs, gpt.stream_idle_secs) == (300, 45, 45)
    for account in (zephyr, gpt):
        assert account.failure_threshold == 4  # cooled on the 4th failure, as LiteLLM does
        assert account.cooldown_secs == account.max_cooldown_secs == 30  # a fixed period
        assert account.retry_wait_max_secs == 60
    assert (zephyr.priority, gpt.priority) == (0, 2)


def test_the_routers_timeout_wins_over_litellm_settings_and_no_retries_stay_off() -> None:
    config, _ = loaded(
        RELIABILITY.replace("num_retries: 3", "num_retries: 0")
        + "router_settings:\n  timeout: 30\n  stream_timeout: 20\n"
    )
    zephyr, gpt = config.llm_clients.values()
    assert (zephyr.timeout_secs, zephyr.stream_idle_secs, zephyr.first_token_secs) == (30, 20, 20)
    assert (gpt.timeout_secs, gpt.stream_idle_secs) == (300, 45)
    assert zephyr.retry_wait_max_secs == 0


def test_redis_router_state_becomes_shared_state() -> None:
    config, notes = loaded(
        RELIABILITY
        + "router_settings:\n  redis_host: os.environ/REDIS_HOST\n  redis_port: 6380\n"
        + "  redis_password: os.environ/REDIS_PASSWORD\n",
        {"REDIS_HOST": "redis.internal", "REDIS_PASSWORD": "hunter2"},
    )
    assert (config.state.backend, config.state.url) == ("redis", "redis://redis.internal:6380")
    assert not any("hunter2" in n for n in notes)
    assert any(n.startswith("router_settings.redis_password:") for n in notes)


def test_what_has_no_switchyard_form_is_listed_with_where_it_was() -> None:
    config, notes = loaded(
        RELIABILITY.replace(
            "litellm_settings:",
            "  - model_name: codebert\n"
            "    litellm_params: {model: huggingface/microsoft/codebert-base}\n"
            "litellm_settings:",
        )
        + "router_settings:\n  routing_strategy: latency-based-routing\n"
        + '  model_group_alias: {"gpt-4": "gpt-3.5-turbo"}\n'
        + "general_settings:\n  master_key: sk-1234\n"
    )
    assert "codebert" not in {m for c in config.llm_clients.values() for m in c.models}
    assert list(config.llm_clients) == ["hosted_vllm-0-0-0-0-8001", "openai"]
    assert [n.split(":")[0] for n in notes] == [
        "router_settings.model_group_alias",
        "general_settings.master_key",
        "router_settings.routing_strategy",
        "model_list[2] (codebert",
    ]
    assert "sk-1234" not in "".join(notes)


def test_names_that_toml_must_quote_survive_the_round_trip() -> None:
    config, notes = loaded(
        """
        model_list:
          - model_name: "claude 3.5 \\"sonnet\\"\\nx = 1"
            litellm_params: {model: anthropic/claude-3-5-sonnet-20240620}
        litellm_settings:
          weird_key\\n[server]: 1
        """
    )
    (account,) = config.llm_clients.values()
    assert account.models == {'claude 3.5 "sonnet"\nx = 1': "claude-3-5-sonnet-20240620"}
    assert config.server.expose_headers is True
    assert notes


# -- the command ---------------------------------------------------------------------------


SHAPES = {
    "load_balanced": LOAD_BALANCED,
    "fallbacks": TWO_MODELS
    + "litellm_settings:\n"
    + '  fallbacks: [{"gpt-3.5-turbo": ["gpt-4"]}]\n'
    + '  context_window_fallbacks: [{"gpt-4": ["gpt-4-32k"]}]\n',
    "reliability": RELIABILITY,
    "clouds": """
model_list:
  - model_name: claude
    litellm_params: {model: anthropic/claude-3-5-sonnet-20240620}
  - model_name: claude
    litellm_params:
      model: bedrock/anthropic.claude-3-5-sonnet-20240620-v1:0
      aws_region_name: us-east-1
  - model_name: claude
    litellm_params:
      model: vertex_ai/claude-3-5-sonnet@20240620
      vertex_project: p
      vertex_location: us-east5
router_settings:
  num_retries: 2
""",
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_command_prints_toml_that_check_config_accepts(tmp_path: Path, shape: str) -> None:
    source = tmp_path / "config.yaml"
    source.write_text(SHAPES[shape])
    done = run_cli("from-litellm", str(source))
    assert done.returncode == 0, done.stderr
    tomllib.loads(done.stdout)
    lines = done.stderr.splitlines()
    assert all(line.startswith("not translated: ") for line in lines)
    assert [line.removeprefix("not translated: ") for line in lines] == list(
        translate_litellm(SHAPES[shape], source=str(source)).untranslated
    )
    target = tmp_path / "switchyard.toml"
    target.write_text(done.stdout)
    checked = run_cli("check-config", "--no-env", str(target))
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.startswith(f"OK {target}")


def test_with_its_keys_set_the_translation_passes_the_whole_check(tmp_path: Path) -> None:
    """Without `--no-env`, check-config also wants each key variable set: the ones named."""
    target = tmp_path / "switchyard.toml"
    target.write_text(translate(LOAD_BALANCED).toml)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AZURE_")}
    env.update(AZURE_API_KEY_EU="k1", AZURE_API_KEY_CA="k2")
    command = [sys.executable, "-m", "switchyard_mw.cli", "check-config", str(target)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env, check=False)
    assert done.returncode == 0, done.stderr
    del env["AZURE_API_KEY_CA"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env, check=False)
    assert done.returncode == 2
    assert "environment variable AZURE_API_KEY_CA is not set" in done.stderr


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("model_list: [\n  - oops", "invalid YAML: "),
        ("router_settings:\n  num_retries: 2\n", "model_list: required (a list of deployments)"),
        ("- just\n- a list\n", "expected a LiteLLM config (a mapping with model_list)"),
        (
            "model_list:\n  - model_name: m\n    litellm_params: {model: ollama/llama3}\n",
            "model_list: no deployment could be translated",
        ),
    ],
)
def test_a_file_that_is_not_a_litellm_config_is_exit_2_naming_why(
    tmp_path: Path, text: str, problem: str
) -> None:
    source = tmp_path / "config.yaml"
    source.write_text(text)
    done = run_cli("from-litellm", str(source))
    assert done.returncode == 2
    assert done.stdout == ""
    first, *rest = done.stderr.splitlines()
    assert first.startswith(f"{source}: ")
    assert first.endswith(" problem(s)")
    assert any(line.startswith(f"  {source}: {problem}") for line in rest), done.stderr


def test_a_missing_file_is_exit_2() -> None:
    err = StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "stderr", err)
        assert main(["from-litellm", "/nonexistent/config.yaml"]) == 2
    assert "/nonexistent/config.yaml: no such file" in err.getvalue()


def test_without_pyyaml_the_command_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "yaml", None)
    out, err = StringIO(), StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    path = Path(__file__).with_name("test_from_litellm.py")  # any file: YAML is never read
    assert main(["from-litellm", str(path)]) == 1
    assert "'migrate' extra" in err.getvalue()
    assert out.getvalue() == ""


@pytest.mark.parametrize(
    ("yaml_text", "noted"),
    [
        (
            "model_list: [{model_name: m, litellm_params: {model: openai/m}}]\n"
            "router_settings: {redis_url: 'memcached://x'}\n",
            "router_settings.redis_url: not a redis://, rediss:// or unix:// URL",
        ),
        (
            "model_list: [{model_name: m, litellm_params: {model: openai/m}}]\n"
            "router_settings: {redis_host: r, redis_port: http}\n",
            "router_settings.redis_host: r:http is not a Redis host and port",
        ),
        (
            "model_list:\n"
            "  - {model_name: m, litellm_params: {model: openai/m}}\n"
            "  - {model_name: n, litellm_params: {model: openai/n, api_base: 'ftp://x/v1'}}\n",
            "model_list[1] (n: openai/n) api_base: 'ftp://x/v1' is not an http:// or https:// URL",
        ),
        (
            "model_list:\n"
            "  - {model_name: m, litellm_params: {model: openai/m}}\n"
            "  - {model_name: n, litellm_params: {model: 'openai/'}}\n",
            "model_list[1] (n: openai/): the provider's model name is empty or not printable",
        ),
    ],
)
def test_values_switchyard_would_refuse_are_listed_not_written(yaml_text: str, noted: str) -> None:
    config, notes = loaded(yaml_text)
    assert noted in notes
    assert list(config.llm_clients) == ["openai"]
    assert config.state.backend == "memory"


def test_control_characters_in_names_stay_inside_their_strings_and_comments() -> None:
    translation = translate(
        "model_list:\n"
        '  - {model_name: "a\\x1b[2Jb\\x7f", litellm_params: {model: openai/p, top_k: 1}}\n'
        '  - {model_name: "c\\x1b", litellm_params: {model: "openai/q\\x1b"}}\n'
    )
    config = parse_config(translation.toml)
    assert config.llm_clients["openai"].models == {"a\x1b[2Jb\x7f": "p"}
    assert "\x1b" not in translation.toml
    assert translation.untranslated == (
        "model_list[0] (a\\x1b[2Jb\\x7f: openai/p) litellm_params.top_k: no switchyard counterpart",
        "model_list[1] (c\\x1b: openai/q\\x1b): "
        "the provider's model name is empty or not printable",
    )


# -- anything YAML can hold: a translation that loads, or a ConfigError, never a traceback --

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 10**7),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["gpt-4o", "claude-x", "*", "os.environ/UNSET", "os.environ/SET", ""]),
    st.text(max_size=12),
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
_models = st.sampled_from(
    [
        "openai/gpt-4o",
        "gpt-4o-mini",
        "azure/dep",
        "bedrock/anthropic.claude-v2",
        "bedrock/cohere.x",
        "vertex_ai/claude-3@1",
        "anthropic/*",
        "hosted_vllm/x",
        "ollama/llama3",
    ]
)
_param_keys = st.sampled_from(
    [
        "api_key",
        "api_base",
        "api_version",
        "timeout",
        "stream_timeout",
        "rpm",
        "tpm",
        "weight",
        "order",
        "num_retries",
        "aws_region_name",
        "vertex_project",
        "vertex_location",
        "vertex_credentials",
        "azure_ad_token",
        "temperature",
    ]
)
_deployment = st.fixed_dictionaries(
    {
        "model_name": st.sampled_from(["a", "b", "*", "c d"]) | _values,
        "litellm_params": st.fixed_dictionaries({"model": _models}).flatmap(
            lambda base: st.dictionaries(_param_keys, _values, max_size=4).map(
                lambda extra: {**extra, **base}
            )
        )
        | _values,
    }
)
_setting_keys = st.sampled_from(
    [
        "fallbacks",
        "context_window_fallbacks",
        "content_policy_fallbacks",
        "default_fallbacks",
        "timeout",
        "request_timeout",
        "stream_timeout",
        "num_retries",
        "cooldown_time",
        "allowed_fails",
        "routing_strategy",
        "redis_host",
        "redis_url",
        "redis_port",
        "other",
    ]
)
_fallbacks = st.lists(
    st.dictionaries(
        st.sampled_from(["a", "b", "c d", "x"]),
        st.lists(st.sampled_from(["a", "b", "c d", "x"]), max_size=3),
        max_size=2,
    ),
    max_size=3,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    deployments=st.lists(_deployment, min_size=1, max_size=4),
    litellm_settings=st.dictionaries(_setting_keys, _values | _fallbacks, max_size=4),
    router_settings=st.dictionaries(_setting_keys, _values | _fallbacks, max_size=4),
)
def test_any_config_translates_to_a_loadable_config_or_names_its_problem(
    deployments: list[object],
    litellm_settings: dict[str, object],
    router_settings: dict[str, object],
) -> None:
    text = yaml.safe_dump(
        {
            "model_list": deployments,
            "litellm_settings": litellm_settings,
            "router_settings": router_settings,
        }
    )
    translation: Translation | None = None
    problems: list[str] = []
    try:
        translation = translate_litellm(text, environ={"SET": "https://set.example/v1"})
    except ConfigError as exc:
        problems = exc.problems
    if translation is None:  # the input's problem, never an invalid translation
        assert problems
        assert not any("not a valid switchyard config" in p for p in problems), problems
    else:
        parse_config(translation.toml)
    event("translated" if translation is not None else "refused")
