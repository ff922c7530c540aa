"""Deployments joined into switchyard accounts, named, and weighed as LiteLLM weighs them."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from .litellm_deployments import Draft, wire_of
from .litellm_site import Notes
from .toml_text import Table, Value


@dataclass
class Account:
    """One switchyard account: deployments sharing an endpoint, a key and every setting."""

    hint: str
    settings: dict[str, Value]
    models: dict[str, str] = field(default_factory=dict)
    comments: list[str] = field(default_factory=list)
    name: str = ""
    wire: str = ""
    """The wire its provider takes (`OpenAI`, `Anthropic Messages`)."""

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
        self.wire = wire_of(d.provider)  # one endpoint: one provider, one wire
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


def weigh(drafts: list[Draft], notes: Notes) -> None:
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


def _key(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else f'"{name}"'
