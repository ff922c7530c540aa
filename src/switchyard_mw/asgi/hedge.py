"""Hedged first tokens over ASGI: the attempt in flight and a second one race for content.

`Race` stands in for the app during one attempt of the machine (`asgi/attempt_driver.py`), inside
the exchange's deadline: it runs the app for the attempt's account; when that has produced no
content event by the time the machine gave (`AttemptMachine.hedge_due`), it asks the machine
for a hedge (`AttemptMachine.hedge`: the machine decides, the hedge budget included) and runs
the app a second time, concurrently, for the account it names. It only races and reports: how
a run ended goes to the machine in plain terms, which says what that means for its account.

Each run sends into its own gate, which holds every message back until its first content event
(a stream's first text, thinking or tool-use delta; a JSON answer's first body bytes). The
first gate to see content wins: the other run is cancelled at once (its upstream call with it)
and its lease goes back with no outcome (`hedge_lost`); the winner's held messages go on to the
exchange, then the rest as they come. Nothing of the loser ever reaches the exchange, so the
client sees one answer. A run that ends without content while the other is still running has
failed in the race: its lease goes back with what its end said about its account, and the other
goes on alone, as the attempt the machine knows.

Each run has its own context (a copy of the request's, with its account), set as
`current_context()` in its task, so the app calls the account it was given; the winner's
reports (usage, upstream status, transport errors) are copied to the request's context as its
messages go on.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import enum
import time
from typing import Any

from ..context import RequestContext, current_var
from ..engine.content_events import ContentWatch, watch_for
from ..engine.machine import AskBudget, AttemptMachine, Gone
from ..engine.machine import Send as SendOn
from ..telemetry import names as tm
from ._types import ASGIApp, Message, Receive, Scope, Send
from .exchange import Exchange

_REPORTED = (
    "upstream_request_id",
    "upstream_status",
    "transport_error",
    "input_tokens",
    "output_tokens",
    "cache_read_tokens",
    "cache_write_tokens",
)
"""What an app reports into its context during an attempt: the winner's goes to the request's."""


class Run(enum.Enum):
    """Where one run of the race stands."""

    RACING = "racing"
    """No content yet: its messages are held."""
    WON = "won"
    """It produced content first, or is the one left: its messages go on."""
    LOST = "lost"
    """The other produced content first: it was cancelled."""
    FAILED = "failed"
    """It ended without content while the other went on."""


_RACING, _WON, _LOST, _FAILED = Run.RACING, Run.WON, Run.LOST, Run.FAILED


class _Runner:
    """One run of the app: its context, its gate and its task."""

    __slots__ = (
        "_watch",
        "ctx",
        "flushing",
        "hedge",
        "held",
        "out",
        "passing",
        "since",
        "state",
        "status",
    )

    def __init__(
        self, ctx: RequestContext, out: Send, watch: ContentWatch | None, *, hedge: bool
    ) -> None:
        self.ctx = ctx
        self.out = out
        self._watch = watch
        self.hedge = hedge
        self.held: list[Message] = []
        self.passing = False  # the held messages went on; the rest goes as it comes
        self.flushing = False  # the held messages are going on (from another task, maybe)
        self.state = _RACING
        self.status: int | None = None
        self.since = time.monotonic()

    def content(self, message: Message) -> bool:
        """Whether `message` carries (or ends) the answer's first content."""
        kind = message["type"]
        if kind == "http.response.start":
            self.status = message["status"]
            return False
        if kind != "http.response.body" or self.status is None or self.status >= 300:
            return False
        body = message.get("body", b"")
        if self._watch is None:
            return bool(body) or not message.get("more_body", False)
        return self._watch.feed(body) if body else False


class Race:
    """The app for one attempt, hedged when it is slow to its first content (see the module).

    `after_secs`: the attempt's hedge time (`AttemptMachine.hedge_due`).
    """

    def __init__(
        self,
        ex: Exchange,
        machine: AttemptMachine,
        app: ASGIApp,
        *,
        after_secs: float,
        stream: bool,
    ) -> None:
        self._ex = ex
        self._machine = machine
        self._app = app
        self._after = after_secs
        self._stream = stream
        ctx = ex.ctx
        assert ctx is not None
        self._ctx = ctx
        self._runs: dict[asyncio.Task[None], _Runner] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        first = self._runner(self._ctx, send, hedge=False)
        task = asyncio.create_task(self._run(first, scope, receive))
        self._runs[task] = first
        try:
            done, _ = await asyncio.wait({task}, timeout=self._after)
            if not done and first.state is _RACING and (first.status or 200) < 300:
                await self._hedge(scope, send)
            await self._settle()
        except BaseException:
            await self._stop(Gone.CANCELLED)
            raise
        finally:
            # A cancelled run's error holds its frames, which hold this race: without its
            # runs the race holds no task, and the request leaves no cycle behind.
            self._runs.clear()

    def _runner(self, ctx: RequestContext, send: Send, *, hedge: bool) -> _Runner:
        view = ctx.view
        watch = watch_for(view.wire) if view is not None and self._stream else None
        return _Runner(ctx, send, watch, hedge=hedge)

    async def _hedge(self, scope: Scope, send: Send) -> None:
        """Start the hedge, if the machine starts one."""
        machine = self._machine
        action = machine.hedge()
        if isinstance(action, AskBudget):  # a budget shared across replicas: its word first
            allowed = await action.ask()
            if self._runs and next(iter(self._runs.values())).state is not _RACING:
                return  # the first answered while the budget was asked
            action = machine.hedge_allowed(allowed)
        account = machine.hedge_account
        if action is None or account is None:
            return
        ctx = copy.copy(self._ctx)
        ctx.account = account
        for name in ("upstream_status", "transport_error", "deadline_phase", "first_token_at"):
            setattr(ctx, name, None)
        runner = self._runner(ctx, send, hedge=True)
        context = contextvars.copy_context()
        context.run(current_var.set, ctx)
        # Its own scope too: an app may read its context as `request.state.switchyard`.
        own = {**scope, "state": {**scope.get("state", {}), "switchyard": ctx}}
        task = asyncio.create_task(self._run(runner, own, _body_once(ctx), action), context=context)
        self._runs[task] = runner

    async def _run(
        self, runner: _Runner, scope: Scope, receive: Receive, action: SendOn | None = None
    ) -> None:
        async def send(message: Message) -> None:
            await self._gate(runner, message)

        span = None if action is None else action.span
        if span is None:
            await self._app(scope, receive, send)
        else:
            with tm.activate(span):  # the hedge's own call spans nest under its attempt
                await self._app(scope, receive, send)

    async def _gate(self, runner: _Runner, message: Message) -> None:
        if runner.passing:
            if runner.hedge and runner.state is _WON:
                _report(runner.ctx, self._ctx)
            return await runner.out(message)
        runner.held.append(message)
        content = runner.content(message)
        if (
            self._stream
            and message["type"] == "http.response.start"
            and (runner.status or 500) < 300
        ):
            self._ex.content_due()  # a stream's start: its first content is what is due now
        if content and runner.state is _RACING:
            self._won(runner)
        if runner.state is _WON and not runner.flushing:
            await self._pass(runner)

    def _won(self, runner: _Runner) -> None:
        """`runner` produced content first: the other is cancelled, its lease goes back."""
        runner.state = _WON
        account = runner.ctx.account
        if account is not None:
            self._machine.content_after(account.name, time.monotonic() - runner.since)
        for task, other in self._runs.items():
            if other is not runner and other.state is _RACING:
                other.state = _LOST
                task.cancel()
                self._machine.hedge_over(won=runner.hedge)
        if runner.hedge:
            _report(runner.ctx, self._ctx)

    async def _pass(self, runner: _Runner) -> None:
        """Let `runner`'s held messages go on, in order, then the rest as they come."""
        runner.flushing = True
        held = runner.held
        while held:
            message = held.pop(0)
            if runner.hedge:
                _report(runner.ctx, self._ctx)
            await runner.out(message)
        runner.passing = True

    async def _settle(self) -> None:
        """Wait for the runs; the one that ends the race decides what the attempt was."""
        pending = set(self._runs)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                await self._ended(task)

    async def _ended(self, task: asyncio.Task[None]) -> None:
        runner = self._runs[task]
        if runner.state is _LOST:
            return  # cancelled for the winner: nothing of it reached the client
        error = None if task.cancelled() else task.exception()
        if runner.state is _RACING:
            others = [r for r in self._runs.values() if r is not runner and r.state is _RACING]
            if others:
                self._failed(runner, error)
                survivor = others[0]
                survivor.state = _WON
                if survivor.hedge:
                    _report(survivor.ctx, self._ctx)
                await self._pass(survivor)
                return
            runner.state = _WON
            if runner.hedge:
                _report(runner.ctx, self._ctx)
            await self._pass(runner)  # the one left: its answer is the attempt's
        if task.cancelled():
            raise asyncio.CancelledError
        if error is not None:
            raise error

    def _failed(self, runner: _Runner, error: BaseException | None) -> None:
        """`runner` ended without content while the other goes on: the machine hears how,
        and gives its lease back with what that says about its account."""
        runner.state = _FAILED
        self._machine.race_failed(
            hedge=runner.hedge,
            status=runner.status,
            error=None if error is None else type(error),
            report=runner.ctx,
        )

    async def _stop(self, gone: Gone) -> None:
        """The attempt is cancelled (deadline, client gone): every run ends, a hedge still
        racing goes back with no outcome."""
        for task, runner in self._runs.items():
            if not task.done():
                task.cancel()
            if runner.hedge and runner.state is _RACING:
                runner.state = _LOST
                self._machine.hedge_over(won=False, status=gone)
        await asyncio.gather(*self._runs, return_exceptions=True)


def _report(source: RequestContext, target: RequestContext) -> None:
    for name in _REPORTED:
        setattr(target, name, getattr(source, name))


def _body_once(ctx: RequestContext) -> Receive:
    """The hedge's `receive`: its body once (in its account's name for the model), then
    nothing until it is cancelled (the request's own receive watches the client)."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": ctx.body_for_app(), "more_body": False}
        forever: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        await forever
        return {"type": "http.disconnect"}

    return receive


def race_for(ex: Exchange, machine: AttemptMachine, app: ASGIApp) -> ASGIApp:
    """What runs for the machine's attempt in flight: `app` itself, or a `Race` around it when
    the machine gives the attempt a hedge time (`hedge_due`)."""
    after = machine.hedge_due()
    view = machine.ctx.view
    if after is None or view is None:
        return app
    return Race(ex, machine, app, after_secs=after, stream=view.stream)
