"""One LiteLLM deployment (an entry of `model_list`) as the switchyard account that serves it.

A deployment is `model_name` (the public name clients send) and `litellm_params` (where and
how it is called: `model: provider/name`, `api_base`, `api_key`, ...). What switchyard calls an
account is the endpoint and its credential; the deployment's `model_name` becomes a public
name in the account's `models` and the provider's part of `model` the name the provider gets.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .toml_text import Value

ENV_PREFIX = "os.environ/"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class Notes:
    """What could not be translated, as `where: why` lines, in the order found."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, where: str, why: str) -> None:
        line = f"{where}: {why}"
        if line not in self.lines:
            self.lines.append(line)


@dataclass(frozen=True)
class ApiProvider:
    """A provider reached as an `api` account: its endpoint, key variable and header."""

    base_url: str | None
    key_env: str | None
    auth: str = "bearer"


# The providers whose endpoint serves the OpenAI (or, for Anthropic, the Messages) wire under
# `/v1/...`, with the variable LiteLLM reads their key from when `api_key` is not set.
API_PROVIDERS: dict[str, ApiProvider] = {
    "openai": ApiProvider("https://api.openai.com", "OPENAI_API_KEY"),
    "anthropic": ApiProvider("https://api.anthropic.com", "ANTHROPIC_API_KEY", "x-api-key"),
    "groq": ApiProvider("https://api.groq.com/openai", "GROQ_API_KEY"),
    "mistral": ApiProvider("https://api.mistral.ai", "MISTRAL_API_KEY"),
    "deepseek": ApiProvider("https://api.deepseek.com", "DEEPSEEK_API_KEY"),
    "xai": ApiProvider("https://api.x.ai", "XAI_API_KEY"),
    "openrouter": ApiProvider("https://openrouter.ai/api", "OPENROUTER_API_KEY"),
    "hosted_vllm": ApiProvider(None, None),
}
CLOUD_PROVIDERS = ("azure", "bedrock", "vertex_ai")

# Bare model names LiteLLM knows the provider of (`gpt-4o` is OpenAI's, `claude-...` Anthropic's).
_BARE = (
    (("gpt-", "o1", "o3", "o4-", "chatgpt-", "text-embedding-"), "openai"),
    (("claude-",), "anthropic"),
)

# litellm_params read here; any other key is listed as not translated.
HANDLED = frozenset(
    {
        "model",
        "custom_llm_provider",
        "api_key",
        "api_base",
        "api_version",
        "azure_ad_token",
        "aws_region_name",
        "aws_profile_name",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "aws_bedrock_runtime_endpoint",
        "vertex_project",
        "vertex_location",
        "vertex_credentials",
        "timeout",
        "stream_timeout",
        "num_retries",
        "order",
        "rpm",
        "tpm",
        "weight",
    }
)
_REQUEST_PARAMS = frozenset(
    {
        "temperature",
        "max_tokens",
        "max_completion_tokens",
        "top_p",
        "seed",
        "stop",
        "frequency_penalty",
        "presence_penalty",
        "response_format",
        "reasoning_effort",
        "thinking",
        "extra_body",
    }
)
_WHY = {
    "extra_headers": "switchyard sends no per-account headers",
    "organization": "switchyard sends no OpenAI-Organization header",
    "input_cost_per_token": "prices are not part of the config",
    "output_cost_per_token": "prices are not part of the config",
    "max_parallel_requests": "switchyard does not bound a deployment's concurrency",
    "region_name": "LiteLLM's pre-call region filter has no switchyard counterpart",
    "aws_role_name": "switchyard signs with the standard AWS credential chain: a profile "
    "with role_arn (bedrock.profile) assumes a role",
    "aws_web_identity_token": "switchyard signs with the standard AWS credential chain, "
    "which reads AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN",
}
_STANDARD_AWS_VARS = {
    "aws_access_key_id": "AWS_ACCESS_KEY_ID",
    "aws_secret_access_key": "AWS_SECRET_ACCESS_KEY",
    "aws_session_token": "AWS_SESSION_TOKEN",
}


@dataclass
class Draft:
    """A deployment as an account would serve it, before deployments sharing an endpoint
    and a key are joined into one account."""

    index: int
    public: str
    """The name clients send (`model_name`)."""
    provider_model: str
    """The name the provider gets (`model` without its provider prefix)."""
    provider: str
    name_hint: str
    """The account's name when nothing else shares it (`azure-my-resource`)."""
    settings: dict[str, Value]
    """The account's keys but `models`, in the order they are written."""
    balance: dict[str, float] = field(default_factory=dict)
    """`weight`, `rpm`, `tpm` as set: the group's load-balancing weights."""
    comments: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Lookup:
    """The environment `os.environ/VAR` values are read from, when the value is not a secret
    (an endpoint, a region): LiteLLM reads them at start-up, switchyard wants them written."""

    environ: Mapping[str, str]

    def value(self, raw: Any, where: str, notes: Notes) -> str | None:
        """`raw` itself, or the variable it names; None (noted) when unset."""
        if raw is None:
            return None
        text = str(raw)
        if not text.startswith(ENV_PREFIX):
            return text
        var = text.removeprefix(ENV_PREFIX)
        found = self.environ.get(var)
        if not found:
            notes.add(where, f"{text}: {var} is not set here; set it and convert again")
            return None
        return found


@dataclass(frozen=True)
class Site:
    """Where in config.yaml a deployment is, and what its translation reads and reports to."""

    index: int
    where: str
    lookup: Lookup
    notes: Notes

    def value(self, params: Mapping[str, Any], key: str, default: str | None = None) -> str | None:
        """`params[key]` (or `default`), a variable it names resolved; None (noted) unset."""
        return self.lookup.value(params.get(key, default), f"{self.where} {key}", self.notes)

    def note(self, why: str, key: str = "") -> None:
        self.notes.add(f"{self.where} {key}".rstrip(), why)


def origin(index: int, public: str, model: str) -> str:
    return f"model_list[{index}] ({public}: {model})"


def draft(
    index: int, entry: Any, lookup: Lookup, notes: Notes, defaults: Mapping[str, Value]
) -> Draft | None:
    """The deployment's draft account, or None (noted) when it has no switchyard form.

    `defaults`: account keys the router-wide settings give every account (timeouts,
    cooling, retries), which the deployment's own `timeout`, `stream_timeout` and
    `num_retries` replace.
    """
    where = f"model_list[{index}]"
    if not isinstance(entry, Mapping):
        notes.add(where, "expected a mapping with model_name and litellm_params")
        return None
    public, params = entry.get("model_name"), entry.get("litellm_params")
    if not isinstance(public, str) or not public:
        notes.add(f"{where}.model_name", "required (the name clients send)")
        return None
    if not isinstance(params, Mapping) or not isinstance(params.get("model"), str):
        notes.add(f"{where} ({public})", "litellm_params.model: required")
        return None
    site = Site(index, origin(index, public, params["model"]), lookup, notes)
    provider, provider_model = provider_of(params)
    if provider is None:
        site.note("no provider switchyard knows (docs/migrating-from-litellm.md lists them)")
        return None
    if not _names_ok(public, provider_model, site):
        return None
    found = _settings(provider, provider_model, params, site)
    if found is None:
        return None
    settings, hint, comments = found
    settings.update(defaults)
    settings.update(_own_settings(params, site))
    for key in params:
        if key not in HANDLED:
            site.note(_why_not(key), f"litellm_params.{key}")
    balance = {k: float(params[k]) for k in ("weight", "rpm", "tpm") if _number(params.get(k))}
    return Draft(index, public, provider_model, provider, hint, settings, balance, comments)


def provider_of(params: Mapping[str, Any]) -> tuple[str | None, str]:
    """(provider, the provider's model name) from `model` (and `custom_llm_provider`)."""
    model: str = params["model"]
    custom = params.get("custom_llm_provider")
    if isinstance(custom, str) and custom:
        return (custom if _known(custom) else None), model.removeprefix(f"{custom}/")
    prefix, sep, rest = model.partition("/")
    if sep and _known(prefix):
        # LiteLLM's `bedrock/converse/...` and `bedrock/invoke/...` name its own route, not
        # the model: switchyard sends Bedrock's invoke API the Messages body either way.
        route = ("converse/", "invoke/") if prefix == "bedrock" else ()
        return prefix, next((rest.removeprefix(r) for r in route if rest.startswith(r)), rest)
    for starts, provider in _BARE:
        if model.startswith(starts):
            return provider, model
    return None, model


def _known(provider: str) -> bool:
    return provider in API_PROVIDERS or provider in CLOUD_PROVIDERS


def _names_ok(public: str, provider_model: str, site: Site) -> bool:
    """A wildcard is `"*"` served as `"*"` (any model, each under its own name), nothing else."""
    if public == "*" and provider_model == "*":
        return True
    if "*" in public or "*" in provider_model:
        site.note(
            'a wildcard deployment: a switchyard account serves named models, or any model as "*" '
            '(model_name: "*" with model: provider/*)'
        )
        return False
    return True


Found = tuple[dict[str, Value], str, list[str]]
"""An account's keys, its name when alone, and the comments written under its header."""


def _settings(provider: str, name: str, params: Mapping[str, Any], site: Site) -> Found | None:
    if provider == "azure":
        return _azure(params, site)
    if provider == "bedrock":
        return _bedrock(name, params, site)
    if provider == "vertex_ai":
        return _vertex(name, params, site)
    return _api(provider, params, site)


def _api(provider: str, params: Mapping[str, Any], site: Site) -> Found | None:
    spec = API_PROVIDERS[provider]
    base, hint = spec.base_url, provider
    if params.get("api_base") is not None:
        api_base = site.value(params, "api_base")
        if api_base is None:
            return None
        base = _api_base(api_base, provider, site)
        hint = f"{provider}-{_host_label(api_base)}" if base != spec.base_url else provider
    if base is None:
        site.note(f"api_base: required for {provider}")
        return None
    settings: dict[str, Value] = {"base_url": base}
    key_env = _key_env(params.get("api_key"), spec.key_env, provider, site)
    if key_env is not None:
        settings["api_key_env"] = key_env
    if spec.auth != "bearer":
        settings["auth"] = spec.auth
    return settings, hint, []


def _api_base(api_base: str, provider: str, site: Site) -> str:
    """switchyard appends the request's path (`/v1/chat/completions`) to `base_url`, where
    LiteLLM appends `/chat/completions` to `api_base`: the `/v1` moves from one to the other."""
    base = api_base.rstrip("/")
    suffixes = ("/v1/messages", "/v1") if provider == "anthropic" else ("/v1",)
    for suffix in suffixes:
        if base.endswith(suffix):
            return base.removesuffix(suffix)
    site.note(
        f"api_base {api_base} does not end in /v1, and switchyard calls base_url with the "
        f"request's path ({base}/v1/chat/completions): check that the server serves it there"
    )
    return base


def _key_env(raw: Any, default: str | None, provider: str, site: Site) -> str | None:
    """The variable holding the key: named by `os.environ/VAR`, LiteLLM's default for the
    provider, or (for a key written in the file) a new one to export it as."""
    if raw is None:
        return default
    text = str(raw)
    if text.startswith(ENV_PREFIX):
        var = text.removeprefix(ENV_PREFIX)
        if _ENV_NAME.match(var):
            return var
        site.note(f"{text} does not name an environment variable", "api_key")
        return default
    var = f"{provider.upper()}_API_KEY_{site.index}"
    site.note(
        "written in config.yaml; switchyard reads keys from the environment only: "
        f"export it as {var}",
        "api_key",
    )
    return var


def _azure(params: Mapping[str, Any], site: Site) -> Found | None:
    """An Azure OpenAI deployment: the resource's endpoint, the deployment in the path."""
    api_base = site.value(params, "api_base", f"{ENV_PREFIX}AZURE_API_BASE")
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
        return settings, f"azure-{_host_label(api_base)}", comments
    key_env = _key_env(params.get("api_key"), "AZURE_API_KEY", "azure", site)
    settings["api_key_env"] = key_env or "AZURE_API_KEY"
    site.note(
        "Azure takes an API key in an api-key header; switchyard sends the variable's value as "
        "Authorization: Bearer, which Azure accepts for a Microsoft Entra ID token "
        "(azure_ad_token) only"
    )
    return settings, f"azure-{_host_label(api_base)}", comments


def _bedrock(name: str, params: Mapping[str, Any], site: Site) -> Found | None:
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
    endpoint = site.value(params, endpoint_key)
    if endpoint is not None:
        settings["base_url"] = endpoint.rstrip("/")
    _messages_only("Bedrock", site)
    region = table.get("region")
    hint = f"bedrock-{region}" if isinstance(region, str) else "bedrock"
    return settings, hint, ["Claude on Amazon Bedrock: Anthropic Messages requests only"]


def _vertex(name: str, params: Mapping[str, Any], site: Site) -> Found | None:
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


def _own_settings(params: Mapping[str, Any], site: Site) -> dict[str, Value]:
    """The deployment's own `timeout`, `stream_timeout`, `num_retries` and `order`."""
    settings: dict[str, Value] = {}
    timeout = seconds(params.get("timeout"), site.lookup, site.notes, f"{site.where} timeout")
    if timeout is not None:
        settings["timeout_secs"] = timeout
    where = f"{site.where} stream_timeout"
    stream = seconds(params.get("stream_timeout"), site.lookup, site.notes, where)
    if stream is not None:
        settings.update(stream_timing(stream))
    retries = params.get("num_retries")
    if isinstance(retries, int) and not isinstance(retries, bool):
        settings.update(retry_setting(retries))
    order = params.get("order")
    if isinstance(order, int) and not isinstance(order, bool):
        settings["priority"] = order  # both: lower is tried first
    return settings


def stream_timing(secs: float) -> dict[str, Value]:
    """LiteLLM's `stream_timeout` is the read timeout of a streamed call: the wait for its
    first chunk and for every later one."""
    return {"first_token_secs": secs, "stream_idle_secs": secs}


# LiteLLM waits out a provider's retry-after of up to 60 s before its retry (and backs off
# exponentially, up to 8 s, without one); switchyard retries in place once, within this wait.
RETRY_WAIT_SECS = 60


def retry_setting(num_retries: int) -> dict[str, Value]:
    return {"retry_wait_max_secs": RETRY_WAIT_SECS} if num_retries > 0 else {}


def seconds(raw: Any, lookup: Lookup, notes: Notes, where: str) -> float | None:
    """A time in seconds (a number, or a variable holding one); None (noted) otherwise."""
    if raw is None:
        return None
    text = lookup.value(raw, where, notes) if isinstance(raw, str) else raw
    if text is None:
        return None
    try:
        secs = float(text)
    except (TypeError, ValueError):
        notes.add(where, f"{raw!r} is not a number of seconds")
        return None
    if not (secs > 0 and math.isfinite(secs)):
        notes.add(where, f"{raw!r}: switchyard's times must be > 0")
        return None
    return int(secs) if secs.is_integer() else secs


def _number(raw: Any) -> bool:
    return isinstance(raw, int | float) and not isinstance(raw, bool) and raw > 0


def _why_not(key: str) -> str:
    if key in _REQUEST_PARAMS:
        return "a request parameter: switchyard forwards the client's body as it is"
    return _WHY.get(key, "no switchyard counterpart")


def _host_label(url: str) -> str:
    """`my-resource` of `https://my-resource.openai.azure.com/`: a name for the account."""
    host = url.split("://", 1)[-1].split("/", 1)[0]
    return host if host[:1].isdigit() else host.split(".", 1)[0]
