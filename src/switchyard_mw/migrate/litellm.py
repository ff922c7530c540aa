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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..config import parse_config
from ..errors import ConfigError, MissingExtraError
from .litellm_accounts import Account, join, weigh
from .litellm_deployments import draft, retry_setting, seconds, stream_timing
from .litellm_fallbacks import Served, fallback_table
from .litellm_site import ENV_PREFIX, Lookup, Notes
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
    weigh(drafts, notes)
    accounts = join(drafts)
    tables = [account.table() for account in accounts]
    fallbacks = fallback_table(settings, _served(accounts), notes)
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

    def state(self, lookup: Lookup, notes: Notes) -> Table | None:
        """`[state]` on Redis where LiteLLM shares its router state through one."""
        url = self._redis_url(lookup, notes)
        if url is None:
            return None
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

    def _redis_url(self, lookup: Lookup, notes: Notes) -> str | None:
        """`redis_url`, else `redis://redis_host:redis_port`; None (noted) when unusable."""
        where = {
            key: self.origin.get(key, key) for key in ("redis_url", "redis_host", "redis_port")
        }
        url = lookup.value(self.values.get("redis_url"), where["redis_url"], notes)
        if url is not None:
            if url.startswith(("redis://", "rediss://", "unix://")):
                return url
            notes.add(where["redis_url"], "not a redis://, rediss:// or unix:// URL")
            return None
        host = lookup.value(self.values.get("redis_host"), where["redis_host"], notes)
        if host is None:
            return None
        port = lookup.value(self.values.get("redis_port", 6379), where["redis_port"], notes)
        if not (host.strip() and port and port.isdigit() and 0 < int(port) < 65536):
            notes.add(where["redis_host"], f"{host}:{port} is not a Redis host and port")
            return None
        return f"redis://{host.strip()}:{port}"


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


def _served(accounts: Iterable[Account]) -> Served:
    served = Served([])
    for account in accounts:
        for model in account.models:
            if model not in served.models:
                served.models.append(model)
            served.wires.setdefault(model, set()).add(account.wire)
    return served
