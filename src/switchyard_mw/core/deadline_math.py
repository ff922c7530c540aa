"""Deadline arithmetic: how long one upstream attempt may take, and the request's budget."""

from __future__ import annotations

TOKENS_PER_HOUR = 128_000
"""Output rate a non-streaming call is budgeted for (the Anthropic SDK's figure)."""
MAX_NON_STREAMING_SECS = 600.0
"""Ceiling of the output-cap term: ten minutes."""

BUDGET_HEADERS = (b"x-envoy-expected-rq-timeout-ms", b"x-switchyard-timeout-ms")


def attempt_deadline_secs(
    *, timeout_secs: float, max_tokens: int | None, default_max_tokens: int | None = None
) -> float:
    """Seconds one non-streaming attempt may take.

    `max(timeout_secs, min(600, max_tokens * 3600 / 128000))`, where `max_tokens` is the
    request's output cap, else the client's `default_max_tokens`, else 0. The operator's
    `timeout_secs` is the floor, so a larger one always holds.
    """
    cap = max_tokens if max_tokens is not None else (default_max_tokens or 0)
    # Comparisons rather than min()/max(): this runs on every attempt, and the calls cost more.
    secs = cap * 3600 / TOKENS_PER_HOUR
    if secs > MAX_NON_STREAMING_SECS:
        secs = MAX_NON_STREAMING_SECS
    return secs if secs > timeout_secs else timeout_secs


def parse_budget_ms(value: bytes | str) -> float | None:
    """A budget header's value in seconds, or None when it is not a non-negative number.

    Envoy sends whole milliseconds; a decimal is accepted too. Invalid values are ignored
    (and counted by the caller), never fatal: a bad header must not fail the request.
    """
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    text = text.strip()
    if not text or len(text) > 20:
        return None
    try:
        ms = float(text)
    except ValueError:
        return None
    if not ms >= 0 or ms == float("inf"):  # also rejects NaN
        return None
    return ms / 1000.0
