"""The gateway's decision records, and the formats they (and uvicorn's lines) go out in.

Every decision an operator wants to read later (an account cooled or back, a probe's result,
a hold, a fallback, a hedge's result, a resumed stream, a guard trip, a reload, a limit refusal)
is one record on a child of the `switchyard_mw` logger, built by :func:`decision`: a level, a
fixed phrase, the event's name, the request id and the event's fields as the record's `extra`
attributes, so a handler reads `record.account`, never a sentence. Records are made only for
decisions, which are rare: the usual request makes none.

Without any logging config a record still reads whole (`account cooled account=a cause=outage
period_secs=30`): its message renders the fields. `logging_config("json")` (what
`switchyard-mw serve --log-format json` passes to uvicorn) writes one JSON object per line for
every record, uvicorn's own included.
"""

from __future__ import annotations

import json
import logging
import logging.config
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from opentelemetry import trace

from ..context import current_context

LogFormat = Literal["text", "json"]

ROOT = "switchyard_mw"
ACCOUNTS = logging.getLogger(f"{ROOT}.accounts")
"""Cooling, recovery, probes, throttle holds, failed attempts."""
ROUTING = logging.getLogger(f"{ROOT}.routing")
"""Fallbacks, hedges, resumed streams."""
CANARIES = logging.getLogger(f"{ROOT}.canaries")
CONFIG = logging.getLogger(f"{ROOT}.config")
LIMITS = logging.getLogger(f"{ROOT}.limits")

Value = str | int | float | bool | None | list[str]


class Event:
    """A decision record's message: a fixed phrase and its fields, rendered only when a
    handler formats the record (`str()`: the phrase, then `key=value` for each field)."""

    __slots__ = ("fields", "name", "phrase")

    def __init__(self, name: str, phrase: str, fields: Mapping[str, Value]) -> None:
        self.name = name
        self.phrase = phrase
        self.fields = fields

    def __str__(self) -> str:
        return " ".join([self.phrase, *(f"{k}={_text(v)}" for k, v in self.fields.items())])


def decision(logger: logging.Logger, level: int, name: str, phrase: str, **fields: Value) -> None:
    """Log decision `name` (e.g. `account.cooled`) with its fields, the request's id (when it
    happens in a request) and the trace id (when tracing); fields whose value is None are left
    out. The fields are the record's attributes too (`extra`), so any handler reads them: none
    may be named as a `LogRecord` attribute (`name`, `msg`, `args`, `module`...)."""
    _decide(logger, level, name, phrase, fields)


def _decide(
    logger: logging.Logger, level: int, name: str, phrase: str, fields: dict[str, Value]
) -> None:
    """`decision`, called by it or by one of the functions below: the record names their
    caller as where it was made (`stacklevel`)."""
    if not logger.isEnabledFor(level):
        return
    ids = _request_ids()
    kept = {k: v for k, v in fields.items() if v is not None}
    event = Event(name, phrase, {**ids, **kept})
    logger.log(level, event, extra={"event": name, **ids, **kept}, stacklevel=3)


REQUEST_ID_HEADER = b"x-request-id"
REQUEST_ID_MAX = 128
"""The longest client request id taken as it is (a UUID is 36 characters)."""
_SAFE_ID = re.compile(r"[0-9A-Za-z._:-]+")
"""What a client's request id may hold to be taken: it goes into every line as one word."""


def request_id_from(raw: bytes | str | None) -> str:
    """A request's id for its records: `raw` (a client's or Envoy's `x-request-id`) when it
    is at most `REQUEST_ID_MAX` safe characters (letters, digits, `.`, `_`, `:`, `-`), else
    a new one (16 hex digits)."""
    if isinstance(raw, bytes):
        raw = raw.decode("latin-1")
    if raw is not None and len(raw) <= REQUEST_ID_MAX and _SAFE_ID.fullmatch(raw):
        return raw
    return uuid.uuid4().hex[:16]


def _client_request_id(headers: Sequence[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name == REQUEST_ID_HEADER:  # ASGI servers give header names in lower case
            return value
    return None


def _request_ids() -> dict[str, Value]:
    """The current request's id (on its first record: the client's `x-request-id` when it
    sent a safe one, else a new one; then the same for each), and the trace's id when there
    is a current span (a tracing SDK is set up)."""
    ids: dict[str, Value] = {}
    ctx = current_context()
    if ctx is not None:
        request_id = getattr(ctx, "request_id", None)  # unset until a record needs it
        if request_id is None:
            headers = getattr(ctx, "headers", ())
            request_id = ctx.request_id = request_id_from(_client_request_id(headers))
        ids["request_id"] = request_id
    span = trace.get_current_span().get_span_context()
    if span.is_valid:
        ids["trace_id"] = format(span.trace_id, "032x")
    return ids


def _text(value: Value) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return json.dumps(value, separators=(",", ":"))  # one word: no space
    text = str(value)
    # Quoted (JSON) unless plainly one word: no value can forge another field or a new line.
    return text if _PLAIN.fullmatch(text) else json.dumps(text)


_PLAIN = re.compile(r'[^\s"=\\\x00-\x1f\x7f]+')


# --- the decisions, one function each (the fields are the docs' "Logs" table) ----------------


def account_cooled(
    *, account: str, model: str | None, cause: str, period_secs: float, status: str, probe: bool
) -> None:
    """An account (`model` None) or an (account, model) pair started cooling (WARNING): the
    cause (`credentials` or `outage`), the cooling period, the status of the fault that cooled
    it, and whether that fault was a probe's (then: the probe failed, it cools again)."""
    _decide(
        ACCOUNTS,
        logging.WARNING,
        "account.cooled",
        "account cooled",
        {
            "account": account,
            "model": model,
            "cause": cause,
            "period_secs": period_secs,
            "status": status,
            "probe": "failed" if probe else None,
        },
    )


def account_recovered(*, account: str, model: str | None) -> None:
    """A probe succeeded: the account (or pair) is back in rotation (INFO)."""
    _decide(
        ACCOUNTS,
        logging.INFO,
        "account.recovered",
        "account back in rotation",
        {"account": account, "model": model, "probe": "succeeded"},
    )


def probe_inconclusive(*, account: str, model: str | None, status: str) -> None:
    """A probe answered neither a success nor a fault (a 429): still half-open, the next
    request probes (INFO)."""
    _decide(
        ACCOUNTS,
        logging.INFO,
        "account.probe",
        "probe inconclusive",
        {"account": account, "model": model, "probe": "inconclusive", "status": status},
    )


def throttle_hold(*, account: str, model: str, hold_secs: float) -> None:
    """A 429 with a retry time holds the account out for the model (INFO)."""
    _decide(
        ACCOUNTS,
        logging.INFO,
        "account.held",
        "account held by a 429",
        {"account": account, "model": model, "hold_secs": round(hold_secs, 3)},
    )


def attempt_failed(*, account: str, model: str | None, error: str) -> None:
    """An attempt failed in transport, or the app raised (WARNING): the error's type only (its
    text may quote a prompt)."""
    _decide(
        ACCOUNTS,
        logging.WARNING,
        "attempt.failed",
        "attempt failed",
        {"account": account, "model": model, "error": error},
    )


def fallback(*, from_model: str, to_model: str, reason: str) -> None:
    """A request moved down its fallback chain (WARNING)."""
    _decide(
        ROUTING,
        logging.WARNING,
        "fallback",
        "fallback to another model",
        {"from_model": from_model, "to_model": to_model, "reason": reason},
    )


def hedge_result(*, model: str, result: str, account: str | None = None) -> None:
    """A hedged first token's end (INFO): `won` (the hedge, on `account`, answered first),
    `lost` (the first attempt did); `refused` (the hedge budget is spent: DEBUG, since under a
    slow provider every request past the budget is one)."""
    _decide(
        ROUTING,
        logging.DEBUG if result == "refused" else logging.INFO,
        "hedge",
        "hedge " + result,
        {"model": model, "result": result, "account": account},
    )


def stream_resumed(
    *, model: str, reason: str, result: str, broken: str, resumed_on: str | None, sent_bytes: int
) -> None:
    """A started stream broke: resumed on another account (INFO) or not (WARNING)."""
    _decide(
        ROUTING,
        logging.INFO if result == "resumed" else logging.WARNING,
        "stream.resumed",
        "stream resumed" if result == "resumed" else "stream not resumed",
        {
            "model": model,
            "reason": reason,
            "result": result,
            "account": broken,
            "resumed_on": resumed_on,
            "sent_bytes": sent_bytes,
        },
    )


def guard_tripped(*, model: str, variant: str, here: bool) -> None:
    """A canary guard took a variant out: its share is 0 until a reload (WARNING); `here`:
    this process's guard tripped (else another replica's, told through the state store)."""
    _decide(
        CANARIES,
        logging.WARNING,
        "canary.guard_tripped",
        "canary guard tripped",
        {"model": model, "variant": variant, "tripped_by": "here" if here else "replica"},
    )


def config_reloaded(*, source: str | None) -> None:
    """A new config is in force (WARNING: every process's config changed under it)."""
    _decide(
        CONFIG,
        logging.WARNING,
        "config.reload",
        "config reloaded",
        {"result": "ok", "source": source},
    )


def config_rejected(*, problems: list[str]) -> None:
    """A reloaded config failed validation and the old one stays (ERROR), with each problem's
    key path."""
    _decide(
        CONFIG,
        logging.ERROR,
        "config.reload",
        "config reload rejected",
        {"result": "rejected", "problems": problems},
    )


def limit_refused(
    *, tenant: str, limit: str, model: str | None, retry_after_secs: float | None
) -> None:
    """A request refused by a tenant's or the deployment's limit (WARNING): which tenant, the
    limit's name (e.g. `tokens/minute`), the model, the retry time the client was given."""
    _decide(
        LIMITS,
        logging.WARNING,
        "limit.refused",
        "limit refused a request",
        {"tenant": tenant, "limit": limit, "model": model, "retry_after_secs": retry_after_secs},
    )


# --- formats ------------------------------------------------------------------------------

_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}
"""A record's own attributes: whatever else it carries came as `extra`."""

_ACCESS_FIELDS = ("client", "method", "path", "http_version", "status")
"""uvicorn's access line passes these as its arguments, in this order."""


def _timestamp(record: logging.LogRecord) -> str:
    """UTC, ISO 8601 with milliseconds."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{stamp}.{int(record.msecs):03d}Z"


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    """The record's structured fields: a decision's, another record's `extra`, or the parts
    of uvicorn's access line."""
    if isinstance(record.msg, Event):
        return {"event": record.msg.name, **record.msg.fields}
    fields = {k: v for k, v in record.__dict__.items() if k not in _STANDARD}
    args = record.args
    if record.name == "uvicorn.access" and isinstance(args, tuple) and len(args) == 5:
        fields.update(zip(_ACCESS_FIELDS, args, strict=True))
    fields.pop("color_message", None)  # uvicorn's coloured copy of the message
    return fields


class TextFormatter(logging.Formatter):
    """`TIME LEVEL LOGGER MESSAGE`, a decision's message carrying its fields as `key=value`;
    an exception's traceback on the lines below."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_timestamp(record)} {record.levelname} {record.name} {record.getMessage()}"
        if record.exc_info:
            line = f"{line}\n{self.formatException(record.exc_info)}"
        elif record.stack_info:
            line = f"{line}\n{self.formatStack(record.stack_info)}"
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: `time`, `level`, `logger`, `message`, then the
    record's fields (`event`, `request_id`, ...), and `exception` with the traceback if any."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.msg.phrase if isinstance(record.msg, Event) else record.getMessage()
        out: dict[str, Any] = {
            "time": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "message": message,
        }
        for key, value in _fields(record).items():
            out.setdefault(key, value)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        elif record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class ThreadFilter(logging.Filter):
    """Passes the records of threads named in `threads` (`keep=True`) or every other thread's
    (`keep=False`): a server run in process beside the gateway (the example's mock provider)
    logs apart from it."""

    def __init__(self, threads: Sequence[str], *, keep: bool) -> None:
        super().__init__()
        self.threads = frozenset(threads)
        self.keep = keep

    def filter(self, record: logging.LogRecord) -> bool:
        return (record.threadName in self.threads) is self.keep


def logging_config(
    log_format: LogFormat = "text",
    *,
    level: str = "INFO",
    apart: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A `logging.config.dictConfig` for the gateway: switchyard's records and uvicorn's (its
    server, error and access lines) in one format on stderr, at `level` (as uvicorn's own
    `--log-level` does, WARNING leaves out its access lines); any other library's at WARNING.

    `apart` maps a thread's name to a file: that thread's records go there, never to stderr.
    """
    formatter = TextFormatter if log_format == "text" else JsonFormatter
    handlers: dict[str, Any] = {
        "default": {
            "class": "logging.StreamHandler",
            "formatter": "switchyard",
            "stream": "ext://sys.stderr",
        }
    }
    filters: dict[str, Any] = {}
    if apart:
        filters["gateway"] = {"()": ThreadFilter, "threads": list(apart), "keep": False}
        handlers["default"]["filters"] = ["gateway"]
        for index, (thread, path) in enumerate(apart.items()):
            filters[f"apart{index}"] = {"()": ThreadFilter, "threads": [thread], "keep": True}
            handlers[f"apart{index}"] = {
                "class": "logging.FileHandler",
                "formatter": "switchyard",
                "filename": path,
                "filters": [f"apart{index}"],
            }
    every = list(handlers)
    own = {"handlers": every, "level": level, "propagate": False}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"switchyard": {"()": formatter}},
        "filters": filters,
        "handlers": handlers,
        "loggers": {
            ROOT: own,
            "uvicorn": own,
            "uvicorn.error": {"level": level},
            "uvicorn.access": {"handlers": every, "level": level, "propagate": False},
        },
        "root": {"handlers": every, "level": "WARNING"},
    }


def configure(
    log_format: LogFormat = "text", *, level: str = "INFO", apart: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Put `logging_config(...)` in force in this process and return it (for a server's
    workers to put in force in theirs): what `serve` and `extproc` do with their
    `--log-format` and `--log-level`."""
    config = logging_config(log_format, level=level.upper(), apart=apart)
    logging.config.dictConfig(config)
    return config
