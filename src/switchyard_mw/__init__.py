"""switchyard_mw: deadline, variant, cooling and judge policies for LLM gateways.

app = switchyard_stack(my_app, config="switchyard.toml")
"""

from __future__ import annotations

# Not `typing.TYPE_CHECKING`: importing `typing` alone would double this module's cost.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .asgi.cooling import CoolingMiddleware
    from .asgi.deadline import DeadlineMiddleware
    from .asgi.judge_middleware import JudgeMiddleware
    from .asgi.relay import relay_stream
    from .asgi.stack import SwitchyardStack, switchyard_stack
    from .asgi.variant import VariantMiddleware
    from .clients.outbound import make_http_client, timeout_for
    from .config import Config, load_config
    from .context import RequestContext, context_of, current_context
    from .errors import ConfigError, MissingExtraError, StartupError, SwitchyardError

    __version__: str

# Where each public name lives. Imported on first use (PEP 562), so that `import switchyard_mw`
# costs nearly nothing and loads no HTTP client, gRPC or OpenTelemetry SDK module: a process
# that only serves ext_proc, or only reads a config, never pays for the middlewares.
_HOMES = {
    "Config": "config",
    "ConfigError": "errors",
    "CoolingMiddleware": "asgi.cooling",
    "DeadlineMiddleware": "asgi.deadline",
    "JudgeMiddleware": "asgi.judge_middleware",
    "MissingExtraError": "errors",
    "RequestContext": "context",
    "StartupError": "errors",
    "SwitchyardError": "errors",
    "SwitchyardStack": "asgi.stack",
    "VariantMiddleware": "asgi.variant",
    "context_of": "context",
    "current_context": "context",
    "load_config": "config",
    "make_http_client": "clients.outbound",
    "relay_stream": "asgi.relay",
    "switchyard_stack": "asgi.stack",
    "timeout_for": "clients.outbound",
}

__all__ = [
    "Config",
    "ConfigError",
    "CoolingMiddleware",
    "DeadlineMiddleware",
    "JudgeMiddleware",
    "MissingExtraError",
    "RequestContext",
    "StartupError",
    "SwitchyardError",
    "SwitchyardStack",
    "VariantMiddleware",
    "__version__",
    "context_of",
    "current_context",
    "load_config",
    "make_http_client",
    "relay_stream",
    "switchyard_stack",
    "timeout_for",
]


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from importlib.metadata import version

        value: Any = version("switchyard-mw")
    elif name in _HOMES:
        from importlib import import_module

        value = getattr(import_module(f".{_HOMES[name]}", __name__), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
