"""The exceptions switchyard raises at its boundaries.

SwitchyardError
├── ConfigError       the config file is missing, unreadable or invalid (every problem listed)
├── StartupError      the config is valid, but a key's env variable is unset
└── MissingExtraError a feature's optional dependencies are not installed (an ImportError too)
"""

from collections.abc import Sequence


class SwitchyardError(Exception):
    """Base of every exception switchyard raises on purpose."""


class ConfigError(SwitchyardError):
    """The config is invalid; `problems` holds one `key.path: rule` line per problem."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = tuple(problems)
        super().__init__("invalid config:\n" + "\n".join(f"  {p}" for p in self.problems))


class StartupError(SwitchyardError):
    """The config is valid, but something it names is missing from the environment."""


class MissingExtraError(SwitchyardError, ImportError):
    """A feature was used whose extra is not installed; the message says which to install.

    An `ImportError` too, so code that already guards an optional import keeps working.
    """

    def __init__(self, feature: str, extra: str, cause: ImportError) -> None:
        self.extra = extra
        super().__init__(
            f"{feature} needs the {extra!r} extra: pip install 'switchyard-mw[{extra}]'"
            f" (missing: {cause.name or cause})",
            name=cause.name,
        )
