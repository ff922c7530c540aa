"""Reloading the ext_proc server's config (SIGHUP): the same rules as the ASGI stack's.

The servicer's policies are replaced at once; each stream keeps the policies it opened with,
and a request's upstream-level streams use the ones its router-level stream started with
(`Flight.policies`), so a request under way finishes on the config it started with.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..config import Config, load_config
from ..engine import reload
from ..engine.build import Front
from ..errors import ConfigError
from .policy import Policies
from .servicer import ExtProcServicer

NO_CLUSTER = (
    "no llm_clients entry sets envoy_cluster, so Envoy could reach no account; "
    "set it to the Envoy cluster that reaches each account's base_url"
)


def load_extproc_config(path: str | os.PathLike[str]) -> Config:
    """The config at `path` as the ext_proc server takes it: valid, and with at least one
    account Envoy can reach; `ConfigError` otherwise. Picklable with `functools.partial`, so
    `--workers` children get it as their loader."""
    config = load_config(path)
    if not any(client.envoy_cluster for client in config.llm_clients.values()):
        raise ConfigError([f"llm_clients: {NO_CLUSTER}"])
    return config


def reload_policies(
    servicer: ExtProcServicer, loader: reload.Loader, environ: Mapping[str, str] | None = None
) -> list[str]:
    """Put the config `loader` reads in force for new streams; the problems that refused it
    (logged and counted, the old config staying), or an empty list."""
    engine = reload.rebuild(servicer.policies.engine, loader, Front.ENVOY, environ)
    if isinstance(engine, list):
        return engine
    servicer.policies = Policies.of(engine)
    return []
