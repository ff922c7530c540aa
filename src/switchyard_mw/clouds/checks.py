"""What check-config can tell of cloud accounts offline: a key file that is missing,
unreadable or not a credentials file, an AWS profile the shared files lack or a region found
nowhere, a kind whose extra is not installed."""

from __future__ import annotations

import importlib.util
import json

from ..config import Config

_EXTRAS = {"vertex": ("google.auth", "vertex"), "bedrock": ("botocore", "bedrock")}


def cloud_problems(config: Config) -> list[str]:
    """`key.path: why` for each cloud account that cannot work as configured here."""
    problems: list[str] = []
    for name, spec in config.llm_clients.items():
        at = f"llm_clients.{name}"
        if spec.kind in _EXTRAS:
            module, extra = _EXTRAS[spec.kind]
            if not _installed(module):
                problems.append(
                    f'{at}.kind: "{spec.kind}" needs the {extra!r} extra '
                    f"(pip install 'switchyard-mw[{extra}]')"
                )
        if spec.kind == "bedrock" and spec.bedrock is not None and _installed("botocore"):
            from .aws_sigv4 import offline_problems  # botocore: the `bedrock` extra

            problems.extend(f"{at}.{problem}" for problem in offline_problems(spec.bedrock))
        if spec.vertex is not None and spec.vertex.credentials_file is not None:
            for problem in credentials_file_problems(spec.vertex.credentials_file):
                problems.append(f"{at}.vertex.credentials_file: {problem}")
    return problems


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
