"""Reloading the config in a running process: what both fronts share.

A reload reads the config again (the file, through the front's loader), checks it whole and
reads every key from this process's environment, as at start-up. Anything wrong refuses the
whole config: each problem is logged with its key path, `switchyard.config.reloads
{result = rejected}` counts it, and the config in force stays. Otherwise `rebuild` builds the
next engine with the same builder as at start-up (`engine.build`), keeping the health of every
account whose name and `base_url` did not change (`AccountPool.carry_over`), the state stores
and the judge's connection pool; the front swaps it in at once: a request that started keeps
the objects it started with, a new one gets the new ones.

`[state]` is not reloadable: the store is connected once per process (a changed table is
refused, with the reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping

from ..accounts import Account, build_accounts, pool_from_accounts
from ..config import Config
from ..errors import ConfigError, StartupError
from ..telemetry import logs, request_metrics
from ..telemetry import names as tm
from . import early_signal
from .build import Front, Parts, build_engine
from .early_signal import RELOAD_SIGNAL as RELOAD_SIGNAL  # its home before early_signal
from .policies import Engine

Loader = Callable[[], Config]
"""How a front gets the config again: reads and validates it, `ConfigError` when invalid."""

_log = logging.getLogger(__name__)


def rebuild(
    current: Engine, loader: Loader, front: Front, environ: Mapping[str, str] | None = None
) -> Engine | list[str]:
    """The engine of the config `loader` reads now, continuing `current` (see the module's
    docstring); or every problem that refused it (logged and counted, `current` staying)."""
    # Built by `build_engine`, which gives every engine its config and store.
    assert current.config is not None
    assert current.store is not None
    prepared = prepare(loader, current.config, environ)
    if isinstance(prepared, list):
        return prepared
    config, accounts = prepared
    old = current.pool
    pool = pool_from_accounts(accounts, clock=old.clock)
    pool.carry_over(old, accounts=kept_accounts(current.accounts, accounts))
    parts: Parts = {"pool": pool, "store": current.store, "clock": old.clock}
    if current.limit_store is not None:
        parts["limit_store"] = current.limit_store  # what was spent stays spent
    judge = current.judge
    if judge is not None and not judge.owns_http:
        parts["judge_http_client"] = judge.http
    engine = build_engine(config, accounts, front=front, environ=environ, **parts)
    if judge is not None and engine.judge is not None:
        engine.judge.take_over(judge)  # one connection pool across reloads
    request_metrics.unwatch(old)
    accepted("")
    return engine


def prepare(
    loader: Loader, current: Config, environ: Mapping[str, str] | None = None
) -> tuple[Config, dict[str, Account]] | list[str]:
    """The new config and its accounts (keys read from `environ`, default this process's
    environment), or every problem that refuses it (already logged and counted)."""
    try:
        config = loader()
        problems = _unreloadable(current, config)
        if problems:
            raise ConfigError(problems)
        return config, build_accounts(config, environ)
    except ConfigError as exc:
        return rejected(list(exc.problems))
    except StartupError as exc:
        return rejected(str(exc).split("; "))
    except Exception as exc:  # a loader's own failure must not take the process down
        return rejected([f"{type(exc).__name__}: {exc}"])


def _unreloadable(current: Config, new: Config) -> list[str]:
    if new.state != current.state:
        return ["state: changed; [state] takes effect at a restart, not a reload"]
    return []


def kept_accounts(old: Mapping[str, Account], new: Mapping[str, Account]) -> list[str]:
    """The accounts whose name and `base_url` did not change: their health carries over."""
    return [
        name
        for name, client in new.items()
        if name in old and old[name].base_url == client.base_url
    ]


def accepted(where: str) -> None:
    tm.config_reloads.add(1, {"result": "ok"})
    logs.config_reloaded(source=where.strip() or None)


def rejected(problems: list[str]) -> list[str]:
    tm.config_reloads.add(1, {"result": "rejected"})
    logs.config_rejected(problems=problems)
    return problems


def on_signal(reload: Callable[[], object]) -> bool:
    """Run `reload()` in the running event loop on each `RELOAD_SIGNAL` from now on (and
    once soon, if the signal came while `hold_early` held it).

    Installed through the loop, beside whatever handlers the server set for its own signals.
    False when it cannot be (no such signal, or not the main thread: only it gets signals).
    """
    if RELOAD_SIGNAL is None:
        return False
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(RELOAD_SIGNAL, reload)
    except (NotImplementedError, RuntimeError, ValueError):
        _log.info("config reload on SIGHUP is off: not the main thread's event loop")
        return False
    if early_signal.taken():
        loop.call_soon(reload)
    return True


def off_signal() -> None:
    """Stop reloading on `RELOAD_SIGNAL` in the running loop (if it did)."""
    if RELOAD_SIGNAL is None:
        return
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        asyncio.get_running_loop().remove_signal_handler(RELOAD_SIGNAL)
