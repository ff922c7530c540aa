"""The forwarding app: a pass-through endpoint for the three LLM wires, with its telemetry.

`Forwarder` and `WIRE_ROUTES` are its public names (see `forwarder`); it needs the `gateway`
extra (aiohttp), and says so on import when that is missing.
"""

from .forwarder import WIRE_ROUTES, Forwarder

__all__ = ["WIRE_ROUTES", "Forwarder"]
