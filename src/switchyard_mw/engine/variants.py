"""Moving one request to its canary variant, the guard that rolls a failing variant back, and
the telemetry that records both.

Shared by every transport (the ASGI variant policy, the ext_proc servicer), so a request is
split, counted, guarded and annotated the same way whoever serves it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry import trace

from ..config import Canary
from ..context import RequestContext
from ..core.clock import Clock, monotonic
from ..core.guard import GuardRule, Window
from ..core.variant_buckets import BUCKETS, KeyKind, Split
from ..telemetry import logs
from ..telemetry import names as tm


def build_splits(canaries: Mapping[str, Canary]) -> dict[str, Split]:
    """Each canaried model's bucket ranges, computed once at load."""
    return {
        model: Split.build(model, list(canary.variants.items()), canary.salt)
        for model, canary in canaries.items()
    }


def build_guards(canaries: Mapping[str, Canary]) -> dict[str, GuardRule]:
    """Each guarded canary's rule."""
    return {
        model: GuardRule(
            max_fault_rate=c.guard.max_fault_rate,
            min_requests=c.guard.min_requests,
            window_secs=c.guard.window_secs,
        )
        for model, c in canaries.items()
        if c.guard is not None
    }


class Canaries:
    """Every canary's split and guard: places requests on variants, rolls failing ones back.

    `record(model, fault=...)` is told every attempt's outcome on any model; a guarded canary
    counts its base's and its variants' attempts over its window, and trips a variant that
    breaks its rule: from then on that variant's share is 0, exactly as an operator's rollback
    to 0 would make it (its keys go back to the base model), except for conversations whose
    signed thinking pins them to their model. A trip lasts until the config is reloaded or the
    process restarts; `on_trip` hears of each once (to count it, and to share it).
    """

    def __init__(
        self,
        splits: Mapping[str, Split],
        *,
        guards: Mapping[str, GuardRule] | None = None,
        clock: Clock = monotonic,
    ) -> None:
        self._splits = dict(splits)  # as configured: pinned conversations keep using these
        self._live = dict(splits)  # with tripped variants taken out
        self._rules = dict(guards or {})
        self._tripped: dict[str, set[str]] = {base: set() for base in self._rules}
        # model -> the windows counting it: (canary base, window) for each guarded canary
        # whose base or variant it is.
        self._windows: dict[str, list[tuple[str, Window]]] = {}
        self._by_arm: dict[tuple[str, str], Window] = {}
        for base, rule in self._rules.items():
            split = self._splits.get(base)
            if split is None:
                continue
            for arm in (base, *(model for _, _, model in split.ranges)):
                window = Window(window_secs=rule.window_secs, clock=clock)
                self._windows.setdefault(arm, []).append((base, window))
                self._by_arm[(base, arm)] = window
        self.guarded = frozenset(self._windows)
        """The models a guard counts attempts of (a guarded canary's base and variants): an
        attempt on any other model has nothing to `record`."""
        self.on_trip: Callable[[str, str], None] | None = None

    @classmethod
    def from_config(cls, canaries: Mapping[str, Canary], *, clock: Clock = monotonic) -> Canaries:
        return cls(build_splits(canaries), guards=build_guards(canaries), clock=clock)

    def choose(
        self, model: str, user_key: str | None, turn: str | None, *, pinned: bool = False
    ) -> tuple[str, KeyKind] | None:
        """The variant for a request for `model`, and the key kind; None: no canary."""
        split = (self._splits if pinned else self._live).get(model)
        if split is None:
            return None
        return split.choose(user_key, turn)

    def assign(self, ctx: RequestContext) -> None:
        """Move the request to its variant when its (resolved) model has a canary."""
        model, view = ctx.resolved_model, ctx.view
        if model is None or view is None or model not in self._splits:
            return
        # A user id decides alone: the first turn is hashed only when there is none.
        turn = None if view.user_key else view.first_turn_hash
        split = self._live[model]
        # Only once a guard tripped does the live split differ from the configured one; only
        # then is it worth reading the conversation for signed thinking (which pins it).
        if split is not self._splits[model] and view.has_thinking:
            split = self._splits[model]
        variant, kind = split.choose(view.user_key, turn)
        ctx.resolved_model, ctx.variant, ctx.key_kind = variant, variant, kind
        tm.variant_assignments.add(model, variant, kind)
        if view.user_key and tm.tracing() and (span := trace.get_current_span()).is_recording():
            span.set_attribute(tm.VARIANT_KEY_HASH, tm.short_hash(view.user_key))

    # --- the guard ----------------------------------------------------------------------

    def record(self, model: str, *, fault: bool) -> None:
        """One attempt on `model` ended; `fault`: an account fault or a deadline."""
        windows = self._windows.get(model)
        if windows is None:
            return  # the usual case: a model no guarded canary looks at
        for base, window in windows:
            window.add(fault=fault)
            if fault and model != base and model not in self._tripped[base]:
                base_counts = self._by_arm[(base, base)].counts()
                if self._rules[base].trips(window.counts(), base_counts):
                    self.trip(base, model)

    def trip(self, base: str, variant: str, *, announce: bool = True) -> None:
        """Take `variant` of `base`'s canary out (its share to 0), here or told by a replica
        (then `announce=False`: it is not sent back out)."""
        split = self._splits.get(base)
        if split is None or variant not in {m for _, _, m in split.ranges}:
            return  # another replica runs a newer config: not ours to apply
        tripped = self._tripped.setdefault(base, set())
        if variant in tripped:
            return
        tripped.add(variant)
        ranges = tuple(r for r in split.ranges if r[2] not in tripped)
        self._live[base] = Split(base=split.base, salt=split.salt, ranges=ranges)
        logs.guard_tripped(model=base, variant=variant, here=announce)
        tm.canary_guard_trips.add(1, {tm.REQUEST_MODEL: base, tm.VARIANT: variant})
        if announce and self.on_trip is not None:
            self.on_trip(base, variant)

    def tripped(self, base: str, variant: str) -> bool:
        return variant in self._tripped.get(base, ())

    def signature(self, base: str) -> str:
        """`base`'s canary as configured (split, salt, guard), as a short digest: a trip kept in
        a shared store applies only where the canary is configured the same ("" if none)."""
        split = self._splits.get(base)
        if split is None:
            return ""
        return hashlib.sha256(repr((split, self._rules.get(base))).encode()).hexdigest()[:16]

    def status(self) -> list[dict[str, Any]]:
        """Each canary: its configured split, the guard's window counts and what tripped."""
        out = []
        for base, split in self._splits.items():
            rule = self._rules.get(base)
            arms = (base, *(model for _, _, model in split.ranges))
            window = {}
            if rule is not None:
                for arm in arms:
                    attempts, faults = self._by_arm[(base, arm)].counts()
                    window[arm] = {"attempts": attempts, "faults": faults}
            out.append(
                {
                    "model": base,
                    "variants": {m: (hi - lo) * 100 / BUCKETS for lo, hi, m in split.ranges},
                    "guard": None
                    if rule is None
                    else {
                        "max_fault_rate": rule.max_fault_rate,
                        "min_requests": rule.min_requests,
                        "window_secs": float(rule.window_secs),
                    },
                    "window": window,
                    "tripped": sorted(self._tripped.get(base, ())),
                }
            )
        return out
