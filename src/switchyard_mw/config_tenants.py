"""The config's tables for who may spend the keys: `[tenants.NAME]`, `[[limits]]` (the
deployment's own) and `[prices."MODEL"]`, and the checks that span them.

Kept apart from `config.py`, which holds them in `Config` and runs these checks with the rest.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Literal

from msgspec import Meta, Struct, field

from .core.tenant_keys import digest_entry
from .errors import StartupError

Per = Literal["second", "minute", "hour", "day", "month"]
NonNegative = Annotated[float, Meta(ge=0)]
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_HEADER_NAME = re.compile(r"[a-z0-9!#$%&'*+.^_`|~-]+\Z")


class Limit(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One limit: exactly one of `tokens`, `requests` or `usd`, over a window (`per`), for
    every model or one (`model`). Windows start on UTC boundaries; a month is a calendar
    month (see [Tenants](policies/tenants.md))."""

    tokens: Annotated[int, Meta(gt=0)] | None = None
    """Tokens per window: input (cached included) plus output, as the providers report them."""
    requests: Annotated[int, Meta(gt=0)] | None = None
    """Requests per window."""
    usd: Annotated[float, Meta(gt=0)] | None = None
    """US dollars per window, priced by `[prices."MODEL"]`."""
    per: Per
    """The window: `"second"`, `"minute"`, `"hour"`, `"day"` or `"month"`."""
    model: str | None = None
    """Only requests for this public model count against it (unset: every model)."""

    def measure(self) -> str | None:
        """`tokens`, `requests` or `usd`: the one set (None when not exactly one is)."""
        given = [
            name
            for name, value in (
                ("tokens", self.tokens),
                ("requests", self.requests),
                ("usd", self.usd),
            )
            if value is not None
        ]
        return given[0] if len(given) == 1 else None

    def amount(self) -> float:
        for value in (self.tokens, self.requests, self.usd):
            if value is not None:
                return float(value)
        return 0.0


class Tenant(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One tenant: the client keys it sends, the models it may use and its limits."""

    keys: list[str] = []
    """The SHA-256 of each client key it sends, as `"sha256:<hex>"` (the hex digest that
    `sha256sum` prints for the key without a newline); the keys themselves are never written
    in the file."""
    keys_env: str | None = None
    """An environment variable holding more of its keys, comma-separated, raw or `sha256:`;
    read and hashed at start-up (and at each reload)."""
    models: list[str] = field(default_factory=lambda: ["*"])
    """Glob patterns (`"claude-*"`) of the public models it may use (default: every model)."""
    limits: list[Limit] = []
    """Its limits; a request must fit every one that applies to it."""


class Price(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A model's price in US dollars per million tokens, for `usd` limits and
    `switchyard.cost`."""

    input: NonNegative
    """Input tokens neither read from nor written to a prompt cache."""
    output: NonNegative
    """Output tokens."""
    cache_read: NonNegative | None = None
    """Input tokens read from the prompt cache (unset: `input`)."""
    cache_write: NonNegative | None = None
    """Input tokens written to the prompt cache (unset: `input`)."""


def quote(name: str) -> str:
    return name if name.replace("-", "").replace("_", "").isalnum() else f'"{name}"'


def check_tenants(
    tenants: Mapping[str, Tenant],
    limits: Iterable[Limit],
    prices: Mapping[str, Price],
    *,
    served: Callable[[], set[str]],
    unserved: Callable[[str], bool],
) -> list[str]:
    """Every problem of the three tables, each at its key path."""
    problems: list[str] = []
    owners: dict[str, str] = {}
    for name, tenant in tenants.items():
        at = f"tenants.{quote(name)}"
        for i, entry in enumerate(tenant.keys):
            try:
                digest = digest_entry(entry)
            except ValueError as exc:
                problems.append(f"{at}.keys[{i}]: {exc}")
                continue
            if owners.setdefault(digest, name) != name:
                problems.append(f"{at}.keys[{i}]: the same key is tenant {owners[digest]}'s too")
        if tenant.keys_env is not None and not _ENV_NAME.match(tenant.keys_env):
            problems.append(
                f"{at}.keys_env: {tenant.keys_env!r} is not an environment variable name"
            )
        if not tenant.models:
            problems.append(f"{at}.models: must name at least one pattern")
        usable = {m for m in served() if any(fnmatch.fnmatchcase(m, p) for p in tenant.models)}
        for i, limit in enumerate(tenant.limits):
            problems.extend(_check_limit(f"{at}.limits[{i}]", limit, prices, usable, unserved))
    for i, limit in enumerate(limits):
        problems.extend(_check_limit(f"limits[{i}]", limit, prices, served(), unserved))
    return problems


def check_tenant_header(header: str | None) -> list[str]:
    if header is None or _HEADER_NAME.match(header):
        return []
    return [f"server.tenant_header: {header!r} is not a lower-case HTTP header name"]


def tenant_keys(
    tenants: Mapping[str, Tenant], environ: Mapping[str, str] | None = None
) -> dict[str, list[str]]:
    """Each tenant's key digests: `keys` and those of its `keys_env` variable, hashed.

    `StartupError` names every unset variable and every malformed key found in one (by its
    position, never its value)."""
    env = os.environ if environ is None else environ
    found: dict[str, list[str]] = {}
    problems: list[str] = []
    for name, tenant in tenants.items():
        digests = [digest_entry(entry) for entry in tenant.keys]
        if tenant.keys_env is not None:
            value = env.get(tenant.keys_env)
            at = f"tenants.{quote(name)}.keys_env"
            if not value:
                problems.append(f"{at}: environment variable {tenant.keys_env} is not set")
            for i, entry in enumerate(e for e in (value or "").split(",") if e.strip()):
                try:
                    digests.append(digest_entry(entry))
                except ValueError as exc:
                    problems.append(f"{at}: entry {i + 1} of {tenant.keys_env}: {exc}")
        found[name] = digests
    if problems:
        raise StartupError("; ".join(problems))
    return found


def _check_limit(
    at: str,
    limit: Limit,
    prices: Mapping[str, Price],
    usable: set[str],
    unserved: Callable[[str], bool],
) -> list[str]:
    if limit.measure() is None:
        return [f"{at}: give exactly one of tokens, requests, usd"]
    if limit.model is not None and unserved(limit.model):
        return [f'{at}.model: no llm_clients entry serves model "{limit.model}"']
    if limit.usd is None:
        return []
    counted = {limit.model} if limit.model is not None else usable
    unpriced = sorted(m for m in counted if m not in prices and m != "*")
    if unpriced:
        shown = ", ".join(f'"{m}"' for m in unpriced)
        return [f"{at}.usd: no [prices] for {shown}, so its spend could not be counted"]
    return []


def tenant_warnings(
    tenants: Mapping[str, Tenant], *, served: set[str], tenant_header: str | None
) -> list[str]:
    """What is valid but probably not meant."""
    warnings: list[str] = []
    for name, tenant in tenants.items():
        at = f"tenants.{quote(name)}"
        if not tenant.keys and tenant.keys_env is None and tenant_header is None:
            warnings.append(
                f"{at}: no keys and no [server] tenant_header: only an app setting ctx.tenant "
                "can name it"
            )
        for i, pattern in enumerate(tenant.models):
            if "*" not in served and not any(fnmatch.fnmatchcase(m, pattern) for m in served):
                warnings.append(f'{at}.models[{i}]: "{pattern}" matches no model served')
    return warnings
