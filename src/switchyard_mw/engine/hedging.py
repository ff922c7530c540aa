"""Hedged first tokens: when an attempt's hedge is due, and whether the budget lets it start.

One `Hedging` per engine (a reload builds another). It answers three questions for the attempt
machine, which decides a hedge (`AttemptMachine.hedge_due`, `hedge`): how long an account's
attempt may go without content before a hedge (`after_secs`: its `hedge_after_secs`, or with
`"auto"` its measured p95 time to first token, `core/first_token_tracker`), whether one more hedge
fits the budget of the request's model (`core/hedge_budget`: at most `hedge_max_ratio` of the
requests over a sliding minute; with a state store, the model's budget in it,
`state/redis_hedge_budget.py`, the local one deciding while the store cannot answer), and it keeps
the times to first token `"auto"` reads (`record`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Protocol

from ..accounts import Account
from ..core.clock import Clock, monotonic
from ..core.first_token_tracker import FirstTokenTracker
from ..core.hedge_budget import HedgeBudget, HedgeVerdict
from ..telemetry import logs
from ..telemetry import names as tm

_log = logging.getLogger("switchyard_mw.hedging")

WINDOW_SECS = 60.0
"""The budget's sliding window: long enough that a burst does not spend a minute's share."""
BUCKETS = 12
"""The window's buckets (5 s each): its one approximation is at most one bucket."""
AUTO_WINDOW_SECS = 300.0
AUTO_SAMPLES = 200
AUTO_MIN_SAMPLES = 20
AUTO_FLOOR_SECS = 0.25
AUTO_CEILING_SECS = 30.0
"""`"auto"`: the p95 of an account's latest 200 first tokens over five minutes, at least 20 of
them (else the ceiling: hedge late rather than on a guess), clamped to [0.25 s, 30 s]."""

_START, _REFUSED = HedgeVerdict.START, HedgeVerdict.REFUSED


class SharedBudget(Protocol):
    """A model's budget shared across replicas (`state/redis_hedge_budget.py`)."""

    async def note_request(self) -> None: ...

    async def try_hedge(self) -> HedgeVerdict: ...


SharedBudgets = Callable[[str], SharedBudget | None]
"""A model's shared budget, or None while the store cannot be asked (the local one decides)."""


class Hedging:
    """The hedge times of `accounts` and the per-model budgets at `max_ratio`."""

    def __init__(
        self,
        *,
        accounts: Mapping[str, Account],
        max_ratio: float,
        clock: Clock = monotonic,
        shared: SharedBudgets | None = None,
        timeout_secs: float = 0.1,
    ) -> None:
        self._after = {name: a.spec.hedge_after_secs for name, a in accounts.items()}
        self._ratio = max_ratio
        self._clock = clock
        self._budgets: dict[str, HedgeBudget] = {}
        self._shared = shared
        self._timeout = timeout_secs  # the store's: past it, the local budget decides
        self._notes: set[asyncio.Task[None]] = set()  # shared notes on their way
        self.first_tokens = FirstTokenTracker(
            window_secs=AUTO_WINDOW_SECS,
            size=AUTO_SAMPLES,
            min_samples=AUTO_MIN_SAMPLES,
            floor_secs=AUTO_FLOOR_SECS,
            ceiling_secs=AUTO_CEILING_SECS,
            clock=clock,
        )

    @property
    def on(self) -> bool:
        """Whether any account hedges at all (else nothing here is asked)."""
        return any(after is not None for after in self._after.values())

    def after_secs(self, account: str) -> float | None:
        """How long an attempt on `account` may go without content before a hedge (None:
        it never hedges)."""
        after = self._after.get(account)
        if after == "auto":
            return self.first_tokens.hedge_after_secs(account)
        if after is None:
            return None
        return float(after)

    def record(self, account: str, first_token_secs: float) -> None:
        """An attempt on `account` produced its first content after `first_token_secs`."""
        if self._after.get(account) == "auto":
            self.first_tokens.record(account, first_token_secs)

    def note_request(self, model: str) -> None:
        """A request of `model` that may hedge started its first attempt (counted in the
        window the ratio is read against; with a store, in the shared window too, in the
        background: the request does not wait for it)."""
        self._budget(model).note_request()
        shared = None if self._shared is None else self._shared(model)
        if shared is not None:
            task = asyncio.get_running_loop().create_task(self._note(shared))
            self._notes.add(task)
            task.add_done_callback(self._notes.discard)

    async def _note(self, shared: SharedBudget) -> None:
        try:
            # Off the request path: more room than an answer the request waits for.
            await asyncio.wait_for(shared.note_request(), max(1.0, 10 * self._timeout))
        except Exception as exc:  # the store's trouble never fails a request
            _log.debug("hedge budget: note not shared (%s)", type(exc).__name__)

    async def noted(self) -> None:
        """Wait for the shared notes on their way (at shutdown, and in tests)."""
        if self._notes:
            await asyncio.gather(*self._notes, return_exceptions=True)

    async def may_start(self, model: str) -> bool:
        """`try_hedge`, asking the shared budget when a store is set and answers in time."""
        shared = self.shared_budget(model)
        if shared is None:
            return self.try_hedge(model)
        return await self.ask_shared(shared, model)

    def shared_budget(self, model: str) -> SharedBudget | None:
        """The budget of `model` shared across replicas, to ask with `ask_shared`; None: the
        local one decides (no store, or it cannot be asked now)."""
        return None if self._shared is None else self._shared(model)

    async def ask_shared(self, shared: SharedBudget, model: str) -> bool:
        """Whether one more hedge of `model` fits `shared` (counted there if so); the local
        budget decides when the store does not answer in time."""
        try:
            verdict = await asyncio.wait_for(shared.try_hedge(), self._timeout)
        except Exception as exc:
            _log.debug("hedge budget: store not asked (%s)", type(exc).__name__)
            return self.try_hedge(model)
        if verdict is _START:
            return True
        _refused(model)
        return False

    def try_hedge(self, model: str) -> bool:
        """Whether one more hedge of `model` fits the budget (counted if so; a refusal is
        counted in `switchyard.hedges` as `refused`)."""
        if self._budget(model).try_hedge() is _START:
            return True
        _refused(model)
        return False

    def counts(self, model: str) -> tuple[int, int]:
        """The requests and hedges of `model` the window holds now."""
        return self._budget(model).counts()

    def _budget(self, model: str) -> HedgeBudget:
        budget = self._budgets.get(model)
        if budget is None:
            budget = self._budgets[model] = HedgeBudget(
                max_ratio=self._ratio, window_secs=WINDOW_SECS, buckets=BUCKETS, clock=self._clock
            )
        return budget


def _refused(model: str) -> None:
    """A hedge the budget refused: counted in `switchyard.hedges` and logged."""
    tm.hedges.add(1, {tm.RESPONSE_MODEL: model, "result": "refused"})
    logs.hedge_result(model=model, result="refused")
