"""Shadow traffic: try a model on a copy of real requests before anyone sees its answers.

For `[canaries."M"] shadow = { "S" = p }`, p percent of M's non-streaming requests (picked by
the same bucket rule as the canary split, with a salt of their own) are copied to S on an
account serving it, in the background. The copy's answer is discarded; its outcome and latency
go to the request metrics with `switchyard.shadow = true`. A shadow never delays, changes or
fails the client's answer, never touches any account's cooling or throttle state (no lease is
taken, no outcome recorded), carries the shadow account's own key and nothing of the caller's,
ends at its own attempt deadline, and at most `[server] shadow_max_inflight` run at once
(beyond that they are dropped, counted in `switchyard.shadow.dropped`). ASGI only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Protocol

import httpx

from ..accounts import Account
from ..clients.outbound import map_exceptions
from ..config import Canary
from ..context import RequestContext
from ..core.deadline_math import attempt_deadline_secs
from ..core.variant_buckets import Split
from ..telemetry import names as tm
from ..telemetry import request_metrics
from ..wire import RequestView, rewrite_model

_log = logging.getLogger(__name__)
_SALT = "\x00shadow"  # shadows are picked apart from the canary's own split


class Health(Protocol):
    """What a shadow asks of the account pool: which accounts serve a model, and which of
    them is closed (healthy) for it now."""

    def accounts_for(self, model: str) -> tuple[str, ...]: ...

    def closed_for(self, name: str, model: str) -> bool: ...


class Shadows:
    """The shadow rules of every canary, and the mirrored requests in flight."""

    def __init__(
        self,
        canaries: Mapping[str, Canary],
        *,
        accounts: Mapping[str, Account],
        pool: Health,
        max_inflight: int,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        self._splits = {
            model: Split.build(model, list(c.shadow.items()), c.salt + _SALT)
            for model, c in canaries.items()
            if c.shadow
        }
        self._accounts = dict(accounts)
        self._pool = pool
        self._max = max_inflight
        self._owns_http = http_client is None
        self._http = http_client or httpx.AsyncClient()
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    def build(
        cls,
        canaries: Mapping[str, Canary],
        *,
        accounts: Mapping[str, Account],
        pool: Health,
        max_inflight: int,
    ) -> Shadows | None:
        """The shadows of `canaries`, or None when no canary has any (nothing to do per request)."""
        if not any(c.shadow for c in canaries.values()):
            return None
        return cls(canaries, accounts=accounts, pool=pool, max_inflight=max_inflight)

    @property
    def inflight(self) -> int:
        return len(self._tasks)

    def mirror(self, ctx: RequestContext, path: str) -> None:
        """Send a copy of this request (to `path`) to its shadow model, if the rule picks it.
        Never waits."""
        view = ctx.view
        if view is None or view.stream or ctx.body is None:
            return
        split = self._splits.get(view.model)
        if split is None:
            return
        shadow, _ = split.choose(view.user_key, None if view.user_key else view.first_turn_hash)
        if shadow == view.model:
            return
        if len(self._tasks) >= self._max:
            tm.shadow_dropped.add(1, {tm.RESPONSE_MODEL: shadow})
            return
        task = asyncio.get_running_loop().create_task(self._send(view, ctx.body, shadow, path))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _account(self, model: str) -> Account | None:
        """The preferred account serving `model` that is healthy now; no lease is taken."""
        for name in self._pool.accounts_for(model):
            if self._pool.closed_for(name, model):
                return self._accounts[name].for_model(model)  # its own name and path
        return None

    async def _send(self, view: RequestView, body: bytes, shadow: str, path: str) -> None:
        account = self._account(shadow)
        started = time.monotonic()
        error: str | None = None
        if account is None:
            error = "no_healthy_account"
        else:
            deadline = attempt_deadline_secs(
                timeout_secs=account.spec.timeout_secs,
                max_tokens=view.max_tokens,
                default_max_tokens=account.spec.default_max_tokens,
            )
            error = await self._call(account, path, body, shadow, deadline)
        request_metrics.observe_shadow(
            requested=view.model,
            shadow=shadow,
            account="" if account is None else account.name,
            secs=time.monotonic() - started,
            error=error,
        )

    async def _call(
        self, account: Account, path: str, body: bytes, shadow: str, deadline: float
    ) -> str | None:
        """POST the copy; the error type, or None for a success. Never raises."""
        renamed = rewrite_model(body, account.provider_model or shadow)
        try:
            async with asyncio.timeout(deadline):
                # Any kind of account: a cloud one's copy is re-enveloped and signed too.
                outbound = await account.outbound(
                    path, renamed, [("content-type", "application/json")]
                )
                # Not the attempt's call: the request's `transport_error` is left alone.
                with map_exceptions(report=False):
                    answer = await self._http.post(
                        outbound.url,
                        content=outbound.body,
                        headers=outbound.headers,
                        timeout=deadline,
                    )
        except TimeoutError:
            return "deadline_exceeded"
        except httpx.HTTPError as exc:
            return type(exc).__name__
        except Exception as exc:  # a shadow never fails anything: say so, and move on
            _log.warning("shadow request to %s failed: %s", shadow, type(exc).__name__)
            return type(exc).__name__
        return str(answer.status_code) if answer.status_code >= 400 else None

    async def retire(self) -> None:
        """After a reload replaced these shadows: let the mirrors in flight end (each is
        bounded by its deadline), then close the client this object made."""
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._owns_http:
            await self._http.aclose()

    async def aclose(self) -> None:
        """Cancel the shadows in flight and close the client this object made."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._owns_http:
            await self._http.aclose()
