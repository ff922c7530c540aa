"""A LiteLLM proxy config (`config.yaml`) as a switchyard config: `switchyard-mw from-litellm`.

    translation = translate_litellm(Path("config.yaml").read_text(), source="config.yaml")
    print(translation.toml)               # a config `check-config` accepts
    translation.untranslated              # `where: why`, for each thing it could not carry

The deployments of `model_list` become accounts (`litellm_deployments`), those that share an
endpoint, a key and every setting joined into one account serving several models. From the
`router_settings` and `litellm_settings`: `fallbacks` and `context_window_fallbacks` become
`[fallbacks]` chains with `on = [...]`; `timeout`, `stream_timeout`, `num_retries`,
`cooldown_time` and `allowed_fails` the accounts' nearest settings; Redis the `[state]`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config import parse_config
from ..core.chains import expand
from ..errors import ConfigError, MissingExtraError
from .litellm_deployments import (
    ENV_PREFIX,
    Draft,
    Lookup,
    Notes,
    draft,
    retry_setting,
    seconds,
    stream_timing,
)
from .toml_text import Table, Value, render

__all__ = ["Translation", "translate_litellm"]


@dataclass(frozen=True)
class Translation:
    toml: str
    """The switchyard config, what could not be translated listed in its opening comment."""
    untranslated: tuple[str, ...]
    """One `where: why` line per thing of config.yaml that has no switchyard form."""


def translate_litellm(
    text: str, *, source: str = "config.yaml", environ: Mapping[str, str] | None = None
) -> Translation:
    """Translate config.yaml's text. `environ`: where `os.environ/VAR` endpoints, regions and
    projects are looked up (default: this process's environment); keys never are, they stay
    variables. Raises `ConfigError` for text that is not a LiteLLM config (bad YAML, no
    `model_list`) or of which no deployment could be translated."""
    raw = read_yaml(text, source)
    notes = Notes()
    settings = Settings.of(raw, notes)
    env = dict(os.environ if environ is None else environ)
    env.update(_environment_variables(raw, notes))
    lookup = Lookup(env)
    defaults = settings.account_defaults(lookup, notes)
    drafts = [
        found
        for index, entry in enumerate(raw["model_list"])
        if (found := draft(index, entry, lookup, notes, defaults)) is not None
    ]
    if not drafts:
        raise ConfigError(
            [f"{source}: model_list: no deployment could be translated"]
            + [f"{source}: {line}" for line in notes.lines]
        )
    _weights(drafts, notes)
    accounts = join(drafts)
    tables = [account.table() for account in accounts]
    fallbacks = settings.chains(_served(accounts), notes)
    if fallbacks.entries:
        tables.append(fallbacks)
    state = settings.state(lookup, notes)
    if state is not None:
        tables.append(state)
    toml = render(_preamble(source, notes.lines), tables)
    try:
        parse_config(toml, source="the translation")
    except ConfigError as exc:  # a case the translation does not cover: say so, never hide it
        raise ConfigError(
            [
                f"{source}: the translation is not a valid switchyard config (please report it)",
                *exc.problems,
            ]
        ) from None
    return Translation(toml, tuple(notes.lines))


def read_yaml(text: str, source: str) -> dict[str, Any]:
    """config.yaml as a mapping with a `model_list`; `ConfigError` names what is wrong."""
    try:
        import yaml
    except ImportError as exc:
        raise MissingExtraError("switchyard-mw from-litellm", "migrate", exc) from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([f"{source}: invalid YAML: {' '.join(str(exc).split())}"]) from None
    if not isinstance(raw, dict):
        raise ConfigError([f"{source}: expected a LiteLLM config (a mapping with model_list)"])
    model_list = raw.get("model_list")
    if not isinstance(model_list, list) or not model_list:
        raise ConfigError([f"{source}: model_list: required (a list of deployments)"])
    return raw


_TOP_LEVEL = ("model_list", "litellm_settings", "router_settings", "environment_variables")
_FALLBACKS = ("fallbacks", "context_window_fallbacks", "content_policy_fallbacks")
# Settings read here (from either section); any other is listed as not translated.
_READ = frozenset(
    {
        *_FALLBACKS,
        "default_fallbacks",
        "timeout",
        "request_timeout",
        "stream_timeout",
        "num_retries",
        "cooldown_time",
        "allowed_fails",
        "routing_strategy",
        "redis_host",
        "redis_port",
        "redis_password",
        "redis_url",
    }
)
_WHY = {
    "model_group_alias": "switchyard has no model aliases: clients send the model_name",
    "enable_pre_call_checks": "switchyard does not check a prompt against a context window "
    "before the call: a context_length chain acts on the provider's refusal",
    "retry_policy": "switchyard has no per-error retry counts (retry_wait_max_secs: one retry)",
    "allowed_fails_policy": "switchyard counts every account fault alike (failure_threshold)",
    "disable_cooldowns": "switchyard always cools an account that keeps failing",
    "success_callback": "switchyard reports through OpenTelemetry (docs/telemetry.md)",
    "failure_callback": "switchyard reports through OpenTelemetry (docs/telemetry.md)",
    "callbacks": "switchyard reports through OpenTelemetry (docs/telemetry.md)",
    "drop_params": "switchyard forwards the client's body as it is",
    "master_key": "switchyard does not check client keys here: keep the gateway where only "
    "your clients reach it (docs/security.md)",
    "cache": "switchyard caches no answers",
}


@dataclass
class Settings:
    """`router_settings` over `litellm_settings` (the router's own wins where both set one)."""

    values: dict[str, Any]
    origin: dict[str, str]

    @classmethod
    def of(cls, raw: Mapping[str, Any], notes: Notes) -> Settings:
        values: dict[str, Any] = {}
        origin: dict[str, str] = {}
        for section in ("litellm_settings", "router_settings"):
            table = raw.get(section) or {}
            if not isinstance(table, dict):
                notes.add(section, "expected a mapping")
                continue
            for key, value in table.items():
                if key in _READ:
                    values[key], origin[key] = value, f"{section}.{key}"
                else:
                    notes.add(f"{section}.{key}", _WHY.get(key, "no switchyard counterpart"))
        for key in raw:
            if key == "general_settings" and isinstance(raw[key], dict):
                for name in raw[key]:
                    notes.add(f"{key}.{name}", _WHY.get(name, "no switchyard counterpart"))
            elif key not in _TOP_LEVEL:
                notes.add(str(key), "no switchyard counterpart")
        return cls(values, origin)

    def account_defaults(self, lookup: Lookup, notes: Notes) -> dict[str, Value]:
        """What the router-wide settings give every account."""
        defaults: dict[str, Value] = {}
        for key in ("request_timeout", "timeout"):  # the router's `timeout` wins
            secs = seconds(self.values.get(key), lookup, notes, self.origin.get(key, key))
            if secs is not None:
                defaults["timeout_secs"] = secs
        stream = self.values.get("stream_timeout")
        secs = seconds(stream, lookup, notes, self.origin.get("stream_timeout", ""))
        if secs is not None:
            defaults.update(stream_timing(secs))
        retries = _count(self.values.get("num_retries"))
        if retries is not None:
            defaults.update(retry_setting(retries))
        cooldown = seconds(
            self.values.get("cooldown_time"), lookup, notes, self.origin.get("cooldown_time", "")
        )
        if cooldown is not None:  # LiteLLM's period is fixed: no doubling past it
            defaults.update(cooldown_secs=cooldown, max_cooldown_secs=cooldown)
        allowed = _count(self.values.get("allowed_fails"))
        if allowed is not None:  # LiteLLM cools on the failure after the allowed ones
            defaults["failure_threshold"] = allowed + 1
        strategy = self.values.get("routing_strategy")
        if strategy not in (None, "simple-shuffle"):
            notes.add(
                self.origin["routing_strategy"],
                f"{strategy}: switchyard shares a model's traffic among the accounts of its "
                "best priority, each conversation on one (weight), and fails over in order",
            )
        return defaults

    def chains(self, served: Served, notes: Notes) -> Table:
        """`[fallbacks]`: each model's chain, and for which reasons."""
        general = self._fallbacks("fallbacks", notes)
        context = self._fallbacks("context_window_fallbacks", notes)
        for model in self._fallbacks("content_policy_fallbacks", notes):
            notes.add(
                f"{self.origin['content_policy_fallbacks']} ({model})",
                "switchyard's chains act on unavailability and context length, not on a "
                "content-policy refusal",
            )
        self._default_fallbacks(general, served, notes)
        table = Table("fallbacks")
        graph: dict[str, list[str]] = {}
        for model in dict.fromkeys([*general, *context]):
            where = f"fallbacks ({model})"
            if not served(model):
                notes.add(where, f"no deployment of {model} was translated: its chain is dropped")
                continue
            g = _usable(model, general.get(model, ([], ""))[0], served, graph, notes)
            c = _usable(model, context.get(model, ([], ""))[0], served, graph, notes)
            entry, origin = _entry(model, g, c, general, context, notes)
            if entry is not None:
                graph[model] = g or c
                table.set(model, entry, origin)
        return table

    def _fallbacks(self, key: str, notes: Notes) -> dict[str, tuple[list[str], str]]:
        """`[{"a": ["b", "c"]}, ...]` (or one mapping) as {model: (chain, where from)}."""
        raw = self.values.get(key)
        if raw is None:
            return {}
        where = self.origin[key]
        items = raw if isinstance(raw, list) else [raw]
        chains: dict[str, tuple[list[str], str]] = {}
        for item in items:
            if not isinstance(item, dict):
                notes.add(where, f"expected [{{model: [fallback, ...]}}, ...], got {item!r}")
                continue
            for model, after in item.items():
                after = [after] if isinstance(after, str) else after
                if isinstance(after, list) and all(isinstance(m, str) for m in after):
                    chains[str(model)] = (after, where)
                else:
                    notes.add(f"{where} ({model})", "expected a list of model names")
        return chains

    def _default_fallbacks(
        self, general: dict[str, tuple[list[str], str]], served: Served, notes: Notes
    ) -> None:
        """`default_fallbacks`: the chain of every model that has none of its own."""
        default = self.values.get("default_fallbacks")
        if default is None:
            return
        where = self.origin["default_fallbacks"]
        if not (isinstance(default, list) and all(isinstance(m, str) for m in default)):
            notes.add(where, "expected a list of model names")
            return
        for model in served.models:
            if model not in general and model not in default and model != "*":
                general[model] = (list(default), where)

    def state(self, lookup: Lookup, notes: Notes) -> Table | None:
        """`[state]` on Redis where LiteLLM shares its router state through one."""
        url = lookup.value(self.values.get("redis_url"), "router_settings.redis_url", notes)
        host = lookup.value(self.values.get("redis_host"), "router_settings.redis_host", notes)
        if url is None and host is None:
            return None
        if url is None:
            port = lookup.value(self.values.get("redis_port", 6379), "redis_port", notes)
            url = f"redis://{host}:{port or 6379}"
        if self.values.get("redis_password") is not None:
            notes.add(
                self.origin["redis_password"],
                "switchyard reads Redis's password from state.url "
                "(redis://:PASSWORD@host:port): add it there",
            )
        table = Table("state", ["LiteLLM shared its router state through Redis; so do these"])
        table.set("backend", "redis")
        table.set("url", url)
        return table


def _entry(
    model: str,
    g: list[str],
    c: list[str],
    general: Mapping[str, tuple[list[str], str]],
    context: Mapping[str, tuple[list[str], str]],
    notes: Notes,
) -> tuple[Value | None, str]:
    """One model's chain: LiteLLM's `fallbacks` act when the model fails (`unavailable`), its
    `context_window_fallbacks` on a prompt too long for it (`context_length`)."""
    if g and g == c:
        return g, f"{general[model][1]} and {context[model][1]}"
    if g:
        if c:
            notes.add(
                f"{context[model][1]} ({model})",
                f"switchyard keeps one chain per model: {model}'s chain is its fallbacks, "
                "for unavailability only",
            )
        return {"models": g, "on": ["unavailable"]}, general[model][1]
    if c:
        return {"models": c, "on": ["context_length"]}, context[model][1]
    return None, ""


def _usable(
    model: str, after: list[str], served: Served, graph: Mapping[str, list[str]], notes: Notes
) -> list[str]:
    """The chain's models switchyard can take: served, named once, closing no cycle.

    LiteLLM follows `a -> b` and `b -> a` both; switchyard's chains compose (`a`'s includes
    `b`'s), so it refuses a cycle, and the chain that would close one loses that model."""
    usable: list[str] = []
    for name in after:
        where = f"fallbacks ({model} -> {name})"
        if not served(name):
            notes.add(where, f"no deployment of {name} was translated")
        elif name == model or model in expand(graph, name):
            notes.add(where, "closes a cycle through the chains, which switchyard refuses")
        elif name not in usable:
            usable.append(name)
    return usable


@dataclass
class Served:
    """The public models the translated accounts serve (`"*"`: any)."""

    models: list[str]

    def __call__(self, model: str) -> bool:
        return "*" in self.models or model in self.models


def _served(accounts: Iterable[Account]) -> Served:
    return Served(list(dict.fromkeys(m for a in accounts for m in a.models)))


@dataclass
class Account:
    """One switchyard account: deployments sharing an endpoint, a key and every setting."""

    hint: str
    settings: dict[str, Value]
    models: dict[str, str] = field(default_factory=dict)
    comments: list[str] = field(default_factory=list)
    name: str = ""

    def takes(self, d: Draft) -> bool:
        """Whether `d` can join: the same settings, a new public name on a new provider
        name (health is kept per public name), and no wildcard either side."""
        return (
            d.settings == self.settings
            and d.public not in self.models
            and d.provider_model not in self.models.values()
            and "*" not in self.models
            and d.public != "*"
        )

    def add(self, d: Draft) -> None:
        self.models[d.public] = d.provider_model
        self.comments.append(
            f"model_list[{d.index}]: {d.public} as {d.provider}/{d.provider_model}"
        )
        self.comments.extend(c for c in d.comments if c not in self.comments)

    def table(self) -> Table:
        table = Table(f"llm_clients.{_key(self.name)}", list(self.comments))
        same = all(public == provider for public, provider in self.models.items())
        for key, value in self.settings.items():
            if key in ("kind", "base_url", "path"):
                table.set(key, value)
        table.set("models", list(self.models) if same else dict(self.models))
        for key, value in self.settings.items():
            if key not in ("kind", "base_url", "path"):
                table.set(key, value, _KEY_NOTES.get(key, ""))
        return table


_KEY_NOTES = {
    "timeout_secs": "timeout (a floor: a large max_tokens lengthens it)",
    "first_token_secs": "stream_timeout",
    "stream_idle_secs": "stream_timeout",
    "retry_wait_max_secs": "num_retries: one retry in place, after a retry-after of up to 60 s",
    "cooldown_secs": "cooldown_time",
    "max_cooldown_secs": "cooldown_time: a fixed period, as LiteLLM's",
    "failure_threshold": "allowed_fails + 1: LiteLLM cools on the failure after the allowed ones",
    "priority": "order",
    "weight": "its share of the model's traffic (weight, rpm or tpm)",
}


def join(drafts: Iterable[Draft]) -> list[Account]:
    """Deployments as accounts, in config.yaml's order, each named once."""
    accounts: list[Account] = []
    for d in drafts:
        account = next((a for a in accounts if a.takes(d)), None)
        if account is None:
            account = Account(d.name_hint, dict(d.settings))
            accounts.append(account)
        account.add(d)
    used: set[str] = set()
    for account in accounts:
        base = re.sub(r"[^a-z0-9_-]+", "-", account.hint.lower()).strip("-") or "account"
        name, n = base, 1
        while name in used:
            n += 1
            name = f"{base}-{n}"
        used.add(name)
        account.name = name
    return accounts


_MAX_WEIGHT = 1e6  # the config's bound


def _weights(drafts: list[Draft], notes: Notes) -> None:
    """A model's deployments share its traffic as LiteLLM's simple-shuffle weighs them: by
    `weight`, else `rpm`, else `tpm`, when set on every one of them and not all equal."""
    groups: dict[str, list[Draft]] = {}
    for d in drafts:
        groups.setdefault(d.public, []).append(d)
    limited = [d for d in drafts if "rpm" in d.balance or "tpm" in d.balance]
    if limited:
        notes.add(
            "model_list rpm/tpm",
            "switchyard does not rate-limit a deployment; they weigh its share of the traffic",
        )
    for model, group in groups.items():
        basis = next(
            (b for b in ("weight", "rpm", "tpm") if any(b in d.balance for d in group)), ""
        )
        if not basis or len(group) < 2:
            continue
        if not all(basis in d.balance for d in group):
            notes.add(f"model_list ({model}) {basis}", "set on some deployments only: not weighed")
            continue
        values = [d.balance[basis] for d in group]
        scale = max(1.0, max(values) / _MAX_WEIGHT)
        if len(set(values)) > 1:
            for d, v in zip(group, values, strict=True):
                w = v / scale
                d.settings["weight"] = int(w) if w.is_integer() else round(w, 6)


def _environment_variables(raw: Mapping[str, Any], notes: Notes) -> dict[str, str]:
    """LiteLLM sets these in its own environment at start-up; switchyard reads none from its
    config. They are used to look up endpoints here, and listed for the environment."""
    table = raw.get("environment_variables")
    if not isinstance(table, dict) or not table:
        return {}
    notes.add(
        "environment_variables",
        "switchyard reads no variables from its config: set "
        f"{', '.join(str(k) for k in table)} in its environment",
    )
    return {str(k): str(v) for k, v in table.items() if not str(v).startswith(ENV_PREFIX)}


def _preamble(source: str, untranslated: list[str]) -> list[str]:
    lines = [
        f"Translated from {source} by `switchyard-mw from-litellm`;",
        "check it with `switchyard-mw check-config FILE` (docs/migrating-from-litellm.md).",
    ]
    if untranslated:
        lines.append(f"Not translated ({len(untranslated)}):")
        lines.extend(f"- {line}" for line in untranslated)
    return lines


def _count(raw: Any) -> int | None:
    """A count LiteLLM takes (`num_retries`, `allowed_fails`), or None when it is not one."""
    return raw if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0 else None


def _key(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else f'"{name}"'
