"""Which requests are LLM calls switchyard reads: the path names the wire, the body is JSON.

Anything else (another method or path, a body that is not JSON) passes through unread, through
either front.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..config import Server
from ..wire import WIRE_PATHS, Wire


def llm_paths(server: Server) -> dict[str, Wire]:
    """The wire of each LLM path: the known ones, then the server's `generic_paths`."""
    paths = dict(WIRE_PATHS)
    for path in server.generic_paths:
        paths.setdefault(path, Wire.GENERIC)
    return paths


def llm_wire(paths: Mapping[str, Wire], method: str, path: str) -> Wire | None:
    """The wire of an LLM call (a POST to one of `paths`; `path` without its query string);
    None for any other request, which passes through unread."""
    return paths.get(path) if method == "POST" else None


def json_media(content_type: bytes | None) -> bool:
    """Whether a request's content-type is JSON (a missing one counts as JSON)."""
    if content_type is None:
        return True
    known = _MEDIA.get(content_type)
    if known is None:
        media = content_type.split(b";", 1)[0].strip().lower()
        known = media == b"application/json" or media.endswith(b"+json")
        if len(_MEDIA) < 64:  # the few spellings clients use; never grown by odd ones
            _MEDIA[content_type] = known
    return known


_MEDIA: dict[bytes, bool] = {}
