"""The root of switchyard's exception tree, and the exceptions the sans-IO core raises.

Here rather than in `switchyard_mw.errors` because the core imports nothing above itself and
no I/O library, while `errors` holds exceptions that are also httpx's. `errors` re-exports
both names and draws the whole tree.
"""


class SwitchyardError(Exception):
    """Base of every exception switchyard raises on purpose."""


class BadVerdict(SwitchyardError, ValueError):
    """The judge answered, but not with one of the route's labels."""


class FramingError(SwitchyardError, ValueError):
    """Bytes that are not an AWS event stream (`core.eventstream`): a checksum that does not
    match, a length out of bounds, a header that runs past its block, an unknown header type."""
