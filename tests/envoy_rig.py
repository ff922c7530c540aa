"""The Envoy rig of the tests under tests/extproc: the mock provider, switchyard's processor on
a transport, and examples/envoy/envoy.yaml's Envoy in front of both, all on free loopback ports
(`switchyard_mw.testing.envoy.run_on_free_ports`).

A module starts its rig with the `start_rig` fixture (tests/extproc/conftest.py), giving its
config (a function of the upstream's URL) and the keys its accounts read; each test then
installs the config it needs (`Rig.configure`). Envoy runs from this test process, so it dies
with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from time import monotonic
from typing import Any

from servers import ROOT
from switchyard_mw.accounts import build_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.extproc import ExtProcServer, Policies, Transport, start_server
from switchyard_mw.testing import MockProvider
from switchyard_mw.testing.envoy import RunningEnvoy, run_on_free_ports

ENVOY_YAML = (ROOT / "examples" / "envoy" / "envoy.yaml").read_text()
"""The example's Envoy config, written with `EXAMPLE_PORTS`."""

ConfigText = Callable[..., str]
"""A module's switchyard config: a function of the URL its accounts call (and of options)."""


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@dataclass
class Rig:
    """What a rig runs, and the config it was started with, to install it again."""

    mock: MockProvider
    mock_url: str
    """The URL the config's accounts call: the mock's, or the other upstream the rig was
    started with."""
    processor: ExtProcServer
    envoy: RunningEnvoy
    config_text: ConfigText
    keys: Mapping[str, str]
    clock: Callable[[], float] = monotonic
    """What the pools of the policies installed from now on read as the time."""

    @property
    def envoy_url(self) -> str:
        return self.envoy.url

    @property
    def admin_url(self) -> str:
        assert self.envoy.admin_url is not None, "start the rig with admin=True"
        return self.envoy.admin_url

    @property
    def policies(self) -> Policies:
        """The policies the processor serves with now."""
        return self.processor.servicer.policies

    def install(self, text: str) -> Policies:
        """`text` (a switchyard config) as the processor's policies, with fresh accounts and
        a fresh pool, for the next requests."""
        config = parse_config(text)
        policies = Policies(config, build_accounts(config, self.keys), clock=self.clock)
        self.processor.servicer.policies = policies
        return policies

    def configure(self, **options: Any) -> Policies:
        """The module's config (with `options`) installed, and the mock reset: each test
        starts on a fresh pool and a provider that answers every key with a fast 200."""
        policies = self.install(self.config_text(self.mock_url, **options))
        self.mock.reset()
        return policies


@dataclass(frozen=True)
class StartRig:
    """Starts rigs on one mock and one processor transport (the `start_rig` fixture)."""

    mock: MockProvider
    mock_url: str
    transport: Transport

    @contextlib.asynccontextmanager
    async def __call__(
        self,
        config_text: ConfigText,
        keys: Mapping[str, str],
        *,
        options: Mapping[str, Any] | None = None,
        upstream: str | None = None,
        otel: int | None = None,
        admin: bool = False,
        runtime: Mapping[str, float | bool | str] | None = None,
        edit: Callable[[str], str] | None = None,
        transport: Transport | None = None,
        **server: Any,
    ) -> AsyncIterator[Rig]:
        """The processor serving `config_text(upstream, **options)` (accounts from `keys`)
        and the example's Envoy in front of it, until the block ends; the mock is reset then,
        so that the next rig (the next transport's) starts on a clean provider.

        `upstream`: another upstream's URL than the mock's (the config is written for it and
        Envoy's clusters point at its port); `transport` another than the fixture's;
        `otel`, `admin`, `runtime`, `edit`: as `run_on_free_ports` takes them (`edit` adds
        clusters, say); `server`: `start_server`'s other arguments (`h2_limits`, ...).
        """
        url = upstream if upstream is not None else self.mock_url
        config = parse_config(config_text(url, **(options or {})))
        processor = await start_server(
            Policies(config, build_accounts(config, keys)),
            "127.0.0.1:0",
            transport=transport or self.transport,
            **server,
        )
        assert processor.port is not None
        try:
            with run_on_free_ports(
                ENVOY_YAML,
                processor=processor.port,
                upstream=port_of(url),
                otel=otel,
                admin=admin,
                runtime=runtime,
                edit=edit,
            ) as envoy:
                yield Rig(self.mock, url, processor, envoy, config_text, keys)
        finally:
            await processor.stop(grace_secs=1)
            self.mock.reset()
