"""ASGI callables typed loosely enough for Starlette, FastAPI and hand-written apps alike."""

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ..request_body import Message as Message
from ..request_body import Receive as Receive

Scope = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
