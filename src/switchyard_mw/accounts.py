"""Upstream accounts as the running process sees them: config plus the key read at start-up."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .config import Config, LLMClient, read_api_keys
from .core.clock import Clock, monotonic
from .core.pool import AccountPool, AccountSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class Account:
    """One `llm_clients` entry, ready to call. `repr` never shows the key."""

    name: str
    spec: LLMClient
    api_key: str | None = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        """The configured `base_url` without a trailing slash (the request path follows)."""
        return self.spec.base_url.rstrip("/")

    def auth_headers(self) -> list[tuple[str, str]]:
        """The credential header this account sends upstream, in its `auth` scheme."""
        if self.api_key is None:
            return []
        if self.spec.auth == "x-api-key":
            return [("x-api-key", self.api_key)]
        return [("authorization", f"Bearer {self.api_key}")]

    def url(self, path: str) -> str:
        """`base_url` joined with a request path such as `/v1/messages`."""
        return self.base_url + path


def build_accounts(config: Config, environ: Mapping[str, str] | None = None) -> dict[str, Account]:
    """Every configured client with its key; `StartupError` names each unset key variable."""
    keys = read_api_keys(config, environ)
    return {
        name: Account(name=name, spec=spec, api_key=keys[name])
        for name, spec in config.llm_clients.items()
    }


def pool_from_accounts(accounts: Mapping[str, Account], *, clock: Clock = monotonic) -> AccountPool:
    """The account pool for `accounts`, keyed by their `llm_clients` names."""
    return AccountPool(
        [
            AccountSpec(
                name=name,
                models=frozenset(c.spec.models),
                priority=c.spec.priority,
                failure_threshold=c.spec.failure_threshold,
                cooldown_secs=c.spec.cooldown_secs,
                max_cooldown_secs=c.spec.max_cooldown_secs,
                max_throttle_secs=c.spec.max_throttle_secs,
            )
            for name, c in accounts.items()
        ],
        clock=clock,
    )
