"""A stream's bounds past its headers: the first-token limit and the throughput floor, sans-IO.

Both fronts ask the same questions of the same numbers: how long a stream may take to its
first content event (`first_token_secs`, default `timeout_secs`), and, once content flows,
when its output rate over the last `throughput_window_secs` will have stayed below
`min_tokens_per_sec` if nothing more comes (`ThroughputFloor.slow_at`). The answer is a time,
so a front sets it on the timer it already has for the idle gap: whichever comes first ends
the stream, and no timer runs per chunk.
"""

from __future__ import annotations

from collections import deque

__all__ = ["ThroughputFloor", "first_token_secs", "floor_for"]


def first_token_secs(limits: object) -> float:
    """The longest a stream may take from sending to its first content event: the account's
    `first_token_secs`, else its `timeout_secs`."""
    secs = getattr(limits, "first_token_secs", None)
    if isinstance(secs, int | float) and secs > 0:
        return float(secs)
    timeout: float = getattr(limits, "timeout_secs")  # noqa: B009 - every Limits has one
    return timeout


class ThroughputFloor:
    """When a stream's output rate will have stayed below `rate` tokens a second over a
    sliding `window` (seconds), counted from its first content event.

    `note(now, tokens)` after each content event (`tokens`: the stream's output so far)
    answers that time if nothing more comes. The rate over the window ending at `t` is
    (output(t) - output(t - window)) / window; with the output fixed at N from now on, that
    falls below the floor once output(t - window) > N - rate * window, i.e. one window after
    the first sample above that level. Samples at or below it are never needed again (the
    level only rises), so the samples kept are those of about one window.
    """

    __slots__ = ("_samples", "rate", "window")

    def __init__(self, rate: float, window: float, started_at: float) -> None:
        self.rate = rate
        self.window = window
        # (time, output by then): the stream had made nothing before its first content event.
        self._samples: deque[tuple[float, float]] = deque(((started_at, 0.0),))

    def note(self, now: float, tokens: float) -> float:
        """Record the output so far at `now`; the time the stream is slow unless more comes."""
        samples = self._samples
        if tokens > samples[-1][1]:
            samples.append((now, tokens))
        level = tokens - self.rate * self.window
        while len(samples) > 1 and samples[0][1] <= level and samples[1][1] <= level:
            samples.popleft()
        if samples[0][1] > level:
            return samples[0][0] + self.window
        return samples[1][0] + self.window


def floor_for(limits: object, started_at: float) -> ThroughputFloor | None:
    """The account's throughput floor from its first content event at `started_at`; None
    when it sets none (the default)."""
    rate = getattr(limits, "min_tokens_per_sec", None)
    if not isinstance(rate, int | float) or rate <= 0:
        return None
    window = getattr(limits, "throughput_window_secs", 10.0)
    return ThroughputFloor(float(rate), float(window), started_at)
