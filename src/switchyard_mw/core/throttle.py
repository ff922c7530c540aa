"""How long a 429 asks to be left alone, read from its response headers (sans-IO).

Read, in this order of trust:
- `retry-after-ms` (milliseconds; OpenAI's and Azure's), else `retry-after` (seconds, or an HTTP
  date);
- the provider's own reset time of a limit the answer says is exhausted (its `remaining` is 0):
  Anthropic's `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-reset`
  (RFC 3339 instants) and OpenAI's `x-ratelimit-reset-{requests,tokens}` (durations such as
  `1s`, `6m0s`, `250ms`).
The hold is the latest of these: a `retry-after` shorter than the exhausted limit's reset would
only send the next request into the same 429. A limit that is not exhausted says nothing about
this 429, so its reset is ignored.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from datetime import datetime
from email.utils import parsedate_to_datetime

_LIMITS = (
    ("anthropic-ratelimit-requests-remaining", "anthropic-ratelimit-requests-reset"),
    ("anthropic-ratelimit-tokens-remaining", "anthropic-ratelimit-tokens-reset"),
    ("anthropic-ratelimit-input-tokens-remaining", "anthropic-ratelimit-input-tokens-reset"),
    ("anthropic-ratelimit-output-tokens-remaining", "anthropic-ratelimit-output-tokens-reset"),
    ("x-ratelimit-remaining-requests", "x-ratelimit-reset-requests"),
    ("x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"),
)
READ_HEADERS = frozenset(
    {"retry-after", "retry-after-ms", *(name for pair in _LIMITS for name in pair)}
)
"""Every header name this module reads (lowercase): a front keeps only these of a 429."""

_DURATION = re.compile(
    r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m(?!s))?(?:(\d+(?:\.\d+)?)s)?"
    r"(?:(\d+(?:\.\d+)?)ms)?\Z"
)
_MAX_VALUE = 64  # longer header values are not a time any provider sends


def retry_secs(headers: Iterable[tuple[str, str]], *, wall_now: float) -> float | None:
    """Seconds until the 429's sender says to retry, or None when it does not say.

    `headers`: (lowercase name, value) pairs. `wall_now`: the current Unix time, for the
    answers that name an instant (an HTTP date, an RFC 3339 reset). Never negative.
    """
    found = {name: value.strip() for name, value in headers if name in READ_HEADERS}
    if not found:
        return None
    hints = [_retry_after(found, wall_now)]
    for remaining, reset in _LIMITS:
        if found.get(remaining) == "0" and reset in found:
            hints.append(_reset(found[reset], wall_now))
    known = [h for h in hints if h is not None]
    return max(0.0, *known) if known else None


def _retry_after(found: dict[str, str], wall_now: float) -> float | None:
    ms = _number(found.get("retry-after-ms"))
    if ms is not None:
        return ms / 1000
    value = found.get("retry-after")
    if value is None:
        return None
    secs = _number(value)
    return secs if secs is not None else _http_date(value, wall_now)


def _reset(value: str, wall_now: float) -> float | None:
    """A reset header: an RFC 3339 instant (Anthropic) or a duration (OpenAI)."""
    if len(value) > _MAX_VALUE:
        return None
    if "T" in value:
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() - wall_now
        except ValueError:
            return None
    return _duration(value)


def _duration(value: str) -> float | None:
    """`6m0s`, `1.5s`, `250ms`, `1h2m`: Go-style durations as OpenAI writes them."""
    match = _DURATION.match(value) if value else None
    if match is None or not any(match.groups()):
        return _number(value)
    hours, minutes, secs, ms = (float(g) if g else 0.0 for g in match.groups())
    return hours * 3600 + minutes * 60 + secs + ms / 1000


def _number(value: str | None) -> float | None:
    if value is None or len(value) > _MAX_VALUE:
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) and number >= 0 else None


def _http_date(value: str, wall_now: float) -> float | None:
    if len(value) > _MAX_VALUE:
        return None
    try:
        return parsedate_to_datetime(value).timestamp() - wall_now
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
