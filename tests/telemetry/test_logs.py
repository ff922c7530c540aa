"""The decision records and their two formats (`switchyard_mw.telemetry.logs`)."""

from __future__ import annotations

import io
import json
import logging
import logging.config
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from switchyard_mw.context import RequestContext, current_var
from switchyard_mw.telemetry import logs


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def records() -> Iterator[list[logging.LogRecord]]:
    handler = Records()
    root = logging.getLogger(logs.ROOT)
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler.records
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def _record(
    msg: object = "plain", name: str = "x", args: tuple[object, ...] = ()
) -> logging.LogRecord:
    record = logging.LogRecord(name, logging.WARNING, __file__, 1, msg, args, None)
    record.created = 1_765_000_000.25  # 2025-12-06T05:46:40.250Z
    record.msecs = 250.0
    return record


def test_a_decision_is_one_record_with_its_fields_as_attributes(
    records: list[logging.LogRecord],
) -> None:
    logs.account_cooled(
        account="a", model=None, cause="outage", period_secs=30.0, status="503", probe=False
    )
    (record,) = records
    assert record.name == "switchyard_mw.accounts"
    assert record.levelno == logging.WARNING
    assert record.__dict__["event"] == "account.cooled"
    assert record.__dict__["account"] == "a"
    assert record.__dict__["period_secs"] == 30.0
    assert "model" not in record.__dict__  # None: left out
    assert "probe" not in record.__dict__
    assert "request_id" not in record.__dict__  # not in a request
    # Without any formatter of ours the message still reads whole.
    assert record.getMessage() == "account cooled account=a cause=outage period_secs=30 status=503"
    assert record.filename == Path(__file__).name  # where the decision was called from


def test_records_of_one_request_share_its_id(records: list[logging.LogRecord]) -> None:
    ctx = RequestContext()
    token = current_var.set(ctx)
    try:
        logs.throttle_hold(account="a", model="m", hold_secs=1.23456)
        logs.fallback(from_model="m", to_model="n", reason="unavailable")
    finally:
        current_var.reset(token)
    first, second = records
    assert first.__dict__["request_id"] == second.__dict__["request_id"] == ctx.request_id
    assert len(ctx.request_id) == 16
    assert first.__dict__["hold_secs"] == 1.235
    assert not hasattr(RequestContext(), "request_id")  # made by a record only


def test_a_disabled_level_builds_nothing(records: list[logging.LogRecord]) -> None:
    logging.getLogger(logs.ROOT).setLevel(logging.WARNING)
    ctx = RequestContext()
    token = current_var.set(ctx)
    try:
        logs.account_recovered(account="a", model="m")  # INFO
    finally:
        current_var.reset(token)
    assert records == []
    assert not hasattr(ctx, "request_id")


def test_text_format() -> None:
    formatter = logs.TextFormatter()
    event = logs.Event("config.reload", "config reload rejected", {"problems": ["a.b: bad x"]})
    assert formatter.format(_record(event, name="switchyard_mw.config")) == (
        "2025-12-06T05:46:40.250Z WARNING switchyard_mw.config config reload rejected "
        'problems=["a.b: bad x"]'
    )
    plain = _record("Started server process [%d]", name="uvicorn.error", args=(7,))
    assert formatter.format(plain) == (
        "2025-12-06T05:46:40.250Z WARNING uvicorn.error Started server process [7]"
    )
    spaced = logs.Event("e", "phrase", {"a": "two words", "b": "", "c": True, "d": 0.5})
    assert str(spaced) == 'phrase a="two words" b="" c=True d=0.5'
    forged = logs.Event("e", "phrase", {"a": "x\n2026 ERROR forged", "b": "k=v", "c": 'q"'})
    assert str(forged) == 'phrase a="x\\n2026 ERROR forged" b="k=v" c="q\\""'


def test_json_format_of_a_decision() -> None:
    event = logs.Event("account.cooled", "account cooled", {"request_id": "r1", "account": "a"})
    line = logs.JsonFormatter().format(_record(event, name="switchyard_mw.accounts"))
    assert "\n" not in line
    assert json.loads(line) == {
        "time": "2025-12-06T05:46:40.250Z",
        "level": "WARNING",
        "logger": "switchyard_mw.accounts",
        "message": "account cooled",
        "event": "account.cooled",
        "request_id": "r1",
        "account": "a",
    }


def test_json_format_of_uvicorn_access_extra_and_exception() -> None:
    formatter = logs.JsonFormatter()
    access = _record(
        '%s - "%s %s HTTP/%s" %d',
        name="uvicorn.access",
        args=("127.0.0.1:5000", "POST", "/v1/messages", "1.1", 200),
    )
    parsed = json.loads(formatter.format(access))
    assert parsed["message"] == '127.0.0.1:5000 - "POST /v1/messages HTTP/1.1" 200'
    assert (parsed["client"], parsed["method"], parsed["path"], parsed["status"]) == (
        "127.0.0.1:5000",
        "POST",
        "/v1/messages",
        200,
    )
    # Another library's `extra` comes out as fields; uvicorn's coloured copy does not.
    other = _record("hello")
    other.__dict__.update({"color_message": "\x1b[1mhello", "peer": "x"})
    assert json.loads(formatter.format(other))["peer"] == "x"
    assert "color_message" not in json.loads(formatter.format(other))
    try:
        raise ValueError("boom")
    except ValueError:
        failed = _record("Exception in ASGI application")
        failed.exc_info = sys.exc_info()
    parsed = json.loads(formatter.format(failed))
    assert parsed["message"] == "Exception in ASGI application"
    assert parsed["exception"].startswith("Traceback (most recent call last):")
    assert parsed["exception"].endswith("ValueError: boom")


def _configure(config: dict[str, object], stream: io.StringIO) -> None:
    config["handlers"]["default"]["stream"] = stream  # type: ignore[index]
    logging.config.dictConfig(config)


@pytest.fixture
def restored_logging() -> Iterator[None]:
    names = [logs.ROOT, "uvicorn", "uvicorn.error", "uvicorn.access", ""]
    saved = {
        n: (lg.handlers[:], lg.level, lg.propagate, lg.filters[:])
        for n in names
        for lg in [logging.getLogger(n)]
    }
    try:
        yield
    finally:
        for n, (handlers, level, propagate, filters) in saved.items():
            lg = logging.getLogger(n)
            lg.handlers, lg.level, lg.propagate, lg.filters = handlers, level, propagate, filters


@pytest.mark.usefixtures("restored_logging")
def test_the_dict_config_puts_ours_and_uvicorns_in_one_json_stream() -> None:
    stream = io.StringIO()
    _configure(logs.logging_config("json"), stream)
    logs.guard_tripped(model="m", variant="v", here=True)
    logging.getLogger("uvicorn.error").info("Uvicorn running on %s", "http://x")
    logging.getLogger("uvicorn.access").info("%s", "line")
    logging.getLogger("some.library").info("not at INFO")  # other libraries: WARNING and up
    logging.getLogger("some.library").warning("shown")
    parsed = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(p["logger"], p["message"]) for p in parsed] == [
        ("switchyard_mw.canaries", "canary guard tripped"),
        ("uvicorn.error", "Uvicorn running on http://x"),
        ("uvicorn.access", "line"),
        ("some.library", "shown"),
    ]
    assert parsed[0]["variant"] == "v"


@pytest.mark.usefixtures("restored_logging")
def test_a_thread_apart_logs_to_its_own_file(tmp_path: Path) -> None:
    stream, apart = io.StringIO(), tmp_path / "mock.log"
    _configure(logs.logging_config("text", apart={"mock-provider": str(apart)}), stream)

    def mock_side() -> None:
        logging.getLogger("uvicorn.error").error("Exception in ASGI application")

    thread = threading.Thread(target=mock_side, name="mock-provider")
    thread.start()
    thread.join()
    logging.getLogger("uvicorn.error").info("gateway line")
    assert "Exception in ASGI application" not in stream.getvalue()
    assert "gateway line" in stream.getvalue()
    assert "Exception in ASGI application" in apart.read_text()
    assert "gateway line" not in apart.read_text()
    for handler in logging.getLogger().handlers:
        handler.close()


def test_limit_refused_record(records: list[logging.LogRecord]) -> None:
    logs.limit_refused(tenant="team-a", limit="tokens/minute", model="m", retry_after_secs=12.0)
    (record,) = records
    assert (record.name, record.levelno) == ("switchyard_mw.limits", logging.WARNING)
    assert record.getMessage() == (
        "limit refused a request tenant=team-a limit=tokens/minute model=m retry_after_secs=12"
    )


@pytest.mark.usefixtures("restored_logging")
def test_the_level_applies_to_uvicorns_access_lines_as_its_own_flag_does() -> None:
    stream = io.StringIO()
    _configure(logs.logging_config("text", level="WARNING"), stream)
    logging.getLogger("uvicorn.access").info("%s", "a request")
    logs.account_recovered(account="a", model=None)  # INFO: left out too
    logs.fallback(from_model="m", to_model="n", reason="unavailable")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    assert lines[0].endswith(
        " WARNING switchyard_mw.routing fallback to another model"
        " from_model=m to_model=n reason=unavailable"
    )


@pytest.mark.usefixtures("otel_spans")
def test_a_record_under_a_span_carries_its_trace_id(records: list[logging.LogRecord]) -> None:
    from opentelemetry import trace

    with trace.get_tracer("test").start_as_current_span("request") as span:
        logs.fallback(from_model="m", to_model="n", reason="unavailable")
    (record,) = records
    assert record.__dict__["trace_id"] == format(span.get_span_context().trace_id, "032x")


def _ids_of(headers: list[tuple[bytes, bytes]], records: list[logging.LogRecord]) -> str:
    ctx = RequestContext()
    ctx.headers = headers
    token = current_var.set(ctx)
    try:
        logs.throttle_hold(account="a", model="m", hold_secs=1.0)
        logs.fallback(from_model="m", to_model="n", reason="unavailable")
    finally:
        current_var.reset(token)
    first, second = records[-2:]
    assert first.__dict__["request_id"] == second.__dict__["request_id"] == ctx.request_id
    return ctx.request_id


def test_the_clients_request_id_is_the_records(records: list[logging.LogRecord]) -> None:
    """A client's `x-request-id` (read when the first record is made) names the request in
    the log, so its own logs and the gateway's meet."""
    headers = [(b"content-type", b"application/json"), (b"x-request-id", b"req_01J-abc.9:x")]
    assert _ids_of(headers, records) == "req_01J-abc.9:x"
    longest = b"a" * logs.REQUEST_ID_MAX
    assert _ids_of([(b"x-request-id", longest)], records) == longest.decode()


@pytest.mark.parametrize(
    "unsafe",
    [
        b"a" * (logs.REQUEST_ID_MAX + 1),  # too long
        b"",
        b"two words",
        b'quote"d',
        b"x\nERROR forged",
        b"caf\xc3\xa9",
        b"k=v",
    ],
)
def test_an_unsafe_client_request_id_is_replaced(
    unsafe: bytes, records: list[logging.LogRecord]
) -> None:
    made = _ids_of([(b"x-request-id", unsafe)], records)
    assert len(made) == 16
    assert made != unsafe.decode("latin-1")


def test_request_id_from() -> None:
    assert logs.request_id_from(b"0f8fad5b-d9cb-469f-a165-70867728950e") == (
        "0f8fad5b-d9cb-469f-a165-70867728950e"
    )
    assert logs.request_id_from("rid-1") == "rid-1"
    made = {logs.request_id_from(None), logs.request_id_from(b"bad id")}
    assert all(len(rid) == 16 for rid in made)
    assert len(made) == 2
