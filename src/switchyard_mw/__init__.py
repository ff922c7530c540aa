"""switchyard_mw: deadline, variant, cooling and judge policies for LLM gateways.

app = switchyard_stack(my_app, config="switchyard.toml")
"""

from importlib.metadata import version

from .asgi.cooling import CoolingMiddleware
from .asgi.deadline import DeadlineMiddleware
from .asgi.judge import JudgeMiddleware
from .asgi.stack import SwitchyardStack, switchyard_stack
from .asgi.variant import VariantMiddleware
from .config import Config, load_config
from .context import RequestContext, context_of, current_context
from .errors import ConfigError, StartupError, SwitchyardError
from .outbound import make_http_client, timeout_for

__version__ = version("switchyard-mw")

__all__ = [
    "Config",
    "ConfigError",
    "CoolingMiddleware",
    "DeadlineMiddleware",
    "JudgeMiddleware",
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
    "switchyard_stack",
    "timeout_for",
]
