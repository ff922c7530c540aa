"""The config schema (frozen msgspec Structs) and its loader.

Loading checks types section by section, so one bad client does not hide the problems of the
next, then checks the rules that span sections (a canary naming a model no client serves).
Every problem is reported as `key.path: rule`.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args, get_origin
from urllib.parse import urlsplit

import msgspec
from msgspec import Meta, Struct

from .config_tenants import (
    Limit,
    Price,
    Tenant,
    check_tenant_header,
    check_tenants,
    tenant_warnings,
)
from .core.chains import cycles
from .errors import ConfigError, StartupError

PositiveSecs = Annotated[float, Meta(gt=0)]
PositiveInt = Annotated[int, Meta(gt=0)]

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


AccountKind = Literal["api", "vertex", "bedrock"]
"""How an account is called: `api`, an endpoint of the client's wire with a key in a header;
`vertex` and `bedrock`, Claude through a cloud (the Anthropic Messages wire re-enveloped)."""


class VertexSettings(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A `kind = "vertex"` account: Claude on Google Vertex AI, as gcloud configures it."""

    project: str
    """The Google Cloud project id the model is enabled in."""
    region: str
    """The Vertex AI location, e.g. `us-east5`, `europe-west1` or `global`."""
    credentials_file: str | None = None
    """A service-account key file (JSON); unset: application-default credentials
    (`GOOGLE_APPLICATION_CREDENTIALS`, gcloud's own login, or the metadata server)."""
    token_timeout_secs: PositiveSecs = 10.0
    """The longest wait for the token endpoint; past it the attempt fails naming the account."""


class BedrockSettings(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A `kind = "bedrock"` account: Claude on Amazon Bedrock, as the AWS CLI configures it."""

    region: str | None = None
    """The AWS region, e.g. `us-east-1`; unset: `AWS_REGION`, `AWS_DEFAULT_REGION` or the
    profile's region, as the AWS tools look it up."""
    profile: str | None = None
    """A named profile of the shared AWS files; unset: the standard credential chain
    (environment, shared files' default profile, container or instance role)."""


class LLMClient(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One upstream account: an endpoint, its credential and how to treat its faults."""

    base_url: str = ""
    """e.g. `https://api.anthropic.com`, without `/v1`: the request path is appended to it.
    Required for `kind = "api"`; a cloud account derives it from its region (set it to reach
    a private endpoint)."""
    models: list[str] | dict[str, str]
    """The models it serves: a list of names (`"*"` serves any model), or a table mapping each
    public name clients send to the provider's own (`{ "claude-opus-5" =
    "vendor.claude-opus-5-v1:0" }`): the body the provider gets carries its own name,
    the answer the client gets the public one."""
    path: str | None = None
    """A path template for a provider that puts the model or a deployment in the path, e.g.
    `"/openai/deployments/{model}/chat/completions?api-version=2025-04-01"`: it replaces the
    request's path, `{model}` filled with the provider's name (unset: the request's path)."""
    api_key_env: str | None = None
    """The environment variable holding its key, read at start-up (and at each reload)."""
    auth: Literal["x-api-key", "bearer", "api-key"] = "bearer"
    """How the key is sent: an `x-api-key` header (Anthropic), `Authorization: Bearer` (OpenAI
    and most others), or an `api-key` header (Azure OpenAI's API keys)."""
    priority: int = 0
    """Lower is preferred; accounts of equal priority share the traffic in turn."""
    timeout_secs: PositiveSecs = 60.0
    """The floor of a non-streaming attempt's deadline; a stream's time to send its headers."""
    stream_idle_secs: PositiveSecs = 60.0
    """The longest silence between two chunks of a stream."""
    first_token_secs: PositiveSecs | None = None
    """The longest a stream may take from sending to its first content event (text, thinking
    or tool-use); until then its headers are held back, so an expiry fails over (unset:
    `timeout_secs`)."""
    min_tokens_per_sec: Annotated[float, Meta(gt=0, le=1e6)] | None = None
    """A stream's output floor after its first content event: below it over
    `throughput_window_secs`, the stream ends like an idle expiry (unset: no floor)."""
    throughput_window_secs: PositiveSecs = 10.0
    """The window `min_tokens_per_sec` is measured over."""
    default_max_tokens: PositiveInt | None = None
    """The output cap assumed (for the deadline) when a request sets none."""
    failure_threshold: PositiveInt = 3
    """Consecutive account faults that cool it."""
    cooldown_secs: PositiveSecs = 30.0
    """The first cooling period; a failed probe re-cools for it again while the outage is
    younger than `max_cooldown_secs`, then doubles it (a refused key: from its first)."""
    max_cooldown_secs: PositiveSecs = 300.0
    """The cap of the cooling period (at least `cooldown_secs`), and the outage age from which
    a failed probe doubles the period."""
    max_throttle_secs: PositiveSecs = 60.0
    """The longest a 429's retry time keeps this account out of rotation for one model."""
    retry_wait_max_secs: Annotated[float, Meta(ge=0, le=3600)] = 0.0
    """Retry in place: a 429 whose retry time is at most this, or a single 5xx when no other
    account can serve, is retried once on this account after that wait, inside the request's
    budget; never a stream that started (0: off)."""
    resume_streams: bool | None = None
    """A stream that breaks on this account after its content started is continued on another
    account of the model (see Resumed streams); unset: `[server]`'s `resume_streams`."""
    accepts_prefill: bool | None = None
    """Whether this account takes a continuation: a request whose last message is the partial
    assistant answer to carry on (unset: yes on the Anthropic Messages wire, no on OpenAI Chat,
    where few providers continue a trailing assistant message; never on OpenAI Responses)."""
    hedge_after_secs: Annotated[float, Meta(gt=0, le=3600)] | Literal["auto"] | None = None
    """Hedged first tokens: an attempt on this account with no content event after this many
    seconds gets a second attempt on another account of the same model, and the first to
    answer wins; `"auto"`: this account's measured p95 time to first token (unset: off; see
    [Hedged first tokens](policies/hedging.md))."""
    weight: Annotated[float, Meta(gt=0, le=1e6)] = 1.0
    """Its share of conversations among the accounts of its priority: a conversation's turns
    go to one account, chosen by rendezvous hashing weighted by this (see Account affinity)."""
    envoy_cluster: str | None = None
    """ext_proc mode: the Envoy cluster that reaches `base_url` (unset: not routable there)."""
    kind: AccountKind = "api"
    """`api`: `base_url` speaks the client's wire, `api_key_env` holds the key; `vertex` or
    `bedrock`: Claude through that cloud, configured in the table of the same name (Anthropic
    Messages requests only; see Providers)."""
    vertex: VertexSettings | None = None
    """`kind = "vertex"`: `{ project = "...", region = "us-east5" }` (and its credentials)."""
    bedrock: BedrockSettings | None = None
    """`kind = "bedrock"`: `{ region = "us-east-1" }` (and a profile)."""

    def serves(self, model: str) -> bool:
        return "*" in self.models or model in self.models

    def provider_model(self, model: str) -> str:
        """The name the provider knows `model` by (the public name unless `models` maps it)."""
        models = self.models
        return models.get(model, model) if isinstance(models, dict) else model


class Guard(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Roll a variant back when, over `window_secs`, it has at least `min_requests` attempts
    and a fault rate above both `max_fault_rate` and its base model's."""

    max_fault_rate: Annotated[float, Meta(ge=0, le=1)]
    """The variant's fault rate (faults and deadline expiries over attempts) must exceed this."""
    min_requests: PositiveInt
    """Attempts on the variant in the window before the guard may judge it."""
    window_secs: PositiveSecs
    """The sliding window both rates are counted over."""


class Canary(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A rollout: the percent of keys moved from the base model to each variant."""

    variants: dict[str, float]
    """Percent of conversations moved to each variant (raising one only moves more in)."""
    salt: str = ""
    """Changing it reshuffles which conversations are in the canary."""
    guard: Guard | None = None
    """The automatic rollback of a failing variant (below)."""
    shadow: dict[str, float] = {}
    """Percent of the base model's non-streaming requests mirrored to each shadow model."""


class Route(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A requested model name whose real model an LLM judge picks."""

    classifier: Literal["llm"]
    """The kind of route: an LLM judge picks the model."""
    judge: str
    """The `llm_clients` entry the judge is called on (in OpenAI Chat format)."""
    judge_model: str
    """The model the judge runs as."""
    choices: dict[str, str]
    """Verdict label to model."""
    fallback: str
    """The model used whenever the judge cannot answer in time or at all."""
    judge_deadline_ms: PositiveInt | None = None
    """Bounds the whole consultation; unset: the judge account's `timeout_secs` bounds it."""
    judge_input_max_chars: PositiveInt = 4000
    """How much of the last user turn the judge sees."""


FallbackReason = Literal["unavailable", "context_length", "budget"]
FALLBACK_REASONS: tuple[FallbackReason, ...] = ("unavailable", "context_length")
"""Why a request moves to the next model of a chain given as a list (both failures)."""
ALL_FALLBACK_REASONS: tuple[FallbackReason, ...] = (*FALLBACK_REASONS, "budget")
"""Every reason a chain's `on` may name: `budget` only when asked for."""


class Fallback(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A model's fallback chain. The list form `"gpt-x" = ["gpt-x-mini"]` is this table with
    `models` the list and `on` both reasons. `check-config` refuses a chain naming a model no
    account serves, a cycle through the chains and an unknown reason ([Fallback
    chains](policies/fallbacks.md))."""

    models: list[str]
    """The models tried in order, each on its own accounts, when the model cannot serve; a
    model of the chain that has a chain of its own brings it after this one's."""
    on: tuple[FallbackReason, ...] = FALLBACK_REASONS
    """When the chain applies: `"unavailable"` (every account of the model cooled, held by a
    429, or failed in this request), `"context_length"` (the provider refused the prompt as
    too long for the model) and, only when named, `"budget"` (the tenant's limit for the model
    is spent: see [Tenants](policies/tenants.md))."""


class Server(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How the middlewares treat every request, whatever its policy."""

    expose_headers: bool = True
    """Add the `x-switchyard-*` headers (model, account, attempts, deadline, route, and the
    provider's request id as `x-switchyard-upstream-request-id`)."""
    max_body_bytes: PositiveInt = 32 * 1024 * 1024
    """A larger request body is refused with 413 `request_too_large`."""
    body_read_timeout_secs: PositiveSecs = 30.0
    """The whole request body must arrive within this, else 408 `request_timeout` and the
    connection closes (ASGI only: behind Envoy, Envoy's own request timeout bounds uploads)."""
    generic_paths: list[str] = []
    """Paths besides the three wire paths whose JSON body is read for its `model` field."""
    shadow_max_inflight: PositiveInt = 16
    """Shadow requests in flight at most; past it, new ones are dropped (and counted)."""
    resume_streams: bool = False
    """ASGI only: a stream that breaks (cut, reset, idle, slow) after the client got part of
    the answer is continued on another account of the same model, the partial answer sent as
    a prefill, and spliced into the client's stream (Resumed streams); an account's own
    `resume_streams` overrides it for streams that break on that account."""
    hedge_max_ratio: Annotated[float, Meta(ge=0, le=1)] = 0.05
    """At most this share of a model's requests over a sliding minute may start a hedge
    (`hedge_after_secs`), across replicas when `[state]` shares it (see [Hedged first
    tokens](policies/hedging.md))."""
    envoy_failover: dict[str, Annotated[list[str], Meta(min_length=2)]] = {}
    """ext_proc mode: Envoy aggregate clusters, each with the provider clusters it tries in
    order (`envoy.retry_priorities.previous_priorities`): a request whose account is on the
    first of them is routed to the aggregate, so its retries move across providers (see
    [Envoy](envoy.md#failover-across-providers))."""
    envoy_hedge: bool = False
    """ext_proc mode: Envoy's route for requests the processor marks `x-switchyard-hedge` has a
    `hedge_policy` (`hedge_on_per_try_timeout`), so a request (a stream or a JSON answer)
    whose account has `hedge_after_secs` gets a hedge on another account of its model (see
    [Envoy](envoy.md#hedged-first-tokens)). Off: no hedge under Envoy."""
    tenant_header: str | None = None
    """A request header that names the request's tenant, set by a proxy you trust in front of
    the gateway (Envoy's `jwt_authn` or `ext_authz`); a client key is then not needed. Set it
    only where clients cannot send it themselves (see [Tenants](policies/tenants.md))."""


class State(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Where account health (cooling) lives: in each process, or shared through Redis."""

    backend: Literal["memory", "redis"] = "memory"
    """`memory`: each process keeps its own; `redis`: shared by every replica."""
    mode: Literal["standalone", "cluster", "sentinel"] = "standalone"
    """One Redis node (with or without replicas), a Redis Cluster, or a master behind Sentinel."""
    url: str | None = None
    """`redis://[:password@]host:port/db`, `rediss://...` or `unix:///path`; redis only. In
    cluster mode any node; in sentinel mode optional, only its password, db and scheme apply to
    the master the sentinels name."""
    sentinels: list[str] = []
    """`host:port` of each sentinel; sentinel mode only."""
    service: str = "mymaster"
    """The master's name as the sentinels monitor it; sentinel mode only."""
    key_prefix: str = "switchyard"
    """One prefix per gateway fleet sharing a Redis."""
    timeout_ms: PositiveInt = 100
    """Longest wait for one store call; past it the replica goes on with its local state."""
    probe_lease_secs: PositiveSecs = 60.0
    """How long a claimed probe slot stays claimed if its holder never reports the outcome."""
    replicas_hint: PositiveInt = 1
    """How many replicas share the tenants' limits: while the store is unreachable each one
    enforces this share of every limit by itself (see [Tenants](policies/tenants.md) and
    [Operations](operations.md#sharing-account-health-across-replicas-redis))."""


class Config(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The whole config file: accounts, canaries, routes and the two tables."""

    llm_clients: dict[str, LLMClient] = {}
    canaries: dict[str, Canary] = {}
    routes: dict[str, Route] = {}
    fallbacks: dict[str, Fallback] = {}
    server: Server = Server()
    state: State = State()
    tenants: dict[str, Tenant] = {}
    limits: list[Limit] = []
    prices: dict[str, Price] = {}

    def clients_serving(self, model: str) -> list[str]:
        """The names of the `llm_clients` entries serving `model` (`"*"` serves any), in
        the config's order."""
        return [name for name, client in self.llm_clients.items() if client.serves(model)]


_S = TypeVar("_S", bound=Struct)
_TABLES: dict[str, type[Struct]] = {"server": Server, "state": State}
_SECTIONS: dict[str, type[Struct]] = {
    "llm_clients": LLMClient,
    "canaries": Canary,
    "routes": Route,
    "tenants": Tenant,
    "prices": Price,
}
_TOP_KEYS = (*_TABLES, *_SECTIONS, "fallbacks", "limits")


ConfigSource = Config | str | os.PathLike[str]
"""A loaded `Config`, or the path of its TOML file."""


def as_config(config: ConfigSource) -> Config:
    """`config` itself, or the config loaded from the file it names."""
    return config if isinstance(config, Config) else load_config(config)


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate a TOML config file; raise `ConfigError` listing every problem."""
    config, problems = diagnose_config(path)
    if problems or config is None:
        raise ConfigError(problems)
    return config


def diagnose_config(path: str | os.PathLike[str]) -> tuple[Config | None, list[str]]:
    """The config as far as it can be read, and every problem found in it, in one pass.

    With problems, the config returned (if any) has its bad entries dropped or defaulted:
    good enough to check the environment against, never to serve with.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None, [f"{p}: no such file"]
    except (OSError, UnicodeDecodeError) as exc:
        return None, [f"{p}: cannot read: {exc}"]
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        return None, [f"{p}: invalid TOML: {exc}"]
    return validate(raw)


def parse_config(text: str, *, source: str = "<config>") -> Config:
    """Validate TOML text; raise `ConfigError` listing every problem."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{source}: invalid TOML: {exc}"]) from None
    return config_from_mapping(raw)


def config_from_mapping(raw: Mapping[str, Any]) -> Config:
    """Validate an already-parsed mapping (the shape of the TOML file)."""
    config, problems = validate(raw)
    if problems:
        raise ConfigError(problems)
    return config


def validate(raw: Mapping[str, Any]) -> tuple[Config, list[str]]:
    """Every problem of a parsed mapping, and the config as far as it could be read."""
    problems: list[str] = []
    sections: dict[str, Any] = {}
    salvaged: set[str] = set()
    for key, value in raw.items():
        if key in _TABLES:
            table = _convert(value, _TABLES[key], key, problems)
            if table is not None:
                sections[key] = table
        elif key in _SECTIONS:
            if not isinstance(value, dict):
                problems.append(f"{key}: expected a table")
                continue
            sections[key] = _convert_section(key, value, problems, salvaged)
        elif key == "fallbacks":
            sections[key] = _convert_fallbacks(value, problems)
        elif key == "limits":
            sections[key] = _convert_limits(value, problems)
        else:
            problems.append(f"{key}: unknown key{_suggest(key, _TOP_KEYS)}")
    config = Config(**sections)
    # A client missing here failed even its required fields: which models it serves is
    # unknown, and "no client serves X" would mislead.
    declared = raw.get("llm_clients")
    declared_clients = set(declared) if isinstance(declared, dict) else set()
    if declared is None or declared == {}:
        problems.append(
            "llm_clients: no accounts (at least one [llm_clients.NAME] table; without one "
            "every request is refused)"
        )
    clients_complete = declared_clients <= set(config.llm_clients)
    problems.extend(
        _cross_check(
            config,
            clients_complete=clients_complete,
            declared_clients=declared_clients,
            salvaged=salvaged,
        )
    )
    return config, problems


def _convert_section(
    section: str, value: dict[str, Any], problems: list[str], salvaged: set[str]
) -> dict[str, Any]:
    """Each entry of a named section; an entry with bad fields is kept for the cross checks.

    Keeping it (its bad fields at their defaults) is what lets one pass report a broken
    client *and* the canary that names a model nobody serves: otherwise the second problem
    shows only once the first is fixed. The config is refused all the same.
    """
    entries = {}
    for name, entry in value.items():
        where = f"{section}.{_quote(name)}"
        converted = _convert(entry, _SECTIONS[section], where, problems)
        if converted is None:
            converted = _salvage(entry, _SECTIONS[section])
            salvaged.add(where)
        if converted is not None:
            entries[name] = converted
    return entries


def _convert_fallbacks(value: Any, problems: list[str]) -> dict[str, Fallback]:
    """`[fallbacks]`: each model's chain, in the list form or the table form."""
    if not isinstance(value, dict):
        problems.append("fallbacks: expected a table")
        return {}
    chains: dict[str, Fallback] = {}
    for model, entry in value.items():
        where = f"fallbacks.{_quote(model)}"
        if isinstance(entry, list):
            if all(isinstance(m, str) for m in entry):
                chains[model] = Fallback(models=entry)
            else:
                problems.append(f"{where}: expected a list of model names")
            continue
        if isinstance(entry, dict) and isinstance(entry.get("on"), list):
            unknown = [r for r in entry["on"] if r not in ALL_FALLBACK_REASONS]
            if unknown:
                *most, last = (f'"{r}"' for r in ALL_FALLBACK_REASONS)
                known = f"{', '.join(most)} or {last}"
                shown = ", ".join(f'"{r}"' for r in unknown)
                problems.append(f"{where}.on: unknown reason {shown} (expected {known})")
                continue
        converted = _convert(entry, Fallback, where, problems)
        if converted is not None:
            chains[model] = converted
    return chains


def _convert_limits(value: Any, problems: list[str]) -> list[Limit]:
    """`[[limits]]`: the deployment's own limits, an array of tables."""
    if not isinstance(value, list):
        problems.append("limits: expected an array of tables ([[limits]])")
        return []
    converted = (_convert(entry, Limit, f"limits[{i}]", problems) for i, entry in enumerate(value))
    return [limit for limit in converted if limit is not None]


def _convert(value: Any, kind: type[_S], where: str, problems: list[str]) -> _S | None:
    """Check a table field by field so that every bad field is reported, not just the first."""
    if not isinstance(value, dict):
        problems.append(f"{where}: expected a table, got {type(value).__name__}")
        return None
    fields = {f.encode_name: f for f in msgspec.structs.fields(kind)}
    before = len(problems)
    for key in value:
        if key not in fields:
            problems.append(f"{where}.{_quote(key)}: unknown key{_suggest(key, fields)}")
    for name, field in fields.items():
        if name not in value:
            if field.required:
                problems.append(f"{where}.{name}: required")
            continue
        try:
            msgspec.convert(value[name], field.type, strict=True)
        except msgspec.ValidationError as exc:
            raw = value[name]
            if name in _EXPECTED and (isinstance(raw, bool) or not isinstance(raw, int | float)):
                problems.append(f"{where}.{name}: expected {_EXPECTED[name]}, got {raw!r}")
            elif get_origin(field.type) is Literal and isinstance(value[name], str):
                allowed = ", ".join(f'"{a}"' for a in get_args(field.type))
                problems.append(f"{where}.{name}: expected one of {allowed}")
            else:
                problems.append(_describe(exc, f"{where}.{name}"))
    if len(problems) > before:
        return None
    return msgspec.convert(value, kind, strict=True)


_EXPECTED = {"hedge_after_secs": 'a number of seconds (> 0, <= 3600) or "auto"'}
"""What a field of several types takes, said whole (msgspec names only the type it tried)."""


def _salvage(value: Any, kind: type[_S]) -> _S | None:
    """The entry with its unknown and bad fields dropped, or None if a required one is bad."""
    if not isinstance(value, dict):
        return None
    good = {}
    for field in msgspec.structs.fields(kind):
        if field.encode_name not in value:
            continue
        try:
            msgspec.convert(value[field.encode_name], field.type, strict=True)
        except msgspec.ValidationError:
            continue
        good[field.encode_name] = value[field.encode_name]
    try:
        return msgspec.convert(good, kind, strict=True)
    except msgspec.ValidationError:
        return None


def _suggest(key: str, known: Iterable[str]) -> str:
    """` (did you mean "x"?)` for a key one typo away from a known one, else nothing."""
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f' (did you mean "{close[0]}"?)' if close else ""


_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_MISSING = re.compile(r"^Object missing required field `(?P<name>[^`]+)`$")
_BOUND = re.compile(r"^Expected `(?P<type>[^`]+)` (?P<op>[<>]=?) (?P<n>[-0-9.e+]+)$")


def _describe(exc: msgspec.ValidationError, where: str) -> str:
    """Turn msgspec's message into `key.path: rule` in our vocabulary."""
    match = _AT.match(str(exc))
    what = match.group("what") if match else str(exc)
    path = where + (match.group("path") if match and match.group("path") else "")
    if m := _MISSING.match(what):  # a nested table's field: named at its own key path
        return f"{path}.{m.group('name')}: required"
    if m := _BOUND.match(what):
        op, n = m.group("op"), float(m.group("n"))
        if m.group("type") == "int" and op == ">=" and n == 1:
            op, n = ">", 0.0  # msgspec states int `gt=0` as `>= 1`; say what the config meant
        shown = int(n) if n.is_integer() else n
        return f"{path}: must be {op} {shown}"
    return f"{path}: {what[0].lower()}{what[1:]}"


def quote_key(name: str) -> str:
    """A name as a part of a problem's key path: bare, or in double quotes."""
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else f'"{name}"'


_quote = quote_key


def _cross_check(
    config: Config,
    *,
    clients_complete: bool,
    declared_clients: set[str],
    salvaged: set[str],
) -> list[str]:
    served: set[str] = set()
    for client in config.llm_clients.values():
        served.update(client.models)

    def unserved(model: str) -> bool:
        return clients_complete and "*" not in served and model not in served

    problems = _check_clients(config, salvaged)
    problems.extend(_check_canaries(config, unserved))
    problems.extend(_check_routes(config, unserved, declared_clients))
    problems.extend(_check_fallbacks(config.fallbacks, unserved))
    problems.extend(
        check_tenants(
            config.tenants, config.limits, config.prices, served=lambda: served, unserved=unserved
        )
    )
    problems.extend(check_tenant_header(config.server.tenant_header))
    problems.extend(_check_state(config.state))
    problems.extend(_check_failover(config.server.envoy_failover))
    if config.state.mode == "cluster":
        problems.extend(_check_hash_tags(config))
    return problems


def _check_clients(config: Config, salvaged: set[str]) -> list[str]:
    problems: list[str] = []
    for name, client in config.llm_clients.items():
        at = f"llm_clients.{_quote(name)}"
        if not client.models:
            problems.append(f"{at}.models: must list at least one model")
        if isinstance(client.models, dict):
            problems.extend(_check_model_map(at, client.models))
        if client.path is not None:
            problems.extend(_check_path(at, client.path, maps=isinstance(client.models, dict)))
        if client.kind != "api":
            problems.extend(_check_cloud(at, client, salvaged=at in salvaged))
        elif not client.base_url:
            problems.append(f"{at}.base_url: required")
        if client.base_url and not client.base_url.startswith(("http://", "https://")):
            problems.append(f"{at}.base_url: must start with http:// or https://")
        if client.api_key_env is not None and not _ENV_NAME.match(client.api_key_env):
            problems.append(f"{at}.api_key_env: not an environment variable name")
        # A salvaged entry may hold a default in place of a bad period: comparing would mislead.
        if at not in salvaged and client.max_cooldown_secs < client.cooldown_secs:
            problems.append(f"{at}.max_cooldown_secs: must be >= cooldown_secs")
    return problems


def _check_cloud(at: str, client: LLMClient, *, salvaged: bool) -> list[str]:
    """A cloud account: its own table set (and no other's), and none of the keys it replaces
    (the cloud decides the path and the credential). A salvaged entry's table may have been
    dropped for a bad field, already reported."""
    problems: list[str] = []
    kind = client.kind
    if getattr(client, kind) is None and not salvaged:
        problems.append(f'{at}.{kind}: required when kind = "{kind}"')
    for other in ("vertex", "bedrock"):
        if other != kind and getattr(client, other) is not None:
            problems.append(f'{at}.{other}: only with kind = "{other}"')
    for key, unset in (("path", None), ("api_key_env", None), ("auth", "bearer")):
        if getattr(client, key) != unset:
            problems.append(f'{at}.{key}: not used with kind = "{kind}" (the cloud decides it)')
    return problems


def _check_model_map(at: str, models: dict[str, str]) -> list[str]:
    """A table of public name -> provider name: each provider name non-empty and used once."""
    problems: list[str] = []
    first: dict[str, str] = {}
    for public, provider in models.items():
        where = f"{at}.models.{_quote(public)}"
        if public == "*":
            problems.append(f'{where}: "*" serves any model in the list form only, not a table')
        elif not provider.strip():
            problems.append(f"{where}: the provider's model name must not be empty")
        elif not provider.isprintable():
            problems.append(f"{where}: the provider's model name must be printable")
        elif provider in first:
            # Health, metrics and a shared deployment path are per public name: two names on
            # one provider name would be two breakers for one thing, and aliases belong to
            # the client's side of the gateway (a route or a canary), not to an account.
            problems.append(
                f'{where}: "{provider}" is also the provider name of "{first[provider]}" '
                "(two public names on one provider name)"
            )
        else:
            first[provider] = public
    return problems


_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")


def _check_path(at: str, path: str, *, maps: bool) -> list[str]:
    """A path template: a path (not a URL), `{model}` its only placeholder, required where
    the account maps names (else every provider name would go to one path)."""
    where = f"{at}.path"
    if not path.startswith("/") or path.startswith("//"):
        return [f'{where}: must be a path starting with "/" (base_url gives the scheme and host)']
    if any(c.isspace() or not c.isprintable() for c in path) or "#" in path:
        return [f"{where}: must not contain spaces, control characters or a #fragment"]
    others = sorted({name for name in _PLACEHOLDER.findall(path) if name != "model"})
    if others:
        shown = ", ".join(f"{{{name}}}" for name in others)
        return [f"{where}: {{model}} is the only placeholder, found {shown}"]
    if "{" in _PLACEHOLDER.sub("", path) or "}" in _PLACEHOLDER.sub("", path):
        return [f"{where}: unbalanced {{ or }}"]
    if maps and "{model}" not in path:
        return [f"{where}: must contain {{model}} where models maps names to the provider's"]
    return []


def _check_canaries(config: Config, unserved: Callable[[str], bool]) -> list[str]:
    problems: list[str] = []
    for model, canary in config.canaries.items():
        at = f"canaries.{_quote(model)}"
        if unserved(model):
            problems.append(f"{at}: {_unserved_msg(model)}")
        if not canary.variants and not canary.shadow:
            problems.append(f"{at}.variants: must name at least one variant (or a shadow)")
        for variant, percent in canary.variants.items():
            if not 0 <= percent <= 100:
                problems.append(f"{at}.variants.{_quote(variant)}: must be between 0 and 100")
            if variant == model:
                problems.append(f"{at}.variants.{_quote(variant)}: is the base model itself")
            elif unserved(variant):
                problems.append(f"{at}.variants.{_quote(variant)}: {_unserved_msg(variant)}")
        total = math.fsum(canary.variants.values())
        if total > 100:
            shown = int(total) if total.is_integer() else round(total, 4)
            problems.append(f"{at}.variants: percentages sum to {shown} > 100")
        problems.extend(_check_shadow(at, model, canary, unserved))
    return problems


def _check_shadow(
    at: str, model: str, canary: Canary, unserved: Callable[[str], bool]
) -> list[str]:
    problems = []
    for shadow, percent in canary.shadow.items():
        where = f"{at}.shadow.{_quote(shadow)}"
        if not 0 <= percent <= 100:
            problems.append(f"{where}: must be between 0 and 100")
        if shadow == model:
            problems.append(f"{where}: is the base model itself")
        elif unserved(shadow):
            problems.append(f"{where}: {_unserved_msg(shadow)}")
    total = math.fsum(canary.shadow.values())
    if total > 100:
        problems.append(f"{at}.shadow: percentages sum to {round(total, 4):g} > 100")
    return problems


def _check_routes(
    config: Config, unserved: Callable[[str], bool], declared_clients: set[str]
) -> list[str]:
    problems: list[str] = []
    for name, route in config.routes.items():
        at = f"routes.{_quote(name)}"
        judge = config.llm_clients.get(route.judge)
        if judge is None and route.judge not in declared_clients:
            problems.append(f'{at}.judge: no llm_clients entry "{route.judge}"')
        elif judge is not None and judge.kind != "api":
            problems.append(
                f'{at}.judge: llm_clients.{_quote(route.judge)} is a kind = "{judge.kind}" '
                'account; the judge speaks OpenAI Chat to a kind = "api" account'
            )
        elif judge is not None and not judge.serves(route.judge_model):
            problems.append(
                f"{at}.judge_model: llm_clients.{_quote(route.judge)} does not serve "
                f'"{route.judge_model}"'
            )
        if not route.choices:
            problems.append(f"{at}.choices: must name at least one label")
        for label, model in route.choices.items():
            if unserved(model):
                problems.append(f"{at}.choices.{_quote(label)}: {_unserved_msg(model)}")
        if unserved(route.fallback):
            problems.append(f"{at}.fallback: {_unserved_msg(route.fallback)}")
        if name in config.canaries:
            problems.append(f"{at}: also named as a canary base model; a route name is not a model")
    return problems


def _check_fallbacks(chains: dict[str, Fallback], unserved: Callable[[str], bool]) -> list[str]:
    """Every model of a chain served, each named once, no chain leading back to its model."""
    problems: list[str] = []
    for model, chain in chains.items():
        where = f"fallbacks.{_quote(model)}"
        if unserved(model):
            problems.append(f"{where}: {_unserved_msg(model)} (the chain would never apply)")
        if not chain.models:
            problems.append(f"{where}: must name at least one model")
        if not chain.on:
            problems.append(f"{where}.on: must name at least one reason")
        for after in dict.fromkeys(chain.models):
            if unserved(after):
                problems.append(f"{where}: {_unserved_msg(after)}")
            if chain.models.count(after) > 1:
                problems.append(f'{where}: "{after}" is named more than once')
    for cycle in cycles({model: chain.models for model, chain in chains.items()}):
        shown = " -> ".join(f'"{m}"' for m in cycle)
        problems.append(f"fallbacks.{_quote(cycle[0])}: a cycle through the chains: {shown}")
    return problems


def _check_failover(aggregates: dict[str, list[str]]) -> list[str]:
    """Each aggregate tries a cluster once per round, and each cluster heads one aggregate:
    the processor routes a request by its first account's cluster."""
    problems: list[str] = []
    headed: dict[str, str] = {}
    for name, clusters in aggregates.items():
        at = f"server.envoy_failover.{_quote(name)}"
        if len(set(clusters)) != len(clusters):
            problems.append(f"{at}: names a cluster twice")
        first = clusters[0]
        if first in headed:
            problems.append(
                f'{at}: "{first}" heads "{headed[first]}" already; a request on it could be '
                "routed to either"
            )
        headed.setdefault(first, name)
    return problems


def _check_state(state: State) -> list[str]:
    problems: list[str] = []
    if state.backend == "redis" and state.url is None and state.mode != "sentinel":
        problems.append('state.url: required when backend = "redis"')
    if state.url is not None and not state.url.startswith(("redis://", "rediss://", "unix://")):
        problems.append("state.url: must start with redis://, rediss:// or unix://")
    if not state.key_prefix:
        problems.append("state.key_prefix: must not be empty")
    return problems + _check_state_mode(state)


def _check_state_mode(state: State) -> list[str]:
    problems: list[str] = []
    if state.mode == "cluster" and state.url is not None:
        url = urlsplit(state.url)
        if url.scheme == "unix":
            problems.append("state.url: a Redis Cluster is reached over TCP, not unix://")
        elif url.path.strip("/") not in ("", "0"):
            problems.append("state.url: a Redis Cluster has only database 0")
    if state.mode == "sentinel" and not state.sentinels:
        problems.append('state.sentinels: required when mode = "sentinel" (["host:port", ...])')
    if state.mode != "sentinel" and state.sentinels:
        problems.append('state.sentinels: only with mode = "sentinel"')
    for i, address in enumerate(state.sentinels):
        if sentinel_address(address) is None:
            problems.append(f"state.sentinels[{i}]: {address!r} is not host:port")
    if not state.service:
        problems.append("state.service: must not be empty")
    return problems


def _check_hash_tags(config: Config) -> list[str]:
    """Both keys of an account must hash to one slot: `P:account:{A}` and `P:probe:{A}` share
    the tag `A` (up to its first "}") unless a brace in P, or a name opening with "}" (an
    empty tag: the whole key is hashed), moves it."""
    problems: list[str] = []
    if "{" in config.state.key_prefix or "}" in config.state.key_prefix:
        problems.append('state.key_prefix: no "{" or "}" in cluster mode (the keys\' hash tag)')
    for name in config.llm_clients:
        if name.startswith("}"):
            problems.append(
                f'llm_clients.{_quote(name)}: in cluster mode a name may not start with "}}" '
                "(its keys would hash to different slots)"
            )
    return problems


def sentinel_address(address: str) -> tuple[str, int] | None:
    """`host:port` (`[::1]:port` for IPv6) -> (host, port); None when it is not one."""
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def _unserved_msg(model: str) -> str:
    return f'no llm_clients entry serves model "{model}"'


def read_api_keys(
    config: Config, environ: Mapping[str, str] | None = None
) -> dict[str, str | None]:
    """Each client's key from its env variable; `StartupError` names every missing one.

    The message names the variable, never a value.
    """
    env = os.environ if environ is None else environ
    keys = {
        name: env.get(c.api_key_env) if c.api_key_env else None
        for name, c in config.llm_clients.items()
    }
    missing = [
        problem
        for name, client in config.llm_clients.items()
        if (problem := missing_api_key(name, client, env)) is not None
    ]
    if missing:
        raise StartupError("; ".join(missing))
    return keys


def missing_api_key(name: str, client: LLMClient, environ: Mapping[str, str]) -> str | None:
    """`llm_clients.NAME.api_key_env: ...` when the client's key variable is unset or empty."""
    if client.api_key_env is None or environ.get(client.api_key_env):
        return None
    return (
        f"llm_clients.{_quote(name)}.api_key_env: environment variable "
        f"{client.api_key_env} is not set"
    )


def missing_api_keys(config: Config, environ: Mapping[str, str] | None = None) -> list[str]:
    """One `key.path: ...` line per client whose key variable is unset or empty."""
    try:
        read_api_keys(config, environ)
    except StartupError as exc:
        return str(exc).split("; ")
    return []


def config_warnings(config: Config) -> list[str]:
    """What is valid but probably not meant: `key.path: why` lines (check-config prints them)."""
    served = {m for client in config.llm_clients.values() for m in client.models}
    warnings = tenant_warnings(
        config.tenants, served=served, tenant_header=config.server.tenant_header
    )
    judges = {route.judge for route in config.routes.values()}
    routed_by_envoy = any(c.envoy_cluster for c in config.llm_clients.values())
    for name, client in config.llm_clients.items():
        at = f"llm_clients.{_quote(name)}"
        base = client.base_url.rstrip("/")
        if base.endswith("/v1"):
            warnings.append(
                f"{at}.base_url: ends in /v1, but the request path is appended to it "
                f"({base}/v1/messages would be called); leave the /v1 out"
            )
        # The ext_proc server calls a judge itself; every other account is reached via Envoy.
        if routed_by_envoy and not client.envoy_cluster and name not in judges:
            warnings.append(
                f"{at}.envoy_cluster: not set, so the ext_proc server never routes to this "
                "account (other accounts set it)"
            )
    warnings.extend(_failover_warnings(config))
    return warnings


def _failover_warnings(config: Config) -> list[str]:
    """An aggregate's cluster no account is on: Envoy's retries there find none to take them."""
    clusters = {c.envoy_cluster for c in config.llm_clients.values() if c.envoy_cluster}
    warnings = []
    for name, members in config.server.envoy_failover.items():
        for cluster in members:
            if cluster not in clusters:
                warnings.append(
                    f"server.envoy_failover.{_quote(name)}: no account has envoy_cluster = "
                    f'"{cluster}": a retry Envoy sends there is refused'
                )
    return warnings
