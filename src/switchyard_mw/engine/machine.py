"""The attempt machine: one request's upstream attempts, decided in one place, awaiting nothing.

As h11's `Connection` does for HTTP/1.1, it takes events and answers with actions: the front
that carries the request (the ASGI stack, the ext_proc processor) tells it what happened in
plain terms and does what it answers, translated to its own protocol. It never touches an ASGI
message, a protobuf or a socket, and never awaits: the one decision that needs shared state
(a probe claimed across replicas) is an action the driver performs and reports back.

    machine = engine.machine(ctx)         # built with the engine's `Grounds`
    action = machine.begin()              # Send | ClaimProbe | Refuse | PassThrough
    ClaimProbe(account) -> action = machine.probe_claimed(await store.claim_probe(account))
    Send(lease)         -> run the attempt and report it:
        machine.started(status, headers)  # Hold | Forward   (the answer began)
        machine.ended(how, ...)           # Next | Deliver | Refuse | Done
    Next                -> action = machine.next()   # Send | ClaimProbe | Deliver | Refuse

It owns which account and model go next (failover within the front's reach, the canary's base
model when no variant account can serve), the tried list, the answer held back, the failure so
far, the attempt deadline, the attempt's spans, the one retry rule (`_worth_retrying`) and the
one outcome classification (`attempts.verdict`, at the attempt's end).

What failed in the request is kept as faults are: a refusal of the key or its billing (401,
402, 403, and the billing refusals a 429 or a 400 body carries) shuts the account out for every
model; any other failure only that (account, model), so a fallback model or a canary's base on
the same account is tried there (`_excluded`). The order of moves (`_onward`): another account
of the same model at once; then, where `retry_wait_max_secs` allows, the same account after
its short wait; then the next model of the chain. A refusal of the key is never passed on:
when nothing else can serve, switchyard's own 503 says the credentials were refused.

Its states (`State`) and the events each takes are a table, `transitions.TRANSITIONS`: each
event method looks its state up there first (any other event raises `MachineError`) and then
only computes which of the table's states follows and what the driver is to do.

Beside its state, how far the request may still go is named too (`Reach`: OPEN, WAITED once
its one retry in place is spent, LAST when the front can make no other attempt, CLOSED), and
whether the attempt's answer refused its account's key (`KeyRefusal`). What stays data: the
tried list, what failed per model (`_failed`, `_keys_refused`), the chain's models offered
(`_chained`) and those that refused the prompt as too long (`_too_long`), the claim a
CLAIMING machine waits on, and a hedge's lease racing the attempt in flight (`_Hedge`: the
driver reports only the race's winner, so SENT takes the same events with or without one).

A fallback chain (`engine.fallbacks`) is more candidate models in `_candidates` (`Send.model`
names the model each attempt goes to; `ctx.body_for_app()` rewrites the body to it), and a
400 or 429 is held in READING until its body says whether it is a billing refusal or a
context-length refusal (`engine.error_bodies`). Retry in place is `next()` answering `Wait`
for the same account.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Collection, Iterable
from functools import partial
from typing import TYPE_CHECKING, NoReturn

from opentelemetry import trace

from ..context import RequestContext
from ..core.affinity import key_hash
from ..core.pool import BILLING, CREDENTIAL_STATUSES, Lease, Outcome
from ..core.shared import Shared
from ..errors import MachineError as MachineError  # raised here; kept importable from here
from ..wire import WireError
from . import answers, attempts, in_place
from .attempts import OUT_OF_TIME, Failure, Gone, Phase
from .content_events import watch_for
from .error_bodies import billing_refusal, context_refusal
from .fallbacks import Reason
from .outcomes import throttle_headers
from .recorder import FALLBACK_ROUTE
from .stream_bounds import first_token_secs
from .transitions import IN_FLIGHT as _IN_FLIGHT
from .transitions import TRANSITIONS as _TRANSITIONS
from .transitions import KeyRefusal, Reach, State

if TYPE_CHECKING:
    from ..accounts import Account
    from .grounds import Grounds

__all__ = [
    "AskBudget",
    "ClaimProbe",
    "Deliver",
    "Failure",
    "Gone",
    "Hold",
    "How",
    "MachineError",
    "Phase",
    "Refuse",
    "Send",
    "State",
    "Wait",
]


class How(enum.Enum):
    """How an attempt ended."""

    FINISHED = "finished"
    """The client has the whole answer (whatever happened to the work afterwards)."""
    RETURNED = "returned"
    """The work returned; its answer (if any) is held, or not yet whole at the client."""
    RAISED = "raised"
    """The call failed (`failure`, or an exception type `error` to classify)."""
    GONE = "gone"
    """Nobody waits for the answer any more (`gone` says why): no outcome."""


# --- actions --------------------------------------------------------------------------------


class Send:
    """Send the attempt on `lease`, to `model` (`ctx.account` is its account); `span` is the
    attempt's GenAI CLIENT span to make current around the call (None: no tracing)."""

    __slots__ = ("lease", "model", "span")

    def __init__(self, lease: Lease, model: str, span: trace.Span | None) -> None:
        self.lease, self.model, self.span = lease, model, span

    def __repr__(self) -> str:
        return f"Send({self.lease.account!r}, {self.model!r})"


class ClaimProbe:
    """Await `store.claim_probe(account, model)` and hand the answer to `probe_claimed` (or
    call `claim_abandoned` if the claim raised or was cancelled). `model`: the probe is that
    (account, model) pair's, None: the account's own."""

    __slots__ = ("account", "model")

    def __init__(self, account: str, model: str | None = None) -> None:
        self.account = account
        self.model = model

    def __repr__(self) -> str:
        return f"ClaimProbe({self.account!r})"


class AskBudget:
    """Await `ask()` (whether the hedge budget shared across replicas lets one more hedge of
    the request's model start) and hand the answer to `hedge_allowed`."""

    __slots__ = ("ask",)

    def __init__(self, ask: Callable[[], Awaitable[bool]]) -> None:
        self.ask = ask

    def __repr__(self) -> str:
        return "AskBudget(...)"


class Deliver:
    """Pass on `held`, an answer the driver held back (the last upstream answer says more than
    anything switchyard could make up; a 429 keeps its `retry-after`)."""

    __slots__ = ("held",)

    def __init__(self, held: object) -> None:
        self.held = held

    def __repr__(self) -> str:
        return "Deliver(...)"


class Refuse:
    """Answer the client with `error` and `headers` (switchyard's own answer)."""

    __slots__ = ("error", "headers")

    def __init__(self, error: WireError, headers: answers.Headers = ()) -> None:
        self.error, self.headers = error, headers

    def __repr__(self) -> str:
        return f"Refuse({self.error.status}, {self.error.error_type!r})"


class Hold:
    """Hold the answer that started back; `failover`: for another account (else only until
    the attempt ends, to see whether it was a transport error)."""

    __slots__ = ("failover",)

    def __init__(self, failover: bool) -> None:
        self.failover = failover

    def __repr__(self) -> str:
        return f"Hold(failover={self.failover})"


class Wait:
    """Sleep `secs`, then call `waited()`: the request is retried in place, on the account
    that just refused it (its `retry_wait_max_secs`). Behind Envoy the route's retry back-off
    has already waited: call `waited()` at once."""

    __slots__ = ("account", "secs")

    def __init__(self, account: str, secs: float) -> None:
        self.account, self.secs = account, secs

    def __repr__(self) -> str:
        return f"Wait({self.account!r}, {self.secs})"


class _Signal:
    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


FORWARD = _Signal("Forward")
"""Pass the answer on as it comes."""
NEXT = _Signal("Next")
"""Another attempt may follow: call `next()` when ready to send it."""
DONE = _Signal("Done")
"""Nothing more to do for the attempts (the answer went through, or nobody waits)."""
PASS_THROUGH = _Signal("PassThrough")
"""Not switchyard's to place: the request goes on untouched."""
HOLD_FOR_FAILOVER = Hold(True)
HOLD_TO_CHECK = Hold(False)

Action = Send | ClaimProbe | Deliver | Refuse | Hold | Wait | _Signal
Start = Send | ClaimProbe | Deliver | Refuse | Wait | _Signal
"""What `begin`, `probe_claimed`, `next` and `waited` answer."""
End = Deliver | Refuse | _Signal
"""What `ended` answers."""

# Read on every attempt: module constants, since Enum member access is slow on Python 3.11.
_READY, _CLAIMING, _SENT = State.READY, State.CLAIMING, State.SENT
_HOLDING, _CHECKING, _FORWARDING = State.HOLDING, State.CHECKING, State.FORWARDING
_BETWEEN, _DONE, _WAITING = State.BETWEEN, State.DONE, State.WAITING
_READING = State.READING
_FIRST_TOKEN = Phase.FIRST_TOKEN
_HEDGE_EARLY = 0.5
"""A try the front did not ask for before half the hedge time is a retry, not a hedge."""
_OPEN, _WAITED, _LAST, _CLOSED = Reach.OPEN, Reach.WAITED, Reach.LAST, Reach.CLOSED
_GOES_ON = frozenset({_OPEN, _WAITED})
"""Reaches in which another attempt may follow."""
_NO_REFUSAL, _READ, _SETTLED = KeyRefusal.NONE, KeyRefusal.READ, KeyRefusal.SETTLED
_READ_STATUSES = frozenset({400, 429})
"""Answers held until their body is read (`read`): a billing refusal arrives as either."""
_KEY_STATUSES = frozenset({401, 402, 403})
"""Refusals of the account's key or billing: never the client's answer (`_refusal`)."""
_FINISHED, _RETURNED, _RAISED, _GONE = How.FINISHED, How.RETURNED, How.RAISED, How.GONE
_SUCCESS, _FAULT = Outcome.SUCCESS, Outcome.FAULT
_APP_ERROR, _DISCONNECTED = Failure.APP_ERROR, Gone.DISCONNECTED
_UNAVAILABLE, _CONTEXT_LENGTH = Reason.UNAVAILABLE, Reason.CONTEXT_LENGTH
_NAMING = frozenset({Gone.RETRIED, Gone.LOCAL_REPLY, Gone.DISCONNECTED})
"""Gone reasons a CLIENT span names as its `error.type` when no answer had started."""


def expiry_phase(
    now: float,
    budget_at: float | None,
    *,
    stream: bool,
    started: bool,
    early: float = 0.0,
    budget_bound: bool = False,
    start_held: bool = False,
    first_token_sooner: bool = False,
    slow_at: float | None = None,
) -> Phase:
    """What an expiry means: the phase an attempt's deadline that fired at `now` ran out in,
    from what the front saw. One rule for both fronts; each gives the facts it has.

    `budget_at`: the end of the caller's budget (None: none); `early`: how much sooner than
    its time the front's timer may fire (the ASGI front's asyncio timer, by up to its clock
    resolution), so a budget or a throughput floor reached within it counts as reached;
    `budget_bound`: the bound that fired was cut to the budget (the machine gave it: behind
    Envoy); `stream`: the answer is a stream; `started`: its start went on to the client;
    `start_held`: a successful start is held back waiting for its first content;
    `first_token_sooner`: the stream's first bound is its first-token bound, the sooner of
    that and its time to start (through the ASGI front, not behind Envoy: a recorded
    difference); `slow_at`: when the started stream's throughput floor passes (None: none).
    """
    if budget_bound or (budget_at is not None and now >= budget_at - early):
        return Phase.BUDGET  # the caller's budget ended it: no account is to blame
    if not stream:
        return Phase.TOTAL
    if not started:
        return _FIRST_TOKEN if start_held or first_token_sooner else Phase.HEADERS
    if slow_at is not None and now >= slow_at - early:
        return Phase.SLOW
    return Phase.IDLE


def expiry_resumable(phase: str) -> bool:
    """Whether a stream whose content started and whose deadline then ran out in `phase`
    (`expiry_phase`) may be continued on another account: not when the caller's budget
    ended it, for no time is left for a continuation (its end is the answer)."""
    return phase != Phase.BUDGET


TIMER_SLACK_SECS = 0.005
"""How much sooner than its bound a front's timer may be seen to fire: Envoy's per-try timer
runs on its event loop's cached time, measured firing up to 1.1 ms before this process's clock
said the bound had passed since the attempt was sent."""


class AttemptMachine:
    """The attempts of one request. Build it with `engine.machine(ctx, ...)`, the one place
    one is built (`grounds`: what it decides with, the engine's).

    `parent`: the span attempt spans hang under (None: the current span); `traced`: whether
    spans are made at all; `checks_errors`: the front runs an app whose framework may answer
    a transport error with its own 5xx (ASGI), so a 5xx is held until the attempt ends.
    """

    __slots__ = (
        "_budget_bound",
        "_chained",
        "_claim",
        "_client_span",
        "_clock",
        "_failed",
        "_failure",
        "_hedge",
        "_key",
        "_key_refusal",
        "_keys_refused",
        "_last",
        "_lease",
        "_parent",
        "_reach",
        "_recorder",
        "_released",
        "_retry_headers",
        "_sent_at",
        "_span",
        "_status",
        "_too_long",
        "_traced",
        "_uncounting",
        "checks_errors",
        "ctx",
        "grounds",
        "state",
        "tried",
        "within",
    )

    # Not keyword-only: the ASGI front builds one per request, positionally (a call with
    # keywords builds a dict of them first).
    def __init__(
        self,
        grounds: Grounds,
        ctx: RequestContext,
        traced: bool = False,
        parent: trace.Span | None = None,
        checks_errors: bool = False,
    ) -> None:
        self.grounds = grounds
        self._clock = grounds.clock  # `time.monotonic`: the budget's clock (`ctx.budget_at`)
        self._recorder = grounds.recorder
        self.ctx = ctx
        self.state = _READY
        self.tried: list[str] = []
        """The accounts tried so far, in order."""
        self.within: Collection[str] | None = None
        """The accounts a later attempt may go to (behind Envoy: those on the routed
        cluster, set once it is known); the model then stays (the body is on its way), but
        for a fallback chain's models where the front rewrites a retry's body
        (`grounds.rewrites_retries`). None: any account the front can send to, and the
        canary's base model."""
        self.checks_errors = checks_errors
        self._traced = traced
        self._parent = parent
        self._reach = _OPEN
        self._lease: Lease | None = None
        self._claim: tuple[Lease, tuple[str, ...], int] | None = None
        self._status: int | None = None
        self._retry_headers: list[tuple[str, str]] | None = None
        self._failure: Failure | None = None
        self._released: str | None = None  # why a lease went back before any answer
        self._last: tuple[object, Account | None, str | None] | None = None
        self._span: trace.Span | None = None
        self._client_span: trace.Span | None = None
        self._budget_bound = False
        self._key: int | _Unset | None = _UNSET  # the conversation's, worked out once
        self._chained: dict[str, Reason] = {}
        """Models of a fallback chain offered so far, with why (a move there is a fallback)."""
        self._too_long: set[str] = set()
        """Models that refused this request's prompt as too long: none is tried again."""
        self._sent_at: float | None = None  # when the attempt in flight was sent (`_clock`)
        self._hedge: _Hedge | None = None  # a second attempt racing the one in flight
        self._failed: dict[str, set[str]] = {}
        """What failed in this request, as faults are kept: per model, the accounts tried for
        it (none is tried for that model again; its other models stay open). A token count
        starts with the accounts that cannot count (`_skip_uncounting`)."""
        self._keys_refused: set[str] = set()
        """Accounts whose key or billing was refused in this request: none is tried again, for
        any model (the key is the account's, whatever the model)."""
        self._key_refusal = _NO_REFUSAL
        self._uncounting: Collection[str] = ()  # a token count's skipped accounts

    def __repr__(self) -> str:
        return f"<AttemptMachine {self.state.name} tried={self.tried}>"

    @property
    def lease(self) -> Lease | None:
        """The lease of the attempt in flight (None: none is)."""
        return self._lease

    @property
    def failure(self) -> Failure | None:
        """How the current (or last) attempt failed before reaching the client, if it did."""
        return self._failure

    # --- events -------------------------------------------------------------------------

    def begin(self) -> Start:
        """The request's first attempt, once its model is decided."""
        if (self.state, "begin") not in _TRANSITIONS:
            self._refuse("begin")
        ctx, grounds = self.ctx, self.grounds
        model = ctx.resolved_model
        if model is None or ctx.view is None:
            self.state = _DONE
            return PASS_THROUGH
        if ctx.view.counts:
            self._skip_uncounting(model)
        else:
            # The usual first attempt, one step: its lease (the conversation's key worked out
            # only where a priority serving the model has several accounts), sent unless it
            # is a probe whose claim the shared store must agree to (then as `_acquire` does).
            pool = grounds.pool
            lease = pool.acquire(model, allowed=grounds.routable, key=self._conversation_key)
            if lease is not None:
                if lease.probe and pool.store is not None:
                    self._claim = (lease, self._candidates(), 0)
                    self.state = _CLAIMING
                    return ClaimProbe(lease.account, lease.unit)
                return self._send(lease, model)
        if not grounds.places(ctx):
            self.state = _DONE
            return PASS_THROUGH  # no account it can reach serves the model
        return self._onward(self._candidates(), 0)

    def _skip_uncounting(self, model: str) -> None:
        """A token count goes only to an account that can count: those that cannot (Bedrock)
        are out for every model it may go to, as if they had failed it, unless none serving
        its model can count (then its account answers the wire's 404). Worked out once, at
        the first attempt; ordinary requests never come here."""
        uncounting = self._uncounting = self.grounds.cannot_count(model)
        if uncounting:
            for candidate in self._candidates():
                self._failed[candidate] = set(uncounting)

    def probe_claimed(self, shared: Shared | None) -> Start:
        """The store's answer to `ClaimProbe`: None, the probe is ours; else why not."""
        if (self.state, "probe_claimed") not in _TRANSITIONS:
            self._refuse("probe_claimed")
        claim, self._claim = self._claim, None
        assert claim is not None
        lease, models, index = claim
        pool = self.grounds.pool
        if shared is None:
            if self._reach is _CLOSED:
                # The request ended while the store answered: nobody would settle it.
                self.grounds.settle(lease, None, Gone.UNUSED, models[index])
                self.state = _DONE
                return DONE
            return self._send(lease, models[index])
        pool.claim_refused(lease, shared)
        return self._onward(models, index)

    def claim_abandoned(self) -> None:
        """The claim raised or was cancelled: its local probe slot goes back."""
        if (self.state, "claim_abandoned") not in _TRANSITIONS:
            self._refuse("claim_abandoned")
        claim, self._claim = self._claim, None
        assert claim is not None
        self.grounds.pool.claim_abandoned(claim[0])
        self.state = _DONE

    def started(
        self, status: int, headers: Iterable[tuple[bytes | str, bytes]] = ()
    ) -> Hold | _Signal:
        """The attempt's answer began with `status` (`headers`: its headers, read for a 429's
        retry time). Hold it back while another account may take over."""
        if (self.state, "started") not in _TRANSITIONS:
            self._refuse("started")
        self._status = status
        if status < 400 and self.grounds.plain_success(self.ctx, status):
            self.state = _FORWARDING  # the usual answer: nothing to hold, no rule to ask
            return FORWARD
        if status == 429 or status >= 500:  # a 5xx may say when to retry in place too
            self._retry_headers = throttle_headers(headers)
        if self._reach in _GOES_ON:
            if status in _READ_STATUSES:
                # A billing refusal in disguise (a 429, a 400) or a context-length refusal: its
                # body says which, and what comes next.
                self.state = _READING
                return HOLD_FOR_FAILOVER
            if (
                status in _KEY_STATUSES  # never the client's: replaced if nothing else serves
                or self._worth_retrying(status)
                or (status >= 429 and self._in_place_secs() is not None)
            ):
                self.state = _HOLDING
                return HOLD_FOR_FAILOVER
        if status >= 500 and self.checks_errors:
            self.state = _CHECKING
            return HOLD_TO_CHECK
        self.state = _FORWARDING
        return FORWARD

    def cannot_hold(self) -> _Signal:
        """The driver stops holding (the answer outgrew what it holds, or the work returned
        mid-answer): what it held goes on, and no failover can follow."""
        if (self.state, "cannot_hold") not in _TRANSITIONS:
            self._refuse("cannot_hold")
        self.state = _FORWARDING
        return FORWARD

    def read(self, body: bytes) -> None:
        """The body of the 400 or 429 held in READING (at most `error_bodies.MAX_BODY` of it
        is read): a billing refusal is its account's key fault, and the request moves on
        without it; a context-length refusal moves the next attempt to the model's chain
        (`ended` then answers `NEXT`)."""
        if (self.state, "read") not in _TRANSITIONS:
            self._refuse("read")
        status, model = self._status or 0, self.ctx.resolved_model
        if billing_refusal(status, body):
            self._key_refusal = _READ
        elif model is not None and context_refusal(status, body) and self._reads_refusal():
            self._too_long.add(model)

    def first_content(self) -> _Signal:
        """The attempt's answer carried its first content. With one attempt in flight it
        simply goes on; with a hedge this is where the first to answer wins."""
        if (self.state, "first_content") not in _TRANSITIONS:
            self._refuse("first_content")
        return FORWARD

    def ended(
        self,
        how: How,
        failure: Failure | None = None,
        *,
        error: type[BaseException] | None = None,
        gone: Gone | None = None,
        held: object = None,
        body_follows: bool = False,
    ) -> End:
        """The attempt ended (`How`). `held`: the answer the driver held back, if any;
        `body_follows`: the answer's body is read after this (its usage), so the attempt's
        spans stay open until `closed()`.

        Answers `DONE` when the attempt's answer (or nothing) is what the client gets,
        `NEXT` when another attempt may follow, else what to answer instead.
        """
        state = self.state
        if (state, "ended") not in _TRANSITIONS:
            self._refuse("ended")
        ctx, status = self.ctx, self._status
        if how is _FINISHED or (how is _RETURNED and state is _FORWARDING):
            if self._span is None and self.grounds.plain_success(ctx, status or 500):
                # The usual answer: a success with no span, nothing else to count or show.
                lease, self._lease = self._lease, None
                assert lease is not None
                self.grounds.succeeded(lease, ctx.resolved_model)
                self.state = _DONE
                return DONE
            finished = how is _FINISHED
            gone = _DISCONNECTED if ctx.disconnected and not finished else None
            self._settle(*self._verdict(finished, gone), body_follows=body_follows)
            return self._done()
        if how is _RAISED:
            return self._raised(failure, error)
        if how is _GONE:
            gone = gone or _DISCONNECTED
            self._settle(*self._verdict(False, gone))
            if gone is Gone.RETRIED:
                return self._after_failure()
            return self._done()
        return self._returned(held)

    def next(self) -> Start:
        """Start the attempt `NEXT` announced, if an account can still take it."""
        if (self.state, "next") not in _TRANSITIONS:
            self._refuse("next")
        if not self._may_go_on():
            return self._give_up()
        return self._onward(self._candidates(), 0)

    def waited(self) -> Start:
        """The `Wait` is over: the same account again, its throttle hold for the model aside
        (the wait was that hold's time); a cooled account or a spent budget gives up."""
        if (self.state, "waited") not in _TRANSITIONS:
            self._refuse("waited")
        if not self._may_go_on():
            return self._give_up()
        model = self.ctx.resolved_model
        assert model is not None
        pool = self.grounds.pool
        lease = pool.lease_again(self.tried[-1], model)
        if lease is None:
            return self._give_up()
        if lease.probe and pool.store is not None:
            self._claim = (lease, (model,), 0)
            self.state = _CLAIMING
            return ClaimProbe(lease.account)
        return self._send(lease, model)

    def broke(self, reason: str, after_bytes: int, allowed: Collection[str]) -> Start:
        """The stream the client was reading broke after its content started (`reason`: cut,
        idle or slow; `ended` settled its attempt, a fault): its continuation goes to another
        account of the same model among `allowed` (those that take a prefill), or `DONE` when
        none can take it now. The continuation is the request's last attempt: nothing fails it
        over, and its span says it resumed a stream after `after_bytes` bytes."""
        if (self.state, "broke") not in _TRANSITIONS:
            self._refuse("broke")
        ctx = self.ctx
        model = ctx.resolved_model
        if model is None or not self._may_go_on():  # closed, or nobody waits
            return DONE
        broken = self.tried[-1] if self.tried else ""
        self._reach = _LAST  # a continuation is never failed over: its failure ends the stream
        key = self._conversation_key()
        pool = self.grounds.pool
        lease = pool.acquire(model, exclude=self._excluded(model), allowed=allowed, key=key)
        if lease is None:
            return DONE
        if lease.probe and pool.store is not None:
            # A probe shared across replicas waits for the store's word: a client reading a
            # stream does not wait for that; the slot goes back.
            pool.claim_abandoned(lease)
            return DONE
        action = self._send(lease, model)
        if self._span is not None:
            self._recorder.resumed(self._span, broken, reason, after_bytes)
        return action

    def retried(self, unanswered: Failure | None = None, phase: Phase | None = None) -> End:
        """The front started another attempt on its own (Envoy's retry): an attempt still
        in flight goes back with no outcome; `NEXT` unless the request ended.

        `unanswered`: what it means when that attempt's answer never started (Envoy retried a
        connect failure or a reset before the headers): then it is that account fault; past
        the attempt's deadline it is the deadline's (Envoy's per-try timeout, a stream's time
        to start, or `phase` when the front knows better), counted as `expired` counts it."""
        if (self.state, "retried") not in _TRANSITIONS:
            self._refuse("retried")
        if self.state is _SENT and unanswered is not None:
            if self.past_deadline():
                return self._timed_out(phase)
            end = self.ended(_RAISED, unanswered)
            if phase is _FIRST_TOKEN:
                # Its answer was held for late content: that is the 504 if none follows.
                self.ctx.deadline_phase = phase
            return end
        if self.state in _IN_FLIGHT:
            return self.ended(_GONE, gone=Gone.RETRIED)
        if self.state is _CLAIMING or self._reach is _CLOSED:
            return DONE
        self.state = _BETWEEN  # BETWEEN or DONE (the table)
        return NEXT

    def expired(self, phase: Phase | None = None) -> Refuse:
        """A deadline ran out in `phase` (None: work it out from the attempt's deadline).
        The attempt in flight is settled as the phase says, and the 504 is the answer.
        A first token reported late once the machine's own deadline answer ended the request
        (behind Envoy: its per-try timer fires while the first-token filter's 504 is on its
        way) is that answer again, not another deadline."""
        if (self.state, "expired") not in _TRANSITIONS:
            self._refuse("expired")
        ctx = self.ctx
        if phase is _FIRST_TOKEN and self.state is _DONE and ctx.deadline_phase is not None:
            return Refuse(answers.deadline_exceeded(ctx.deadline_phase))
        if phase is None:
            phase = self.phase()
        ctx.deadline_phase = phase
        self._recorder.deadline_exceeded(phase)
        if self.state in _IN_FLIGHT:
            self._status = 504
            self._settle(*self._verdict(False, None))
        if self.state is not _CLAIMING:  # a claim under way still reports back
            self.state = _DONE
        return Refuse(answers.deadline_exceeded(phase))

    def fails_over(self) -> bool:
        """After `ended` answered `NEXT`: whether the next attempt can go now, in the order of
        moves `next()` follows (a peek: nothing claimed): another account of the model, else,
        when no retry in place is due first, a model of the chain."""
        if self.state is not _BETWEEN:
            return False
        models = self._candidates()
        own = self._own(models)
        if self._another_free(models[:own]):
            return True
        return self._in_place_secs() is None and self._another_free(models[own:])

    def waits_in_place(self) -> float | None:
        """After `ended` answered `NEXT`: the wait before the next attempt when it is a retry
        in place (no other account of the model can take it now: a short wait on the model
        beats a model of the chain), else None. For a front whose retry is another's to time
        (Envoy's back-off): `next()` then answers `Wait`, and `waited()` may follow at once."""
        if self.state is not _BETWEEN:
            return None
        models = self._candidates()
        if self._another_free(models[: self._own(models)]):
            return None
        return self._in_place_secs()

    def replacement(self) -> Refuse | None:
        """The front makes no other attempt and passes the last upstream answer on (Envoy's
        router-level stream, at the final response): None when that answer may reach the
        client; else what to answer in its place, because it refused its account's key or
        billing (a provider's refusal of its own key is never the client's 401)."""
        if (self.state, "replacement") not in _TRANSITIONS:
            self._refuse("replacement")
        if self._key_refusal is not _SETTLED or self.state in _IN_FLIGHT or self.state is _CLAIMING:
            return None
        if self._reach is not _CLOSED:
            self._reach = _LAST
        self.state = _DONE
        return self._refusal()

    def past_deadline(self) -> bool:
        """Whether the attempt in flight has run past its deadline (`ctx.attempt_deadline_secs`
        from its send, less `TIMER_SLACK_SECS`): a front's retry of it is then the deadline's,
        not a dropped connection's."""
        bound, sent_at = self.ctx.attempt_deadline_secs, self._sent_at
        if self.state is not _SENT or bound is None or sent_at is None:
            return False  # no attempt in flight that has not answered
        return self._clock() - sent_at >= bound - TIMER_SLACK_SECS

    def content_late(self) -> End:
        """A stream whose headers the front holds back sent no content event within its
        first-token bound (`first_token_secs`): the attempt's deadline fault, phase
        `first_token` (`budget` when the caller's budget ended it: no account's fault).
        `NEXT` when another account can take the next attempt now; else the 504 to answer
        (nothing of the stream reached the client)."""
        if (self.state, "content_late") not in _TRANSITIONS:
            self._refuse("content_late")
        budget_at = self.ctx.budget_at
        spent = budget_at is not None and self._clock() >= budget_at
        phase = Phase.BUDGET if spent else Phase.FIRST_TOKEN
        end = self._timed_out(phase)
        if end is NEXT and not self._another_free():
            self.state = _DONE
            return Refuse(answers.deadline_exceeded(phase))
        if isinstance(end, Refuse):
            return Refuse(answers.deadline_exceeded(phase))
        return end

    def sent_at(self) -> float | None:
        """When the attempt in flight was sent (the machine's clock); None: none is."""
        return self._sent_at

    def _timed_out(self, phase: Phase | None = None) -> End:
        """The attempt in flight ran out of time and another may follow (a front's retry)."""
        phase = phase or self.phase()
        self.ctx.deadline_phase = phase
        self._recorder.deadline_exceeded(phase)
        self._status = 504
        self._failure = Failure.DEADLINE
        self._settle(*self._verdict(False, None))
        return self._after_failure()

    def retries_over(self) -> None:
        """The front can make no other attempt (Envoy is past retrying): whatever answers
        now is the answer."""
        if (self.state, "retries_over") not in _TRANSITIONS:
            self._refuse("retries_over")
        if self._reach is not _CLOSED:
            self._reach = _LAST

    def closed(self) -> None:
        """The request ended: an attempt in flight goes back with no outcome, spans still
        open end, and a probe claimed meanwhile goes back unused."""
        if (self.state, "closed") not in _TRANSITIONS:
            self._refuse("closed")
        self._reach = _CLOSED
        if self._hedge is not None:
            self.hedge_over(won=False, status=Gone.DISCONNECTED)
        if self.state in _IN_FLIGHT:
            self._settle(*self._verdict(False, _DISCONNECTED))
            self.state = _DONE
        elif self.state is not _CLAIMING:
            self._end_spans()
            self.state = _DONE

    # --- hedged first tokens (`engine.hedging`; the ASGI front races them) ---------------

    def may_hedge(self) -> bool:
        """Whether a hedge could start now (a peek: nothing claimed): the attempt in flight
        has not answered, and another account of its model is free."""
        model = self.ctx.resolved_model
        if self.state is not _SENT or self._hedge is not None or model is None:
            return False
        grounds = self.grounds
        reach = self.within if self.within is not None else grounds.serving(model)
        excluded = self._excluded(model)
        untried = [n for n in reach if n not in excluded]
        return (
            bool(untried)
            and self._may_go_on()
            and grounds.pool.retry_after_secs(model, allowed=untried) == 0.0
        )

    def hedge_due(self) -> float | None:
        """Seconds from the attempt's send to its hedge, or None when it has none: no account
        hedges, its account does not (`hedge_after_secs`), its stream's content events are
        unknown (no first content to race for), or no other account could take a hedge now.
        Asked once per attempt: the request counts in its model's hedge budget at its first
        attempt that may hedge."""
        hedging, ctx = self.grounds.hedging, self.ctx
        client, view, model = ctx.account, ctx.view, ctx.resolved_model
        if hedging is None or client is None or view is None or model is None:
            return None
        after = hedging.after_secs(client.name)
        if after is None or (view.stream and watch_for(view.wire) is None):
            return None
        if len(self.tried) == 1:
            hedging.note_request(model)
        return after if self.may_hedge() else None

    def hedge(self) -> Send | AskBudget | None:
        """The attempt in flight produced no content by its hedge time (`hedge_due`): a second
        attempt on another account of the same model (never another model: both race for one
        answer), when one could take it now and the model's hedge budget allows (asked only
        then: the budget counts a hedge it allows); `AskBudget` when that budget is shared
        across replicas; else None. The front runs both; the first to produce content wins,
        and `hedge_over` (or `race_failed`) says how the race ended."""
        if (self.state, "hedge") not in _TRANSITIONS:
            self._refuse("hedge")
        hedging, model = self.grounds.hedging, self.ctx.resolved_model
        if hedging is None or model is None or not self.may_hedge():
            return None
        shared = hedging.shared_budget(model)
        if shared is not None:
            return AskBudget(partial(hedging.ask_shared, shared, model))
        if not hedging.try_hedge(model):
            return None
        return self._start_hedge()

    def hedge_allowed(self, allowed: bool) -> Send | None:
        """The shared budget's answer to `AskBudget`: the hedge, if it allows one and the
        attempt in flight still has not answered (else None: counted, but the budget only
        errs on the side of fewer hedges)."""
        if (self.state, "hedge_allowed") not in _TRANSITIONS:
            self._refuse("hedge_allowed")
        if not allowed or self.state is not _SENT:
            return None
        return self._start_hedge()

    def race_failed(
        self,
        *,
        hedge: bool,
        status: int | None,
        error: type[BaseException] | None,
        report: RequestContext,
    ) -> None:
        """One of the two attempts racing ended without content while the other goes on:
        `hedge` the hedge (else the first attempt; the hedge goes on as the request's), with
        `status` (its answer's, if one started) and `error` (the exception it raised; None:
        it returned); `report`: the context its app reported into (a transport error, the
        upstream status). Its lease goes back with what its end says about its account."""
        if (self.state, "race_failed") not in _TRANSITIONS:
            self._refuse("race_failed")
        outcome: Outcome | None
        if error is not None:
            failure = attempts.error_kind(
                error, deadline_phase=None, transport_error=report.transport_error
            )
            outcome = None if failure is _APP_ERROR else _FAULT
            said: str = failure
        else:
            outcome, said = attempts.verdict(
                status,
                finished=False,
                gone=None,
                deadline_phase=None,
                upstream_status=report.upstream_status,
            )
        self.hedge_over(won=not hedge, outcome=outcome, status=said)

    def content_after(self, account: str, secs: float) -> None:
        """An attempt on `account` produced its first content `secs` after it was sent: the
        time `hedge_after_secs = "auto"` learns from."""
        hedging = self.grounds.hedging
        if hedging is not None:
            hedging.record(account, secs)

    def _start_hedge(self) -> Send | None:
        ctx, grounds = self.ctx, self.grounds
        model = ctx.resolved_model
        if self._hedge is not None or model is None or not self._may_go_on():
            return None
        pool = grounds.pool
        allowed = self.within if self.within is not None else grounds.routable
        key = self._conversation_key()
        lease = pool.acquire(model, exclude=self._excluded(model), allowed=allowed, key=key)
        if lease is None:
            return None
        if lease.probe and pool.store is not None:
            # A probe waits for the store's word: no race is worth that wait.
            grounds.settle(lease, None, Gone.UNUSED, model)
            return None
        self.tried.append(lease.account)
        self._failed.setdefault(model, set()).add(lease.account)
        ctx.attempts += 1
        account = grounds.accounts[lease.account].for_model(model)
        hedge = self._hedge = _Hedge(lease, account, self._clock())
        if not self._traced:
            return Send(lease, model, None)
        hedge.span, hedge.client_span = self._recorder.attempt(
            ctx, lease, model, hedge.account.base_url, self._parent, hedge=True
        )
        return Send(lease, model, hedge.client_span)

    @property
    def hedge_account(self) -> Account | None:
        """The account of the hedge in flight (None: no hedge is)."""
        return None if self._hedge is None else self._hedge.account

    def hedge_over(
        self, *, won: bool, outcome: Outcome | None = None, status: str = Gone.HEDGE_LOST
    ) -> None:
        """The race is decided. `won`: the hedge goes on as the request's attempt (it produced
        content first, or the first attempt failed before any), and the first attempt's lease
        goes back with `outcome` and `status`; else the hedge's does. The loser of a race
        goes back with no outcome (`hedge_lost`): losing says nothing about its account."""
        if (self.state, "hedge_over") not in _TRANSITIONS:
            self._refuse("hedge_over")
        hedge, self._hedge = self._hedge, None
        assert hedge is not None
        model = self.ctx.resolved_model
        if won:
            lease = self._take_lease()
            loser: tuple[trace.Span | None, trace.Span | None] = (self._span, self._client_span)
            self._lease, self._span, self._client_span = hedge.lease, hedge.span, hedge.client_span
            self._sent_at = hedge.sent_at  # the attempt in flight is the hedge, sent then
            self.ctx.account = hedge.account
        else:
            lease, loser = hedge.lease, (hedge.span, hedge.client_span)
        span, client_span = loser
        recorder = self._recorder
        if span is not None:
            recorder.settled(span, outcome, status)
        self.grounds.settle(lease, outcome, status, model)
        recorder.lost(span, client_span, model, status)
        recorder.hedge_result(model or "", won, hedge.account.name)

    # --- the attempt deadline -----------------------------------------------------------

    def deadline(self, now: float) -> tuple[float, float | None]:
        """The attempt's first bound (a stream: its time to start; else the time to be whole)
        and what is left of the caller's budget at `now` (None: no budget);
        `ctx.attempt_deadline_secs` is the first as it binds (cut to the budget)."""
        ctx = self.ctx
        client = ctx.account
        assert ctx.view is not None
        assert client is not None
        secs = attempts.deadline_secs(ctx.view, client.spec)
        budget_at = ctx.budget_at
        if budget_at is None:  # the usual request: no budget, the attempt's own bound binds
            ctx.attempt_deadline_secs = secs
            self._budget_bound = False
            return secs, None
        # What x-switchyard-deadline-ms reports: the deadline as it binds, budget included.
        ctx.attempt_deadline_secs = attempts.in_force(secs, budget_at, now)
        left = budget_at - now
        self._budget_bound = left < secs
        return secs, left

    def first_content_due(self, hedge: bool = False) -> float | None:
        """When the first content event of the attempt in flight is due (the machine's
        clock): its account's `first_token_secs` (else `timeout_secs`) from its send, or the
        end of the caller's budget when that comes sooner; `hedge`: the hedge racing it (from
        the hedge's own send, on its account). None when there is nothing to hold for: not a
        stream, or no attempt in flight that has not answered (or no hedge racing it)."""
        ctx, sent_at = self.ctx, self._sent_at
        view, client = ctx.view, ctx.account
        if hedge:
            racing = self._hedge
            sent_at, client = (None, None) if racing is None else (racing.sent_at, racing.account)
        if self.state is not _SENT or sent_at is None or client is None:
            return None
        if view is None or not view.stream:
            return None
        due = sent_at + first_token_secs(client.spec)
        budget_at = ctx.budget_at
        return due if budget_at is None or due <= budget_at else budget_at

    def since_sent(self, *, hedge: bool = False) -> float | None:
        """Seconds since the attempt in flight was sent (`hedge`: the hedge racing it); None:
        none is. What `content_after` learns from, and what tells a hedge from a retry."""
        racing = self._hedge
        sent_at = self._sent_at if not hedge else None if racing is None else racing.sent_at
        return None if sent_at is None else self._clock() - sent_at

    def new_try_is_hedge(self, after_secs: float) -> bool:
        """Whether a try the front did not ask for (behind Envoy, the route's `hedge_policy`)
        is the hedge of the attempt in flight: that attempt has not answered, no hedge races
        it, and at least half its hedge time (`after_secs`) has passed. A sooner try is the
        front's retry of an attempt that never answered (a reset, a refused connection)."""
        since = self.since_sent()
        return (
            self.state is _SENT
            and self._hedge is None
            and since is not None
            and since >= after_secs * _HEDGE_EARLY
        )

    def ends_in_budget(self, secs: float) -> bool:
        """Whether a wait of `secs` from now ends inside the caller's budget (a retry in
        place's; behind Envoy, the longest its jittered back-off can take)."""
        budget_at = self.ctx.budget_at
        return budget_at is None or self._clock() + secs < budget_at

    def phase(self, *, started: bool = False) -> Phase:
        """The phase a deadline that fired now ran out in (`expiry_phase`), from the bound
        `deadline` set: behind Envoy, whose timers fire no sooner than asked."""
        ctx = self.ctx
        view = ctx.view
        return expiry_phase(
            self._clock(),
            ctx.budget_at,
            stream=view is not None and view.stream,
            started=started,
            budget_bound=self._budget_bound,
        )

    # --- the one retry rule -------------------------------------------------------------

    def _may_go_on(self) -> bool:
        """Whether the request may still take another attempt: someone waits for it and the
        caller's budget is not spent."""
        ctx = self.ctx
        return (
            self._reach in _GOES_ON
            and not ctx.disconnected
            and (ctx.budget_at is None or self._clock() < ctx.budget_at)
        )

    def _worth_retrying(self, status: int) -> bool:
        """Whether an answer with `status` should give way to another account: it says
        something against its account, and one could take over now (a peek: nothing
        claimed)."""
        ctx = self.ctx
        if self.grounds.plain_success(ctx, status) or ctx.deadline_phase == Phase.BUDGET:
            return False  # a success, or the caller's budget ran out (no account to blame)
        found, _ = attempts.outcome(
            status, deadline_phase=ctx.deadline_phase, upstream_status=ctx.upstream_status
        )
        return found is not _SUCCESS and self._may_go_on() and self._another_free()

    def _in_place_secs(self) -> float | None:
        """The wait before retrying the last answer on its own account (retry in place), or
        None: off for the account, spent already, not such an answer, or past the budget."""
        ctx = self.ctx
        account = ctx.account
        if (
            self._reach is not _OPEN
            or self._failure is not None
            or account is None
            or not self.tried
        ):
            return None
        if self._key_refusal is _SETTLED:
            return None  # a refused key or billing does not heal by waiting (its 429 neither)
        if self.within is not None and self.tried[-1] not in self.within:
            return None  # the next attempt goes elsewhere (behind Envoy: another provider)
        secs = in_place.wait_secs(
            self._status,
            self._retry_headers,
            max_secs=account.spec.retry_wait_max_secs,
            deadline_phase=ctx.deadline_phase,
            upstream_status=ctx.upstream_status,
        )
        if secs is None or not self._may_go_on():
            return None
        model = ctx.resolved_model
        if model is not None and self.grounds.pool.cooling_secs(account.name, model) > secs:
            return None  # its own faults cooled it past the wait: no retry to wait for
        if not self.ends_in_budget(secs):
            return None  # the wait would end past the caller's deadline
        return secs

    def _wait_in_place(self) -> Wait | None:
        secs = self._in_place_secs()
        if secs is None:
            return None
        self._reach = _WAITED  # at most once a request: never a loop
        self.state = _WAITING
        return Wait(self.tried[-1], secs)

    def _another_free(self, models: Iterable[str] | None = None) -> bool:
        """Whether an account can take an attempt for one of `models` (default: every
        candidate) now (a peek)."""
        grounds = self.grounds
        pool = grounds.pool
        for model in self._candidates() if models is None else models:
            reach = self.within if self.within is not None else grounds.serving(model)
            excluded = self._excluded(model)
            untried = [n for n in reach if n not in excluded]
            if untried and pool.retry_after_secs(model, allowed=untried) == 0.0:
                return True
        return False

    def _candidates(self) -> tuple[str, ...]:
        """The models the next attempt may go to, in order: the request's, then (before the
        front committed to a cluster) the canary's base model, then their fallback chains."""
        model = self.ctx.resolved_model
        if model is None:
            return ()
        if self.within is not None:
            found: tuple[str, ...] = (model,)
        else:
            base = self.grounds.takeover_base(self.ctx)
            found = (model,) if base is None or base == model else (model, base)
        if self.grounds.chains and self._may_change_model():
            found = self._chain(found)
        return found

    def _may_change_model(self) -> bool:
        """Whether a fallback chain may move the request: its signed thinking does not bind
        it to the model, and the front can rewrite the body for another attempt."""
        return not self.ctx.pinned_model and (self.within is None or self.grounds.rewrites_retries)

    def _chain(self, models: tuple[str, ...]) -> tuple[str, ...]:
        """`models` followed by their chains: after a context-length refusal only the
        refused model's `context_length` chain, else each model's `unavailable` chain."""
        chains, refused, chained = self.grounds.chains, self._too_long, self._chained
        assert chains is not None
        model = models[0]
        if model in refused:
            reason, order = _CONTEXT_LENGTH, chains.after(model, _CONTEXT_LENGTH)
        else:
            reason, order = _UNAVAILABLE, models
            for own in models:
                order += chains.after(own, _UNAVAILABLE)
        found: list[str] = []
        for after in order:
            if after not in refused and after not in found:
                found.append(after)
                if after not in models:
                    chained[after] = reason  # why it is offered now
        return tuple(found)

    def _reads_refusal(self) -> bool:
        """Whether a 400 is worth reading: the model has a `context_length` chain this
        request may follow."""
        chains, model = self.grounds.chains, self.ctx.resolved_model
        return (
            chains is not None
            and model is not None
            and chains.has(model, _CONTEXT_LENGTH)
            and self._may_change_model()
            and self._may_go_on()
        )

    # --- what an ended attempt means ----------------------------------------------------

    def _raised(self, failure: Failure | None, error: type[BaseException] | None) -> End:
        ctx = self.ctx
        if error is not None:
            failure = attempts.error_kind(
                error, deadline_phase=ctx.deadline_phase, transport_error=ctx.transport_error
            )
            if self._span is not None:
                self._recorder.raised(self._span, error)
        assert failure is not None
        if ctx.disconnected:
            self._settle(None, _DISCONNECTED)
            return self._done()
        if failure is _APP_ERROR:
            # A bug in the app says nothing about the account: counting it would let one bad
            # code path cool every account.
            self._settle(None, failure)
            return self._done()
        if self.state is _FORWARDING:
            self._settle(_FAULT, failure)
            return self._done()  # the answer started: nothing can replace it
        self._failure = failure  # an unfinished answer is never passed on
        self._settle(_FAULT, failure)
        return self._after_failure()

    def _returned(self, held: object) -> End:
        ctx, state = self.ctx, self.state
        if state is _READING:
            return self._read_out(held)
        error = ctx.transport_error
        if state is not _SENT and error is not None and (self._status or 0) >= 500:
            # The framework answered the transport error itself (Litestar, Django): its 5xx
            # is no upstream answer, so it is dropped as an escaping exception would be.
            self._failure = attempts.error_kind(
                error, deadline_phase=ctx.deadline_phase, transport_error=error
            )
            self._settle(_FAULT, self._failure)
            return self._after_failure()
        self._settle(*self._verdict(False, _DISCONNECTED if ctx.disconnected else None))
        if state is _CHECKING:
            self.state = _DONE
            return Deliver(held)  # a 5xx held only to see whether a transport error followed
        if state is _HOLDING and held is not None and self._key_refusal is not _SETTLED:
            # A refusal of the key or billing is never passed on: `_refusal` answers instead.
            self._last = (held, ctx.account, ctx.resolved_model)
        return self._after_failure()

    def _read_out(self, held: object) -> End:
        """A 400 or 429 held to be read ended: a billing refusal is its account's key fault
        (never passed on); a 429 or a context-length refusal is the last answer so far, and
        another account or the chain's models may follow; any other 400 goes on as it is."""
        ctx = self.ctx
        if self._key_refusal is _READ:
            self._settle(_FAULT, BILLING)  # cooled for every model, no throttle hold
            return self._after_failure()
        self._settle(*self._verdict(False, _DISCONNECTED if ctx.disconnected else None))
        if self._status != 429 and ctx.resolved_model not in self._too_long:
            self.state = _DONE
            return DONE if held is None else Deliver(held)
        if held is not None:
            self._last = (held, ctx.account, ctx.resolved_model)
        return self._after_failure()

    def _verdict(self, finished: bool, gone: Gone | None) -> tuple[Outcome | None, str]:
        ctx = self.ctx
        return attempts.verdict(
            self._status,
            finished=finished,
            gone=gone,
            deadline_phase=ctx.deadline_phase,
            upstream_status=ctx.upstream_status,
        )

    def _after_failure(self) -> End:
        """The attempt failed before reaching the client: another may follow, or not."""
        if self._may_go_on():
            self.state = _BETWEEN
            return NEXT
        return self._give_up()

    def _give_up(self) -> End:
        """No attempt can follow: the last held upstream answer, else switchyard's own."""
        self.state = _DONE
        last = self._last
        if last is not None:
            # The exposed headers name the account that gave the answer.
            held, self.ctx.account, self.ctx.resolved_model = last
            return Deliver(held)
        return self._refusal()

    def _refusal(self) -> Refuse:
        """switchyard's own answer when no upstream answer can be passed on. A refusal of an
        account's key or billing is the provider's refusal of *its* key, never the client's:
        when every account that could serve refused so in this request (or cools for it),
        the 503 that says so (`x-should-retry: false`)."""
        if self.ctx.deadline_phase is _FIRST_TOKEN:
            # Its answer was held for a first content event that came too late (behind
            # Envoy, its per-try timeout may fire before the first-token filter's timer).
            return Refuse(answers.deadline_exceeded(_FIRST_TOKEN))
        if self._failure in OUT_OF_TIME:
            # The call's own timeout or the deadline, whichever came first: the app's
            # framework may have answered before the deadline policy could.
            return Refuse(answers.deadline_exceeded(Phase.TOTAL))
        refused = self._keys_refused
        if self.tried and not refused:
            return Refuse(answers.unreachable())
        error, headers = self.grounds.nothing_serves(self.ctx, refused, self._uncounting)
        return Refuse(error, headers)

    def _done(self) -> _Signal:
        self.state = _DONE
        return DONE

    # --- leases and spans ---------------------------------------------------------------

    def _onward(self, models: tuple[str, ...], start: int) -> Start:
        """The next attempt among `models[start:]`, in the order of moves: another account of
        the request's own model (or the canary's base) at once; then, where the account's
        `retry_wait_max_secs` allows, the same account after its short wait; then the next
        model of the chain. Else no attempt can follow (`_give_up`)."""
        own = self._own(models) if self._chained else len(models)  # no chain: all its own
        if start < own:
            found = self._acquire(models, start, own) or self._wait_in_place()
            if found is not None:
                return found
            start = own
        return self._acquire(models, start) or self._give_up()

    def _own(self, models: tuple[str, ...]) -> int:
        """How many of `models` (from `_candidates`) come before the chain's: the request's
        own model and the canary's base (a model of the chain is a fallback when tried)."""
        chained, model = self._chained, self.ctx.resolved_model
        for index, candidate in enumerate(models):
            if candidate != model and candidate in chained:
                return index
        return len(models)

    def _excluded(self, model: str) -> Collection[str]:
        """The accounts no attempt for `model` may go to now: those that failed it in this
        request, and those whose key or billing was refused (for every model)."""
        failed, keys = self._failed, self._keys_refused
        if model not in failed:
            return keys
        return failed[model] | keys if keys else failed[model]

    def _acquire(
        self, models: tuple[str, ...], start: int, stop: int | None = None
    ) -> Send | ClaimProbe | None:
        """The next attempt's lease among `models[start:stop]`, or None when no account can
        take it now. A probe waits for the shared store's word when state is shared."""
        grounds = self.grounds
        pool = grounds.pool
        allowed = self.within if self.within is not None else grounds.routable
        key = self._conversation_key()
        for index in range(start, len(models) if stop is None else stop):
            model = models[index]
            lease = pool.acquire(model, exclude=self._excluded(model), allowed=allowed, key=key)
            if lease is None:
                continue
            if lease.probe and pool.store is not None:
                self._claim = (lease, models, index)
                self.state = _CLAIMING
                return ClaimProbe(lease.account, lease.unit)
            return self._send(lease, model)
        return None

    def _conversation_key(self) -> int | None:
        """The conversation's affinity key (`conversation_key`), worked out once, when first
        needed (a blake2b of the user id or first turn)."""
        key = self._key
        if key is _UNSET:
            key = self._key = conversation_key(self.ctx)
        return key

    def _send(self, lease: Lease, model: str) -> Send:
        ctx, grounds, tried = self.ctx, self.grounds, self.tried
        if model != ctx.resolved_model:
            self._moved(model)
            ctx.resolved_model = model  # the canary's base or a fallback; the body follows it
        again = bool(tried) and tried[-1] == lease.account  # in place: no failover
        tried.append(lease.account)
        # Out for this model in the rest of the request, as its failure would be kept (a
        # success ends the request): recorded now, so that a peek while it is in flight
        # (`_another_free`) already leaves it out.
        failed = self._failed
        if model in failed:
            failed[model].add(lease.account)
        else:
            failed[model] = {lease.account}
        if len(tried) > 1 and not again:
            self._recorder.failover(model)
        # The lease's account is the request's for this attempt, bound to the model where the
        # body and path carry the account's own name for it.
        name = lease.account
        client = grounds.accounts[name]
        if name in grounds.renaming:
            client = client.for_model(model)
        ctx.account = client
        ctx.attempts += 1
        ctx.upstream_status = ctx.deadline_phase = ctx.transport_error = None
        self._lease, self._status, self._retry_headers = lease, None, None
        self._sent_at = self._clock()
        self._failure = self._released = None
        self._key_refusal = _NO_REFUSAL
        self.state = _SENT
        if not self._traced:
            return Send(lease, model, None)
        self._span, self._client_span = self._recorder.attempt(
            ctx, lease, model, client.base_url, self._parent
        )
        return Send(lease, model, self._client_span)

    def _moved(self, model: str) -> Reason | None:
        """The request moves from its model to `model`: a fallback (counted, and said in
        `x-switchyard-route`) when `model` came from a chain, None for the canary's base."""
        ctx = self.ctx
        reason = self._chained.get(model)
        if reason is not None:
            if ctx.resolved_model in self._too_long:
                reason = _CONTEXT_LENGTH  # a model may be on both chains: the refusal says why
            self._recorder.fallback(ctx.resolved_model or "", model, reason.value)
            ctx.route = FALLBACK_ROUTE + reason.value
        return reason

    def _take_lease(self) -> Lease:
        lease, self._lease = self._lease, None
        assert lease is not None
        return lease

    def _settle(self, outcome: Outcome | None, status: str, *, body_follows: bool = False) -> None:
        """Give the attempt's lease back with what its end said about the account."""
        lease = self._take_lease()
        if self._span is not None:
            self._recorder.settled(self._span, outcome, status)
        self.grounds.settle(lease, outcome, status, self.ctx.resolved_model, self._retry_headers)
        # A refused key or billing shuts the account out of this request, for every model.
        if outcome is _FAULT and status in CREDENTIAL_STATUSES:
            self._key_refusal = _SETTLED
            self._keys_refused.add(lease.account)
        else:
            self._key_refusal = _NO_REFUSAL
        if outcome is None and status in _NAMING and self._status is None:
            self._released = status
        if not body_follows and self._span is not None:  # untraced: nothing to end
            self._end_spans()

    def _end_spans(self) -> None:
        """End the attempt's spans (once each); the CLIENT span carries the usage read."""
        span, client_span = self._span, self._client_span
        if span is None and client_span is None:
            return  # not traced, or ended already
        self._span = self._client_span = None
        ctx = self.ctx
        status = ctx.upstream_status if ctx.upstream_status is not None else self._status
        self._recorder.ended(span, client_span, ctx, status, self._failure or self._released)

    def _refuse(self, event: str) -> NoReturn:
        """`event` is out of place in this state (no row of `transitions.TRANSITIONS`)."""
        takes = sorted(state.name for (state, name) in _TRANSITIONS if name == event)
        raise MachineError(
            f"{event}() in state {self.state.name}: it is taken in {', '.join(takes) or 'none'}"
        )


class _Unset(enum.Enum):
    """A value not worked out yet (the conversation key, where None is an answer)."""

    UNSET = "unset"


_UNSET = _Unset.UNSET


class _Hedge:
    """A second attempt racing the one in flight: its lease, account and spans."""

    __slots__ = ("account", "client_span", "lease", "sent_at", "span")

    def __init__(self, lease: Lease, account: Account, sent_at: float) -> None:
        self.lease, self.account, self.sent_at = lease, account, sent_at
        self.span: trace.Span | None = None
        self.client_span: trace.Span | None = None


def conversation_key(ctx: RequestContext) -> int | None:
    """The request's account-affinity key: variant stickiness's key (the user id where the
    request carries one, else its first user turn's hash), as a 64-bit number; None: none."""
    view = ctx.view
    if view is None:
        return None
    key = view.user_key or view.first_turn_hash
    return None if key is None else key_hash(key)
