"""What translating one LiteLLM deployment reads and reports to: the notes of what could not
be translated, the environment `os.environ/VAR` values are looked up in, and the deployment's
place in config.yaml."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .toml_text import Value, one_line

ENV_PREFIX = "os.environ/"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class Notes:
    """What could not be translated, as `where: why` lines, in the order found."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, where: str, why: str) -> None:
        line = one_line(f"{where}: {why}")  # printed to a terminal: no control characters
        if line not in self.lines:
            self.lines.append(line)


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

    def url(self, params: Mapping[str, Any], key: str, default: str | None = None) -> str | None:
        """An endpoint (`api_base`, ...): as `value`, and None (noted) unless http(s)."""
        found = self.value(params, key, default)
        if found is None or found.startswith(("http://", "https://")):
            return found
        self.note(f"{found!r} is not an http:// or https:// URL", key)
        return None

    def note(self, why: str, key: str = "") -> None:
        self.notes.add(f"{self.where} {key}".rstrip(), why)


Found = tuple[dict[str, Value], str, list[str]]
"""An account's keys, its name when alone, and the comments written under its header."""


def key_env(raw: Any, default: str | None, provider: str, site: Site) -> str | None:
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


def host_label(url: str) -> str:
    """`my-resource` of `https://my-resource.openai.azure.com/`: a name for the account."""
    host = url.split("://", 1)[-1].split("/", 1)[0]
    return host if host[:1].isdigit() else host.split(".", 1)[0]
