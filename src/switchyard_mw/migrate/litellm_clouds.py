"""LiteLLM's cloud deployments as switchyard accounts: Azure OpenAI (an `api` account with
the deployment in its `path`), Claude on Bedrock and on Vertex AI (`kind = "bedrock"`,
`"vertex"`). A cloud's other models have no switchyard account kind and are listed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .litellm_site import ENV_PREFIX, Found, Site, host_label, key_env
from .toml_text import Value

_STANDARD_AWS_VARS = {
    "aws_access_key_id": "AWS_ACCESS_KEY_ID",
    "aws_secret_access_key": "AWS_SECRET_ACCESS_KEY",
    "aws_session_token": "AWS_SESSION_TOKEN",
}


def azure(params: Mapping[str, Any], site: Site) -> Found | None:
    """An Azure OpenAI deployment: the resource's endpoint, the deployment in the path."""
    api_base = site.url(params, "api_base", f"{ENV_PREFIX}AZURE_API_BASE")
    if api_base is None:
        return None
    version = site.value(params, "api_version", f"{ENV_PREFIX}AZURE_API_VERSION")
    path = "/openai/deployments/{model}/chat/completions"
    settings: dict[str, Value] = {
        "base_url": api_base.rstrip("/").removesuffix("/openai"),
        "path": f"{path}?api-version={version}" if version else path,
    }
    comments = ["Azure OpenAI: the deployment is in the path; Chat Completions requests only"]
    token = params.get("azure_ad_token")
    if isinstance(token, str) and token.startswith(ENV_PREFIX):
        settings["api_key_env"] = token.removeprefix(ENV_PREFIX)
        comments.append("a Microsoft Entra ID token, sent as Authorization: Bearer")
        return settings, f"azure-{host_label(api_base)}", comments
    variable = key_env(params.get("api_key"), "AZURE_API_KEY", "azure", site)
    settings["api_key_env"] = variable or "AZURE_API_KEY"
    settings["auth"] = "api-key"  # Azure's API keys go in an api-key header
    return settings, f"azure-{host_label(api_base)}", comments


def bedrock(name: str, params: Mapping[str, Any], site: Site) -> Found | None:
    """Claude on Bedrock: a `bedrock` account, signed with the standard AWS credential chain."""
    if "anthropic." not in name:
        site.note("switchyard's Bedrock accounts serve Anthropic's Claude models only")
        return None
    table: dict[str, Value] = {}
    for key, setting in (("aws_region_name", "region"), ("aws_profile_name", "profile")):
        found = site.value(params, key)
        if found is not None:
            table[setting] = found
    for key, var in _STANDARD_AWS_VARS.items():
        raw = params.get(key)
        if raw is not None and raw != f"{ENV_PREFIX}{var}":
            site.note(
                f"switchyard signs with the standard AWS credential chain: put this in {var} "
                "(or a profile of the shared AWS files, bedrock.profile)",
                key,
            )
    settings: dict[str, Value] = {"kind": "bedrock", "bedrock": table}
    endpoint_key = (
        "aws_bedrock_runtime_endpoint" if "aws_bedrock_runtime_endpoint" in params else "api_base"
    )
    endpoint = site.url(params, endpoint_key)
    if endpoint is not None:
        settings["base_url"] = endpoint.rstrip("/")
    _messages_only("Bedrock", site)
    region = table.get("region")
    hint = f"bedrock-{region}" if isinstance(region, str) else "bedrock"
    return settings, hint, ["Claude on Amazon Bedrock: Anthropic Messages requests only"]


def vertex(name: str, params: Mapping[str, Any], site: Site) -> Found | None:
    """Claude on Vertex AI: a `vertex` account (project, region, a key file or ADC)."""
    if not name.startswith("claude"):
        site.note("switchyard's Vertex AI accounts serve Anthropic's Claude models only")
        return None
    table: dict[str, Value] = {}
    for key, setting, env in (
        ("vertex_project", "project", "VERTEXAI_PROJECT"),
        ("vertex_location", "region", "VERTEXAI_LOCATION"),
    ):
        found = site.value(params, key, f"{ENV_PREFIX}{env}")
        if found is None:
            return None
        table[setting] = found
    credentials = _vertex_credentials(params, site)
    if credentials is not None:
        table["credentials_file"] = credentials
    _messages_only("Vertex AI", site)
    return (
        {"kind": "vertex", "vertex": table},
        f"vertex-{table['region']}",
        ["Claude on Google Vertex AI: Anthropic Messages requests only"],
    )


def _vertex_credentials(params: Mapping[str, Any], site: Site) -> str | None:
    """A key file's path; the key's JSON itself (LiteLLM takes either) is never written out."""
    found = site.value(params, "vertex_credentials")
    if found is None or not found.lstrip().startswith("{"):
        return found
    site.note(
        "the key's JSON itself: switchyard reads a key file (vertex.credentials_file) or "
        "application-default credentials (GOOGLE_APPLICATION_CREDENTIALS); write it to a file "
        "and set credentials_file",
        "vertex_credentials",
    )
    return None


def _messages_only(cloud: str, site: Site) -> None:
    site.note(
        f"{cloud} accounts take Anthropic Messages requests (/v1/messages) only: clients that "
        "call this model through /chat/completions get 404 there"
    )
