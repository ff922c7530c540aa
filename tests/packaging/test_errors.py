"""One exception tree: everything switchyard raises on purpose is a `SwitchyardError`.

A user wraps config loading, startup and outbound calls in one `except SwitchyardError`.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import switchyard_mw
from switchyard_mw import errors
from switchyard_mw.accounts import build_accounts
from switchyard_mw.clients.outbound import make_http_client
from switchyard_mw.config import load_config, parse_config

CONFIG = """
[llm_clients.a]
base_url = "http://127.0.0.1:9"
api_key_env = "KEY_A"
models = ["m"]
envoy_cluster = "prov"
"""


def package_exceptions() -> list[type[BaseException]]:
    """Every exception class defined in the package's own modules (generated protos aside)."""
    found: set[type[BaseException]] = set()
    for info in pkgutil.walk_packages(switchyard_mw.__path__, "switchyard_mw."):
        if "._protos" in info.name:
            continue
        module = importlib.import_module(info.name)
        for _, value in inspect.getmembers(module, inspect.isclass):
            if issubclass(value, BaseException) and value.__module__.startswith("switchyard_mw."):
                found.add(value)
    return sorted(found, key=lambda cls: f"{cls.__module__}.{cls.__qualname__}")


def test_every_exception_the_package_defines_is_a_switchyard_error() -> None:
    defined = package_exceptions()
    assert errors.WireError in defined  # the walk did reach the modules
    strays = [
        f"{c.__module__}.{c.__qualname__}"
        for c in defined
        if not issubclass(c, errors.SwitchyardError)
    ]
    assert strays == []


def test_every_exception_lives_in_the_one_tree() -> None:
    # Defined in `errors` (the sans-IO core's in `core.base_errors`, the transport errors, which
    # import httpx, in `_transport_errors`), drawn at its top, every one importable from it.
    homes = ("errors", "core.base_errors", "_transport_errors")
    for cls in package_exceptions():
        assert cls.__module__ in [f"switchyard_mw.{home}" for home in homes], cls
        assert getattr(errors, cls.__name__) is cls
        assert cls.__name__ in errors.__all__
        assert cls.__name__ in (errors.__doc__ or "")


def test_names_that_moved_still_import_from_where_they_were() -> None:
    from switchyard_mw.asgi.body import ClientDisconnected
    from switchyard_mw.asgi.deadline import DeadlineExceededAfterStart
    from switchyard_mw.core.judge_verdicts import BadVerdict
    from switchyard_mw.engine.judge import JudgeHTTPError
    from switchyard_mw.testing import MockProviderFault
    from switchyard_mw.wire import WireError

    assert ClientDisconnected is errors.ClientDisconnected
    assert DeadlineExceededAfterStart is errors.DeadlineExceededAfterStart
    assert BadVerdict is errors.BadVerdict
    assert JudgeHTTPError is errors.JudgeHTTPError
    assert MockProviderFault is errors.MockProviderFault
    assert WireError is errors.WireError
    assert switchyard_mw.SwitchyardError is errors.SwitchyardError


def test_what_they_were_before_they_are_still() -> None:
    # Code that caught the built-in or httpx class keeps catching.
    assert issubclass(errors.BadVerdict, ValueError)
    assert issubclass(errors.MockProviderFault, RuntimeError)
    assert issubclass(errors.MissingExtraError, ImportError)
    assert issubclass(errors.ListenError, OSError)
    for name in errors.__all__:
        cls = getattr(errors, name)
        if issubclass(cls, errors.TransportError):
            assert issubclass(cls, getattr(httpx, name)), name


def test_reading_a_config_loads_no_http_client() -> None:
    # The tree's transport errors are httpx's too: they load on first use, not with a config.
    code = (
        "import sys\n"
        "from switchyard_mw.config import load_config\n"
        "from switchyard_mw.errors import ConfigError, SwitchyardError\n"
        "print('httpx' in sys.modules)\n"
        "from switchyard_mw.errors import ConnectError\n"
        "print('httpx' in sys.modules, issubclass(ConnectError, SwitchyardError))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "True", "True"]


def test_config_loading_raises_a_switchyard_error(tmp_path: Path) -> None:
    with pytest.raises(errors.SwitchyardError, match="no such file"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text('[llm_clients.a]\nbase_url = "http://x"\nmodels = []\nbogus = 1\n')
    with pytest.raises(errors.SwitchyardError, match="bogus"):
        load_config(bad)


def test_a_missing_key_at_startup_is_a_switchyard_error() -> None:
    with pytest.raises(errors.SwitchyardError, match="KEY_A"):
        build_accounts(parse_config(CONFIG), {})


async def test_an_extproc_server_that_cannot_listen_is_a_switchyard_error() -> None:
    from switchyard_mw.extproc import Policies, start_server

    config = parse_config(CONFIG)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for transport in ("frames", "h2", "grpcio"):
            policies = Policies(config, build_accounts(config, {"KEY_A": "ka"}))
            with pytest.raises(errors.SwitchyardError, match="cannot listen") as info:
                await start_server(policies, f"127.0.0.1:{port}", transport=transport)
            assert isinstance(info.value, errors.ListenError)
            await policies.aclose()


async def test_an_outbound_call_that_fails_is_a_switchyard_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        async with make_http_client() as http:
            with pytest.raises(errors.SwitchyardError):
                await http.post(f"http://127.0.0.1:{port}/", content=b"{}")


# --- what to install: the hint every missing-extra message carries ---------------------------

REQUIRES = [
    "msgspec>=0.19",
    "aiohttp>=3.10; extra == 'gateway'",
    'httpx-aiohttp>=0.2.0; extra == "gateway"',
    "redis>=5; extra == 'redis'",
    "uvicorn>=0.30; extra == 'example'",
    "switchyard-mw[gateway,redis]; extra == 'example'",
]


def test_an_install_hint_names_the_extra_the_clone_form_and_the_packages_alone() -> None:
    hint = errors.install_hint("gateway", requires=REQUIRES)
    assert hint == (
        "pip install 'switchyard-mw[gateway]' (from a clone: pip install '.[gateway]'), "
        "or the packages alone: pip install 'aiohttp>=3.10' 'httpx-aiohttp>=0.2.0'"
    )


def test_an_extra_that_names_other_extras_lists_their_packages_too() -> None:
    hint = errors.install_hint("example", requires=REQUIRES)
    assert hint.endswith(
        "pip install 'uvicorn>=0.30' 'aiohttp>=3.10' 'httpx-aiohttp>=0.2.0' 'redis>=5'"
    )


def test_without_the_package_metadata_the_hint_still_names_the_extra() -> None:
    hint = errors.install_hint("redis", requires=())
    assert hint == "pip install 'switchyard-mw[redis]' (from a clone: pip install '.[redis]')"


def test_the_installed_metadata_gives_the_redis_extra_its_package() -> None:
    assert "'redis>=" in errors.install_hint("redis")


def test_a_missing_extra_error_carries_the_whole_hint() -> None:
    exc = errors.MissingExtraError("the thing", "redis", ImportError("x", name="redis"))
    assert errors.install_hint("redis") in str(exc)
    assert "(missing: redis)" in str(exc)
