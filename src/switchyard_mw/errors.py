"""Every exception switchyard raises on purpose, in one tree: `except SwitchyardError` catches them.

SwitchyardError
├── ConfigError                 the config file is missing, unreadable or invalid (every problem)
├── StartupError                the config is valid, but a key's env variable is unset, ...
│   └── ListenError             ... or the ext_proc server cannot listen (an OSError too)
├── MissingExtraError           a feature's optional dependencies are missing (an ImportError too)
├── WireError                   a request the wire refuses: 400, 404, 413, ... in its error format
├── ClientDisconnected          the caller left while its request body was read
├── DeadlineExceededAfterStart  a started non-stream answer's deadline expired: it is dropped
├── BadVerdict                  the judge's reply is not one of the route's labels (a ValueError)
├── FramingError                bytes that are not an AWS event stream (a Bedrock stream's)
├── JudgeHTTPError              the judge answered with a non-2xx status
├── MockProviderFault           `testing.MockProvider` aborts an answer (a RuntimeError)
├── MachineError                an attempt machine was given an event out of place (a bug)
├── CloudCredentialError        a cloud account got no token or signature (names the account)
└── TransportError              an outbound call failed in transport (each also httpx's namesake)
    ├── TimeoutException
    │   ├── ConnectTimeout
    │   ├── ReadTimeout
    │   ├── WriteTimeout
    │   └── PoolTimeout
    ├── NetworkError
    │   ├── ConnectError        refused, unresolvable, unreachable
    │   ├── ReadError
    │   └── WriteError
    ├── ProtocolError
    │   ├── LocalProtocolError
    │   └── RemoteProtocolError the upstream hung up before or while answering, or spoke garbage
    ├── ProxyError
    └── UnsupportedProtocol

The outbound ones come from one place, `clients.mapped_errors.map_exceptions()`, around every
call switchyard makes upstream (the clients `make_http_client()` builds, over aiohttp or httpx's
own pool, the forwarder's direct sends, the judge, shadows): whichever client failed, the
same failure is the same class. Each derives from the httpx exception of its name, so code
that catches httpx's (`except httpx.ConnectError`) keeps working unchanged.

`SwitchyardError` and `BadVerdict` are defined in `core.base_errors`, as the sans-IO core raises
`BadVerdict` and imports nothing above itself. `TransportError` and its subclasses are defined
in `_transport_errors` and loaded on first use (`errors.ConnectError`, or `from
switchyard_mw.errors import ConnectError`): they import httpx, which reading a config need not
load. Every name in the tree is importable from here; those that moved here are still
importable where they were (`wire.WireError`, `asgi.body.ClientDisconnected`,
`core.judge_verdicts.BadVerdict`, formerly `core.judge`; `engine.judge.JudgeHTTPError`,
`asgi.deadline.DeadlineExceededAfterStart`, `testing.MockProviderFault`).
"""

from collections.abc import Sequence

from .core.base_errors import BadVerdict, FramingError, SwitchyardError

TYPE_CHECKING = False  # not `typing`'s: this module loads with every config read
if TYPE_CHECKING:
    from ._transport_errors import (
        ConnectError,
        ConnectTimeout,
        LocalProtocolError,
        NetworkError,
        PoolTimeout,
        ProtocolError,
        ProxyError,
        ReadError,
        ReadTimeout,
        RemoteProtocolError,
        TimeoutException,
        TransportError,
        UnsupportedProtocol,
        WriteError,
        WriteTimeout,
    )

__all__ = [
    "BadVerdict",
    "ClientDisconnected",
    "CloudCredentialError",
    "ConfigError",
    "ConnectError",
    "ConnectTimeout",
    "DeadlineExceededAfterStart",
    "FramingError",
    "JudgeHTTPError",
    "ListenError",
    "LocalProtocolError",
    "MachineError",
    "MissingExtraError",
    "MockProviderFault",
    "NetworkError",
    "PoolTimeout",
    "ProtocolError",
    "ProxyError",
    "ReadError",
    "ReadTimeout",
    "RemoteProtocolError",
    "StartupError",
    "SwitchyardError",
    "TimeoutException",
    "TransportError",
    "UnsupportedProtocol",
    "WireError",
    "WriteError",
    "WriteTimeout",
]


class ConfigError(SwitchyardError):
    """The config is invalid; `problems` holds one `key.path: rule` line per problem."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = tuple(problems)
        super().__init__("invalid config:\n" + "\n".join(f"  {p}" for p in self.problems))


class StartupError(SwitchyardError):
    """The config is valid, but something it names is missing from the environment."""


class ListenError(StartupError, OSError):
    """The ext_proc server cannot listen on its address (taken, or not this host's).

    An `OSError` too, as it was before it had a class of its own.
    """


class MissingExtraError(SwitchyardError, ImportError):
    """A feature was used whose extra is not installed; the message says which to install.

    An `ImportError` too, so code that already guards an optional import keeps working.
    """

    def __init__(self, feature: str, extra: str, cause: ImportError) -> None:
        self.extra = extra
        super().__init__(
            f"{feature} needs the {extra!r} extra: {install_hint(extra)}"
            f" (missing: {cause.name or cause})",
            name=cause.name,
        )


_DISTRIBUTION = "switchyard-mw"


def install_hint(extra: str, *, requires: Sequence[str] | None = None) -> str:
    """How to install `extra`, in the forms that work before a release is on an index too.

    `pip install 'switchyard-mw[x]'` needs the package on an index; from a clone it is
    `pip install '.[x]'`; and the extra's packages alone always work. Those are read from the
    installed package's metadata (`requires`: its requirement lines instead).
    """
    if requires is None:
        requires = _installed_requires()
    hint = f"pip install '{_DISTRIBUTION}[{extra}]' (from a clone: pip install '.[{extra}]')"
    packages = _extra_packages(extra, requires, set())
    if packages:
        hint += ", or the packages alone: pip install " + " ".join(f"'{p}'" for p in packages)
    return hint


def _installed_requires() -> list[str]:
    import importlib.metadata  # here: it imports much, and only a failure needs it

    try:
        return importlib.metadata.requires(_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, say
        return []


def _extra_packages(extra: str, requires: Sequence[str], seen: set[str]) -> list[str]:
    """The requirements `extra` adds, an extra it names (`switchyard-mw[a,b]`) expanded."""
    seen.add(extra)
    packages: list[str] = []
    for line in requires:
        spec, _, marker = line.partition(";")
        if marker.replace('"', "'").split() != ["extra", "==", f"'{extra}'"]:
            continue
        spec = spec.strip()
        if spec.startswith(_DISTRIBUTION + "["):
            for inner in spec[len(_DISTRIBUTION) + 1 :].rstrip("]").split(","):
                if inner.strip() not in seen:
                    packages += _extra_packages(inner.strip(), requires, seen)
        elif spec not in packages:
            packages.append(spec)
    return packages


class WireError(SwitchyardError):
    """A request the wire reader refuses; `status` and `error_type` go into the wire's error."""

    def __init__(self, status: int, error_type: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message


class ClientDisconnected(SwitchyardError):
    """The client left while switchyard was still reading its request."""


class DeadlineExceededAfterStart(SwitchyardError):
    """A non-stream response that had started when its deadline expired; the server drops it."""


class JudgeHTTPError(SwitchyardError):
    """The judge answered with a non-2xx status (the first argument)."""


class MachineError(SwitchyardError, RuntimeError):
    """An event the attempt machine cannot take in its state: a driver's bug, never a peer's."""


class CloudCredentialError(SwitchyardError):
    """A `vertex` or `bedrock` account could not get its credential: its token endpoint
    refused or did not answer in time, its key file is unreadable. The message names the
    account, never a key or a token. `refused`: the credentials were turned down (an account
    fault for every model, as a 401), not merely unreachable."""

    def __init__(self, account: str, message: str, *, refused: bool) -> None:
        self.account = account
        self.refused = refused
        super().__init__(f"account {account!r}: {message}")


class MockProviderFault(SwitchyardError, RuntimeError):
    """Raised inside `testing.MockProvider`'s app to make the server abort a response."""


def __getattr__(name: str) -> type[SwitchyardError]:
    # PEP 562: the transport errors (and httpx with them) load on first use.
    if name in _TRANSPORT_ERRORS:
        from . import _transport_errors

        value: type[SwitchyardError] = getattr(_transport_errors, name)
        globals()[name] = value  # the next lookup is a plain attribute
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_TRANSPORT_ERRORS = frozenset(
    {
        "ConnectError",
        "ConnectTimeout",
        "LocalProtocolError",
        "NetworkError",
        "PoolTimeout",
        "ProtocolError",
        "ProxyError",
        "ReadError",
        "ReadTimeout",
        "RemoteProtocolError",
        "TimeoutException",
        "TransportError",
        "UnsupportedProtocol",
        "WriteError",
        "WriteTimeout",
    }
)
