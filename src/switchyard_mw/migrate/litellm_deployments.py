"""One LiteLLM deployment (an entry of `model_list`) as the switchyard account that serves it.

A deployment is `model_name` (the public name clients send) and `litellm_params` (where and
how it is called: `model: provider/name`, `api_base`, `api_key`, ...). What switchyard calls an
account is the endpoint and its credential; the deployment's `model_name` becomes a public
name in the account's `models` and the provider's part of `model` the name the provider gets.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .litellm_clouds import azure, bedrock, vertex
from .litellm_site import Found, Lookup, Notes, Site, host_label, key_env
from .toml_text import Value


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


def wire_of(provider: str) -> str:
    """The wire an account of `provider` takes: switchyard rewrites `model`, never the format."""
    return "Anthropic Messages" if provider in ("anthropic", "bedrock", "vertex_ai") else "OpenAI"


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
    """A wildcard is `"*"` served as `"*"` (any model, each under its own name), nothing else;
    a provider's name is printable and not empty."""
    if not provider_model.strip() or not provider_model.isprintable():
        site.note("the provider's model name is empty or not printable")
        return False
    if public == "*" and provider_model == "*":
        return True
    if "*" in public or "*" in provider_model:
        site.note(
            'a wildcard deployment: a switchyard account serves named models, or any model as "*" '
            '(model_name: "*" with model: provider/*)'
        )
        return False
    return True


def _settings(provider: str, name: str, params: Mapping[str, Any], site: Site) -> Found | None:
    if provider == "azure":
        return azure(params, site)
    if provider == "bedrock":
        return bedrock(name, params, site)
    if provider == "vertex_ai":
        return vertex(name, params, site)
    return _api(provider, params, site)


def _api(provider: str, params: Mapping[str, Any], site: Site) -> Found | None:
    spec = API_PROVIDERS[provider]
    base, hint = spec.base_url, provider
    if params.get("api_base") is not None:
        api_base = site.url(params, "api_base")
        if api_base is None:
            return None
        base = _api_base(api_base, provider, site)
        hint = f"{provider}-{host_label(api_base)}" if base != spec.base_url else provider
    if base is None:
        site.note(f"api_base: required for {provider}")
        return None
    settings: dict[str, Value] = {"base_url": base}
    variable = key_env(params.get("api_key"), spec.key_env, provider, site)
    if variable is not None:
        settings["api_key_env"] = variable
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
