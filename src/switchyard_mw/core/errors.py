"""The root of switchyard's exception tree, and the one exception the sans-IO core raises.

Here rather than in `switchyard_mw.errors` because the core imports nothing above itself and
no I/O library, while `errors` holds exceptions that are also httpx's. `errors` re-exports
both names and draws the whole tree.
"""


class SwitchyardError(Exception):
    """Base of every exception switchyard raises on purpose."""


class BadVerdict(SwitchyardError, ValueError):
    """The judge answered, but not with one of the route's labels."""
