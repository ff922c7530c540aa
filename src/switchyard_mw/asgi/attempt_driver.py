"""Driving the attempt machine over ASGI: each `Send` runs the app once through the request's
exchange, and what happened goes back to the machine as plain events.

The one driver of both the stack and `CoolingMiddleware` alone; `timed`: each attempt runs
under the deadline the machine gives (`AttemptMachine.deadline`), as the stack does.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable

from opentelemetry import trace

from ..context import RequestContext
from ..engine.attempts import Limits, deadline_secs, in_force
from ..engine.claims import claimed
from ..engine.content_events import watch_for
from ..engine.machine import (
    DONE,
    NEXT,
    PASS_THROUGH,
    Action,
    AttemptMachine,
    ClaimProbe,
    Deliver,
    Gone,
    How,
    Refuse,
    State,
    Wait,
)
from ..engine.machine import Send as SendOn
from ..engine.stream_bounds import first_token_secs
from ..telemetry import logs
from ..telemetry import names as tm
from ._types import ASGIApp, Message, Scope
from .exchange import Exchange, send_error
from .hedge import race_for
from .resume import resume_broken, tap_for

# Read on every attempt: Enum member access is slow on Python 3.11.
_FINISHED, _RETURNED, _RAISED, _GONE = How.FINISHED, How.RETURNED, How.RAISED, How.GONE
_CANCELLED = Gone.CANCELLED
_READING = State.READING


async def run_attempts(
    ex: Exchange,
    machine: AttemptMachine,
    app: ASGIApp,
    scope: Scope,
    *,
    limits: Limits | None = None,
) -> None:
    """The request's attempts as `machine` decides them. `limits`: each attempt runs under
    its account's deadline, and a request the machine passes through under these (None: no
    deadline)."""
    if ex.stream and machine.grounds.resumes_streams:
        tap_for(ex, machine)  # a stream that may be resumed is watched for its break
    timed = limits is not None
    action: Action = machine.begin()  # the usual first attempt: a plain call
    while True:
        if isinstance(action, SendOn):
            # The attempt runs in this frame, not in a coroutine of its own: one frame fewer
            # on every request. `_attempt` takes the same steps for a resumed stream.
            try:
                await _armed(ex, machine, action, app, scope, timed)
            except asyncio.CancelledError:
                _cancelled(ex, machine)
                raise
            except Exception as exc:
                after = _raised(ex, machine, action, exc)
                if after is None:
                    raise
                action = after
                continue
            action = (
                machine.ended(_FINISHED)  # the usual answer: whole at the client, nothing held
                if ex.finished and ex.held is None
                else await _returned(ex, machine, action)
            )
        elif action is NEXT:
            action = machine.next()
        elif isinstance(action, ClaimProbe):
            action = await claimed(machine, action)
        elif isinstance(action, Wait):
            # Retry in place: the wait ends inside the caller's budget (the machine saw to
            # it); a client that leaves meanwhile cancels it with the request.
            await asyncio.sleep(action.secs)
            action = machine.waited()
        else:
            break
    if action is not DONE or ex.tap is not None:  # the usual answer went out whole: DONE
        await _concluded(ex, machine, action, app, scope, limits)


async def _concluded(
    ex: Exchange,
    machine: AttemptMachine,
    action: Action,
    app: ASGIApp,
    scope: Scope,
    limits: Limits | None,
) -> None:
    """What the attempts ended on, when it is more than the answer that went out: a stream
    to resume, an answer held back, a refusal, or the app once as it is."""
    if action is DONE and ex.tap is not None:
        timed = limits is not None
        await resume_broken(
            ex, machine, lambda send_on: _attempt(ex, machine, send_on, app, scope, timed)
        )
    if isinstance(action, Deliver):
        held: list[Message] = action.held  # type: ignore[assignment]  # ours, from ended()
        for message in held:
            await ex.out(message)
    elif isinstance(action, Refuse):
        ctx = ex.ctx
        assert ctx is not None
        assert ctx.wire is not None
        error = action.error
        await send_error(
            ex.out, ctx.wire, error.status, error.error_type, error.message, action.headers
        )
    elif action is PASS_THROUGH:  # not ours to place
        await run_timed(ex, app, scope, limits)


async def run_timed(ex: Exchange, app: ASGIApp, scope: Scope, limits: Limits | None) -> None:
    """The app once, as it is, under `limits`' deadline (None: none)."""
    ex.attempt(None)
    if limits is None:
        await app(scope, ex.receive, ex.send)
        return
    ctx = ex.ctx
    assert ctx is not None
    assert ctx.view is not None
    arm_from(ex, ctx, limits)
    await ex.run(app, scope, ex.receive, ex.send)


def arm_from(ex: Exchange, ctx: RequestContext, limits: Limits) -> None:
    """Arm the exchange's deadline from `limits` (no account's: a deadline policy's own)."""
    view = ctx.view
    assert view is not None
    first = deadline_secs(view, limits)
    now = time.monotonic()
    ctx.attempt_deadline_secs = in_force(first, ctx.budget_at, now)
    # No attempt machine here (the deadline policy alone): the same rule, from now.
    content_at = now + (first_token_secs(limits) if view.stream else first)
    _arm_both(ex, ctx, limits, first, now, content_at)


def _arm_both(
    ex: Exchange, ctx: RequestContext, limits: Limits, first: float, now: float, content_at: float
) -> None:
    """The attempt's deadline (`first` from `now`) and its stream's bounds past the headers:
    its first content event is due at `content_at` (monotonic)."""
    view = ctx.view
    assert view is not None
    # A stream starts at its first content event: `first` is the sooner of its bounds on
    # the headers and on that event; once the headers came, the second is what is due.
    # What an app's own call bounds (`timeout_for`, a backstop past the alarm) must not cut
    # a stream before its first content is due.
    ends_at = now + first
    ctx.deadline_at = content_at if content_at > ends_at else ends_at
    idle = ctx.stream_idle_secs = limits.stream_idle_secs if view.stream else None
    ex.arm(first, idle, now, content_at, watch_for(view.wire) if view.stream else None, limits)
    # `first` is the first-token limit itself when that is below `timeout_secs`
    # (`deadline_secs`): what an expiry before the start means is the machine's to say.
    if view.stream and first < limits.timeout_secs:
        ex.first_token_sooner = True


async def _attempt(
    ex: Exchange,
    machine: AttemptMachine,
    action: SendOn,
    app: ASGIApp,
    scope: Scope,
    timed: bool,
) -> Action:
    """Run the app once on `action`'s lease and tell the machine how it went: the steps
    `run_attempts` takes for each attempt, for a resumed stream's continuation."""
    try:
        await _armed(ex, machine, action, app, scope, timed)
    except asyncio.CancelledError:
        _cancelled(ex, machine)
        raise
    except Exception as exc:
        after = _raised(ex, machine, action, exc)
        if after is None:
            raise
        return after
    return await _returned(ex, machine, action)


def _armed(
    ex: Exchange,
    machine: AttemptMachine,
    action: SendOn,
    app: ASGIApp,
    scope: Scope,
    timed: bool,
) -> Awaitable[None]:
    """The attempt begins: what to await to run it. The app, or a race with a hedge when it
    is slow to its first content; `timed`: under the deadline the machine gives the
    attempt's account, its expiry answered by the exchange (`Exchange.run`); called inside
    the attempt's span when there is one."""
    ex.attempt(machine)
    run = app
    if timed:
        ctx = ex.ctx
        assert ctx is not None
        assert ctx.account is not None
        # The attempt's deadline as the machine gives it for the attempt's account, and its
        # stream's first content event when the machine says it is due.
        now = time.monotonic()
        first, _ = machine.deadline(now)
        due = machine.first_content_due() if ex.stream else None
        _arm_both(ex, ctx, ctx.account.spec, first, now, now + first if due is None else due)
        if machine.grounds.hedging is not None:
            run = race_for(ex, machine, app)
        if action.span is None:
            return ex.run(run, scope, ex.receive, ex.send)
        run = functools.partial(ex.run, run)
    if action.span is None:
        return run(scope, ex.receive, ex.send)
    return _in_span(action.span, run, scope, ex)


async def _in_span(span: trace.Span, run: ASGIApp, scope: Scope, ex: Exchange) -> None:
    """`run` called and awaited with the attempt's span current: the app's own call spans
    nest under it."""
    with tm.activate(span):
        await run(scope, ex.receive, ex.send)


def _cancelled(ex: Exchange, machine: AttemptMachine) -> None:
    """The attempt was cancelled. A response already sent whole still has its outcome
    (uvicorn reports a disconnect once a response completes, and the owner cancels then)."""
    machine.ended(_FINISHED if ex.finished else _GONE, gone=_CANCELLED)


def _raised(ex: Exchange, machine: AttemptMachine, action: SendOn, exc: Exception) -> Action | None:
    """The attempt raised `exc`: what follows, or None when it is the caller's to raise again
    (the response started, nobody waits, or the app is broken)."""
    if ex.finished:
        machine.ended(_FINISHED)
        return None
    after = machine.ended(_RAISED, error=type(exc))
    if after is DONE:
        return None
    ctx = ex.ctx
    assert ctx is not None
    logs.attempt_failed(
        account=action.lease.account, model=ctx.resolved_model, error=type(exc).__name__
    )
    return after


async def _returned(ex: Exchange, machine: AttemptMachine, action: SendOn) -> Action:
    """The attempt's app returned: what it held goes on if it returned mid-body, and the
    machine hears how its answer ended."""
    if ex.held is not None and not ex.held_whole:
        try:
            await ex.flush()  # the app returned mid-body: pass on what it sent
        except BaseException:
            machine.ended(_GONE)  # the client is gone: the lease goes back, no outcome
            raise
    if ex.held is not None and machine.state is _READING:
        machine.read(_body_of(ex.held))  # a 400: a context-length refusal?
    after = machine.ended(_FINISHED if ex.finished else _RETURNED, held=ex.held)
    # The app's framework answered a transport error (never so for the usual answer, DONE).
    if after is not DONE and machine.failure is not None:
        ctx = ex.ctx
        assert ctx is not None
        error = ctx.transport_error
        name = "" if error is None else error.__name__
        logs.attempt_failed(account=action.lease.account, model=ctx.resolved_model, error=name)
    return after


def _body_of(held: list[Message]) -> bytes:
    """The body of a held answer (bounded by MAX_HELD_BYTES)."""
    return b"".join(m.get("body", b"") for m in held if m["type"] == "http.response.body")
