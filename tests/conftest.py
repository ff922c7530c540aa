"""Shared fixtures: one in-memory OpenTelemetry pipeline for the whole test session.

The global meter and tracer providers can be set only once per process, so every test that
asserts telemetry reads from these, comparing counts before and after what it does.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from metric_reading import Metrics
from switchyard_mw.extproc import TRANSPORTS
from switchyard_mw.telemetry import request_metrics

_READER = request_metrics.bridge(InMemoryMetricReader())
_SPANS = InMemorySpanExporter()
metrics.set_meter_provider(MeterProvider(metric_readers=[_READER]))
_tracer_provider = TracerProvider()
_tracer_provider.add_span_processor(SimpleSpanProcessor(_SPANS))
trace.set_tracer_provider(_tracer_provider)


@pytest.fixture(scope="session")
def otel_metrics() -> Metrics:
    return Metrics(_READER)


@pytest.fixture
def otel_spans() -> Iterator[InMemorySpanExporter]:
    _SPANS.clear()
    yield _SPANS
    _SPANS.clear()


ENVOY_TRANSPORTS = tuple(os.environ.get("SWITCHYARD_TEST_TRANSPORTS", "frames,grpcio").split(","))
"""The transports every Envoy test runs on: the default (`frames`) and gRPC's own. `h2` shares
all but its frame engine with `frames` (one `_Connection`), and its engine has its own suites
(the hostile peers, the h2 transport tests): a third pass of every Envoy test would add about
184 of them to CI's run for code those cover. `SWITCHYARD_TEST_TRANSPORTS=frames,h2,grpcio`
runs all three."""
assert set(ENVOY_TRANSPORTS) <= set(TRANSPORTS), ENVOY_TRANSPORTS


@pytest.fixture(scope="module", params=ENVOY_TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    """The ext_proc server's transport: every test that serves ext_proc runs on each of
    `ENVOY_TRANSPORTS`."""
    param: str = request.param
    return param


# In CI every tool a test needs is installed by .ci/run: a test that would skip for want of
# one (Envoy, Prometheus, h2load, valgrind, a Redis binary) fails there instead of passing
# unseen. On a developer's machine it still skips, saying what to install.
_MISSING_TOOL = re.compile(r"not installed|no Envoy binary|needs Debian")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if os.environ.get("CI") == "true" and report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2])
        if _MISSING_TOOL.search(reason):
            report.outcome = "failed"
            report.longrepr = f"skipped in CI, where .ci/run installs what it needs: {reason}"


# The suite runs on two pytest-xdist workers (pyproject's addopts: `-n 2`): every test of a
# file that starts servers (marked `integration`) goes to one group, run in order on one
# worker as it would run alone (its module-scoped servers started once, its timing margins as
# measured), while the rest take the other core. The benchmark's smoke runs (tests/bench:
# about five minutes of installs and servers under valgrind, which check that each script
# runs and writes its report, not its figures) are a group of their own, on that other core
# first. `-n 0` runs everything in this one process. (xdist's own `--dist loadgroup` does not
# group under pytest 9.2, whose node ids can no longer be renamed: a scheduler of ours does.)
_INTEGRATION = "integration"
_BENCH = "tests/bench/"


@functools.cache
def _starts_servers(path: str) -> bool:
    """Whether the test file at `path` (relative to the root) has `integration` tests."""
    file = Path(__file__).resolve().parents[1] / path
    return file.is_file() and "mark.integration" in file.read_text(errors="replace")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class ServersApart(LoadScopeScheduling):
        """One scope for the benchmark's smoke runs, one for the other files that start
        servers, one per test for the rest. The largest go first (xdist orders scopes by
        their number of tests): the servers' to one worker, the bench's to the other."""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if path.startswith(_BENCH):
                return _BENCH
            return _INTEGRATION if _starts_servers(path) else nodeid

    return ServersApart(config, log)
