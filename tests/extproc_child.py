"""An ext_proc server in its own process, for tests that measure what a peer costs it.

    python tests/extproc_child.py TRANSPORT [LIMITS_JSON]

Prints the bound port on its first line. Each line read on stdin is answered with one line of
JSON: the flights registered, the leases the pool granted and has not had back, and the
accounts with a probe in flight (after handing the allocator's free memory back, see `trim`).
EOF on stdin stops the server. Memory is read by the parent from /proc, so the figures are
this process's alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import sys
from collections.abc import Collection
from typing import Any

from switchyard_mw.accounts import build_accounts, pool_from_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.core.pool import AccountPool, Cause, Lease, Outcome
from switchyard_mw.extproc import Policies, start_server

CONFIG = """
[server]
max_body_bytes = 4194304

[llm_clients.a]
base_url = "https://prov.example"
api_key_env = "KEY_A"
models = ["m", "m-var"]
envoy_cluster = "prov"

[llm_clients.b]
base_url = "https://prov.example"
api_key_env = "KEY_B"
models = ["m", "m-var"]
priority = 1
envoy_cluster = "prov"

[canaries."m"]
variants = { "m-var" = 100.0 }
"""
"""Model `m` is always rewritten to `m-var`: every routed body comes back as a body mutation
as large as the request, the answer a peer that stops reading makes the server hold."""


class CountingPool(AccountPool):
    """The real pool, counting the leases it granted and has not had back."""

    out = 0

    def acquire(
        self,
        model: str,
        *,
        exclude: Collection[str] = (),
        allowed: Collection[str] | None = None,
        key: int | None = None,
    ) -> Lease | None:
        lease = super().acquire(model, exclude=exclude, allowed=allowed, key=key)
        self.out += lease is not None
        return lease

    def record(self, lease: Lease, outcome: Outcome, cause: Cause = Cause.OUTAGE) -> None:
        self.out -= 1
        super().record(lease, outcome, cause)

    def release(self, lease: Lease) -> None:
        self.out -= 1
        super().release(lease)


def trim() -> None:
    """Give the allocator's free memory back to the system before the parent reads the RSS:
    glibc keeps freed arenas (grpcio's threads have their own) at their high-water mark, which
    would hide whether memory came back; what is still in use, leaked or not, stays."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


async def main(transport: Any, limits: dict[str, Any]) -> None:
    config = parse_config(CONFIG)
    accounts = build_accounts(config, {"KEY_A": "ka", "KEY_B": "kb"})
    pool = CountingPool(pool_from_accounts(accounts).specs)
    policies = Policies(config, accounts, pool=pool)
    kwargs: dict[str, Any] = {"transport": transport}
    if limits:  # only then: the same script measures servers that predate the limits
        from switchyard_mw.extproc import GrpcioLimits

        kwargs["grpcio_limits"] = GrpcioLimits(**limits)
    server = await start_server(policies, "127.0.0.1:0", **kwargs)
    print(server.port, flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while await reader.readline():
        trim()
        state = {
            "flights": len(server.servicer.flights),
            "leases": pool.out,
            "probes": [s.name for s in pool.status() if s.probe_in_flight],
        }
        print(json.dumps(state), flush=True)
    await server.stop(grace_secs=0)


if __name__ == "__main__":
    limits = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    asyncio.run(main(sys.argv[1], limits))
