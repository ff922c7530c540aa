"""``hedge_after_secs = "auto"``: each account's p95 time to first token over a sliding window.

Memory per account is a fixed ring of the latest ``size`` samples (seconds, with the time each
was taken), so the p95 is exact (nearest rank: the ``ceil(0.95 n)``-th smallest) over the
samples it holds; its one approximation is that under heavy traffic the window is the latest
``size`` samples rather than all of ``window_secs``. Samples older than ``window_secs`` are
dropped when read. A histogram would be smaller but would answer a bucket edge; 200 floats per
account are cheap and the answer is a time an operator can check against the traces.

Before an account holds ``min_samples`` samples in the window (a cold start, a new account, a
quiet hour) the answer is ``ceiling_secs``: hedge late rather than spend the budget on guesses
about an account not yet measured. Every answer is clamped to ``[floor_secs, ceiling_secs]`` so
that a very fast account does not hedge on every small stall.
"""

from __future__ import annotations

from collections import deque

from .clock import Clock


class FirstTokenTracker:
    """Records times to first token per account and answers when a hedge should start."""

    def __init__(
        self,
        *,
        window_secs: float,
        size: int,
        min_samples: int,
        floor_secs: float,
        ceiling_secs: float,
        clock: Clock,
    ) -> None:
        if not 0.0 < floor_secs <= ceiling_secs:
            raise ValueError("need 0 < floor_secs <= ceiling_secs")
        if not 1 <= min_samples <= size:
            raise ValueError("need 1 <= min_samples <= size")
        self._window = window_secs
        self._size = size
        self._min = min_samples
        self._floor = floor_secs
        self._ceiling = ceiling_secs
        self._clock = clock
        self._rings: dict[str, deque[tuple[float, float]]] = {}

    def record(self, account: str, first_token_secs: float) -> None:
        ring = self._rings.get(account)
        if ring is None:
            ring = self._rings[account] = deque(maxlen=self._size)
        ring.append((self._clock(), first_token_secs))

    def samples(self, account: str) -> int:
        return len(self._fresh(account))

    def hedge_after_secs(self, account: str) -> float:
        fresh = self._fresh(account)
        if len(fresh) < self._min:
            return self._ceiling
        ordered = sorted(fresh)
        # Nearest rank, ceil(0.95 n), in integers so that no float rounding can move it.
        p95 = ordered[(95 * len(ordered) + 99) // 100 - 1]
        return min(self._ceiling, max(self._floor, p95))

    def _fresh(self, account: str) -> list[float]:
        ring = self._rings.get(account)
        if ring is None:
            return []
        oldest = self._clock() - self._window
        while ring and ring[0][0] <= oldest:
            ring.popleft()
        return [secs for _, secs in ring]
