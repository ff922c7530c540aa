"""What check-config can tell of accounts offline from this machine: a key variable unset, a
key file that is missing, unreadable or not a credentials file, an AWS profile the shared files
lack or a region found nowhere, a kind whose extra is not installed."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from typing import NamedTuple

from ..config import Config, LLMClient, missing_api_key, quote_key

_EXTRAS = {"vertex": ("google.auth", "vertex"), "bedrock": ("botocore", "bedrock")}


class EnvironmentCheck(NamedTuple):
    """A check that reads this machine (a variable, a file, an installed package), which
    `check-config --no-env` skips and names."""

    at: str
    """The key path it concerns, e.g. `llm_clients.a.api_key_env`."""
    what: str
    """What it verifies, said for the list of skipped checks."""
    run: Callable[[], list[str]]
    """Its problems as `key.path: why` lines (empty: passed)."""


def environment_checks(config: Config) -> list[EnvironmentCheck]:
    """Every check of `config` against this machine, in the config's order."""
    checks: list[EnvironmentCheck] = []
    for name, spec in config.llm_clients.items():
        at = f"llm_clients.{quote_key(name)}"
        if spec.api_key_env is not None:
            checks.append(_key_check(at, name, spec))
        checks.extend(_cloud_checks(at, spec))
    return checks


def cloud_problems(config: Config) -> list[str]:
    """`key.path: why` for each cloud account that cannot work as configured here."""
    return [
        problem
        for name, spec in config.llm_clients.items()
        for check in _cloud_checks(f"llm_clients.{quote_key(name)}", spec)
        for problem in check.run()
    ]


def _key_check(at: str, name: str, spec: LLMClient) -> EnvironmentCheck:
    def run() -> list[str]:
        problem = missing_api_key(name, spec, os.environ)
        return [] if problem is None else [problem]

    return EnvironmentCheck(f"{at}.api_key_env", f"${spec.api_key_env} is set", run)


def _cloud_checks(at: str, spec: LLMClient) -> list[EnvironmentCheck]:
    checks: list[EnvironmentCheck] = []
    if spec.kind in _EXTRAS:
        module, extra = _EXTRAS[spec.kind]

        def extra_installed() -> list[str]:
            if _installed(module):
                return []
            return [
                f'{at}.kind: "{spec.kind}" needs the {extra!r} extra '
                f"(pip install 'switchyard-mw[{extra}]')"
            ]

        checks.append(
            EnvironmentCheck(f"{at}.kind", f"the {extra!r} extra is installed", extra_installed)
        )
    bedrock = spec.bedrock
    if spec.kind == "bedrock" and bedrock is not None:

        def aws_chain() -> list[str]:
            if not _installed("botocore"):
                return []  # already named by the extra's check
            from .aws_sigv4 import offline_problems  # botocore: the `bedrock` extra

            return [f"{at}.{problem}" for problem in offline_problems(bedrock)]

        what = "the AWS profile and region resolve from the shared AWS files and the environment"
        checks.append(EnvironmentCheck(f"{at}.bedrock", what, aws_chain))
    if spec.vertex is not None and spec.vertex.credentials_file is not None:
        path = spec.vertex.credentials_file

        def credentials_file() -> list[str]:
            return [
                f"{at}.vertex.credentials_file: {problem}"
                for problem in credentials_file_problems(path)
            ]

        what = f"{path} is a readable credentials file"
        checks.append(EnvironmentCheck(f"{at}.vertex.credentials_file", what, credentials_file))
    return checks


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or blocked
        return False


def credentials_file_problems(path: str) -> list[str]:
    """Why `path` is not a usable Google credentials file (empty: it looks usable)."""
    try:
        with open(path, encoding="utf-8") as file:
            info = json.load(file)
    except FileNotFoundError:
        return [f"{path}: no such file"]
    except (OSError, UnicodeDecodeError) as exc:
        return [f"{path}: cannot read: {type(exc).__name__}"]
    except json.JSONDecodeError:
        return [f"{path}: not JSON (a service-account key file is)"]
    if not isinstance(info, dict) or not isinstance(info.get("type"), str):
        return [f'{path}: no "type" (not a Google credentials file)']
    if info["type"] not in ("service_account", "authorized_user"):
        return [
            f'{path}: credentials of type "{info["type"]}" are not read from a file here '
            "(leave credentials_file unset: application-default credentials read them)"
        ]
    if info["type"] == "service_account":
        missing = [k for k in ("client_email", "private_key", "token_uri") if not info.get(k)]
        if missing:
            return [f"{path}: service account without {', '.join(missing)}"]
    return []
