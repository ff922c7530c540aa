"""A Vertex account's OAuth token, from google-auth (the `vertex` extra), loaded on first use.

The token comes from a service-account key file (a JWT assertion signed with its key, sent to
its `token_uri`) or from application-default credentials. It is cached until near its expiry:
within `REFRESH_AHEAD_SECS` of it a request still uses it while a refresh runs beside it, so
under steady traffic no request waits for the token endpoint. A request waits only when there
is no usable token, and at most `token_timeout_secs`: past that it fails with a
`CloudCredentialError` naming the account, never hangs. One refresh runs at a time.

google-auth's calls are blocking; they run in a worker thread, over `urllib` (no `requests`
needed), each HTTP call bounded by the same timeout.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from ..config import VertexSettings
from ..errors import CloudCredentialError, MissingExtraError

try:
    import google.auth
    import google.auth.exceptions
    import google.auth.transport
    from google.auth.credentials import Credentials as GoogleCreds
except ImportError as exc:
    raise MissingExtraError("a vertex account", "vertex", exc) from None

from .base import Envelope, Headers
from .checks import credentials_file_problems

SCOPE = "https://www.googleapis.com/auth/cloud-platform"
REFRESH_AHEAD_SECS = 300.0
"""A token closer than this to its expiry is refreshed beside the requests that still use it."""
_RETRY_SECS = 10.0
"""After a failed refresh beside the requests, the next one waits this long."""
_LAST_SECS = 10.0
"""A token closer than this to its expiry is not used: the request waits for a new one."""


class GoogleToken:
    """A bearer token for one Vertex account. Its repr shows no token."""

    def __init__(self, account: str, settings: VertexSettings) -> None:
        self._account = account
        self._settings = settings
        self._creds: GoogleCreds | None = None
        self._refreshing: asyncio.Task[None] | None = None
        self._retry_at = 0.0

    def __repr__(self) -> str:
        return f"GoogleToken(account={self._account!r})"

    async def headers(self, envelope: Envelope, headers: Headers) -> Headers:
        """`headers` with `authorization: Bearer <token>`."""
        return [*headers, ("authorization", f"Bearer {await self.token()}")]

    def check(self) -> list[str]:
        """The key file's problems, if one is set (read here, without google-auth's help)."""
        path = self._settings.credentials_file
        return [] if path is None else credentials_file_problems(path)

    async def token(self) -> str:
        """A token good for a while yet; refreshed first if there is none such."""
        left = self._seconds_left()
        if left > REFRESH_AHEAD_SECS:
            return self._current()
        if left > _LAST_SECS:
            if time.monotonic() >= self._retry_at:
                self._refresh_task()  # goes on beside this request
            return self._current()
        refresh = self._refresh_task()
        timeout = self._settings.token_timeout_secs
        try:
            await asyncio.wait_for(asyncio.shield(refresh), timeout)
        except TimeoutError:
            raise CloudCredentialError(self._account, self._late(timeout), refused=False) from None
        return self._current()

    def _seconds_left(self) -> float:
        creds = self._creds
        if creds is None or not creds.token:
            return 0.0
        expiry = creds.expiry
        if expiry is None:
            return float("inf")
        now = dt.datetime.now(dt.UTC).replace(tzinfo=None)  # google-auth's expiry is naive UTC
        left: float = (expiry - now).total_seconds()
        return left

    def _current(self) -> str:
        assert self._creds is not None
        return str(self._creds.token)

    def _refresh_task(self) -> asyncio.Task[None]:
        task = self._refreshing
        loop = asyncio.get_running_loop()
        if task is None or task.done() or task.get_loop() is not loop:
            task = self._refreshing = loop.create_task(self._refresh())
            task.add_done_callback(self._settled)
        return task

    @staticmethod
    def _settled(task: asyncio.Task[None]) -> None:
        """Retrieve a refresh's error: one that ran beside the requests raised it to nobody
        (a request that waited for it has raised it already)."""
        if not task.cancelled():
            task.exception()

    async def _refresh(self) -> None:
        """Refresh the token; when that fails, a refresh beside the requests waits
        `_RETRY_SECS` (set here, before the task is seen done: not a request later)."""
        try:
            await self._fetch()
        except CloudCredentialError:
            self._retry_at = time.monotonic() + _RETRY_SECS
            raise

    async def _fetch(self) -> None:
        try:
            await asyncio.to_thread(self._refresh_blocking)
        except CloudCredentialError:
            raise
        except google.auth.exceptions.RefreshError as exc:
            refused = not getattr(exc, "retryable", False)
            raise CloudCredentialError(
                self._account, f"the token endpoint refused: {_said(exc)}", refused=refused
            ) from None
        except google.auth.exceptions.DefaultCredentialsError as exc:
            # Said as the timeout says it: whether google-auth gives up on the metadata
            # server before the bound or not, the operator reads the same cause.
            raise CloudCredentialError(
                self._account,
                f"no application-default credentials found: {_said(exc)}",
                refused=False,
            ) from None
        except (google.auth.exceptions.GoogleAuthError, OSError, ValueError) as exc:
            raise CloudCredentialError(
                self._account, f"no token: {type(exc).__name__}: {_said(exc)}", refused=False
            ) from None

    def _refresh_blocking(self) -> None:
        """Load the credentials (first time) and refresh the token, in a worker thread."""
        request = UrllibRequest(self._settings.token_timeout_secs)
        if self._creds is None:
            self._creds = self._load(request)
        self._creds.refresh(request)  # type: ignore[no-untyped-call]

    def _load(self, request: UrllibRequest) -> GoogleCreds:
        path = self._settings.credentials_file
        if path is None:
            creds, _ = google.auth.default(scopes=[SCOPE], request=request)
            return creds
        # Loaded by its declared type, never a type the file picks for itself (google-auth's
        # advice for files from elsewhere): a service account's key, or a user's login.
        with open(path, encoding="utf-8") as file:
            kind = json.load(file).get("type")
        if kind == "service_account":
            from google.oauth2 import service_account

            return service_account.Credentials.from_service_account_file(  # type: ignore[no-untyped-call,no-any-return]
                path, scopes=[SCOPE]
            )
        if kind == "authorized_user":
            from google.oauth2 import credentials

            return credentials.Credentials.from_authorized_user_file(path, scopes=[SCOPE])  # type: ignore[no-untyped-call,no-any-return]
        raise ValueError(f'{path}: credentials of type "{kind}" are not read from a file here')

    def _late(self, timeout: float) -> str:
        """What took too long: the token endpoint, or the search for credentials."""
        if self._creds is None and self._settings.credentials_file is None:
            return (
                f"no application-default credentials found within {timeout:g} s "
                "(GOOGLE_APPLICATION_CREDENTIALS, gcloud's login, the metadata server)"
            )
        where = self._token_uri() or "the token endpoint"
        return f"{where} did not answer within {timeout:g} s"

    def _token_uri(self) -> str | None:
        uri = getattr(self._creds, "_token_uri", None)
        return uri if isinstance(uri, str) else None


def _said(exc: BaseException) -> str:
    """The first line of what an error says, cut short (the token endpoint's error code and
    description; google-auth never puts a token or a key in it)."""
    text = str(exc.args[0] if exc.args else exc).splitlines()[0] if str(exc) else ""
    return text[:200] or type(exc).__name__


class UrllibRequest(google.auth.transport.Request):
    """google-auth's HTTP interface over the standard library, every call bounded."""

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout

    def __call__(
        self,
        url: str,
        method: str = "GET",
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> _Response:
        request = urllib.request.Request(url, data=body, headers=dict(headers or {}), method=method)
        bound = min(timeout, self._timeout) if timeout else self._timeout
        try:
            with urllib.request.urlopen(request, timeout=bound) as answer:
                return _Response(answer.status, dict(answer.headers), answer.read())
        except urllib.error.HTTPError as exc:
            return _Response(exc.code, dict(exc.headers), exc.read())
        except (urllib.error.URLError, OSError) as exc:
            failed = google.auth.exceptions.TransportError(f"{url}: {exc}")  # type: ignore[no-untyped-call]
            raise failed from exc


class _Response(google.auth.transport.Response):
    def __init__(self, status: int, headers: dict[str, str], data: bytes) -> None:
        self._status, self._headers, self._data = status, headers, data

    @property
    def status(self) -> int:
        return self._status

    @property
    def headers(self) -> dict[str, str]:
        return self._headers

    @property
    def data(self) -> bytes:
        return self._data
