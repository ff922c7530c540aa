"""The reload signal before a server handles it: noted, not fatal.

Python leaves SIGHUP at its default, which ends the process. A server takes it over only once
its app has loaded (`reload.on_signal`, at the stack's startup), a second or more after the
process started: a SIGHUP sent meanwhile (a deploy that reloads every replica at once, a
supervisor passing one on) would end the server. `hold_early` notes it instead; whoever takes
the signal over asks `taken()` whether one came, and reloads once if so. This module imports
nothing slow, so that the hold is in place before what is.

A worker process is exposed longer: spawned, it starts as a new interpreter, and a SIGHUP its
parent passes on would end it before its own code runs. Its parent starts it inside
`blocked_for_children()`: a signal mask survives the fork and the exec, so the signal waits in
the child until its `hold_early` takes it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

RELOAD_SIGNAL: signal.Signals | None = getattr(signal, "SIGHUP", None)
"""The signal that reloads a process's config (none on Windows)."""

_asked = threading.Event()
"""A `RELOAD_SIGNAL` came while `hold_early` held it."""


def hold_early() -> None:
    """From now until a server takes `RELOAD_SIGNAL` over, note the signal instead of ending
    the process. Call it first thing in a process that will serve, before its slow imports
    and its config's loading. Only the main thread may set a handler: elsewhere, nothing."""
    if RELOAD_SIGNAL is not None and threading.current_thread() is threading.main_thread():
        signal.signal(RELOAD_SIGNAL, _note)
        # Started blocked (`blocked_for_children`): one sent meanwhile is taken now.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {RELOAD_SIGNAL})


@contextlib.contextmanager
def blocked_for_children() -> Iterator[None]:
    """Processes started inside start with `RELOAD_SIGNAL` blocked, until their `hold_early`;
    here the signal waits until the block ends (it is not lost)."""
    if RELOAD_SIGNAL is None:
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {RELOAD_SIGNAL})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _note(_signum: int, _frame: FrameType | None) -> None:
    _asked.set()


def taken() -> bool:
    """Whether the signal came while held (a config read before it may be stale); cleared."""
    asked = _asked.is_set()
    _asked.clear()
    return asked
