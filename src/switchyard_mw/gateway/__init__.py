"""The forwarding app: a pass-through endpoint for the three LLM wires, with its telemetry.

`Forwarder` and `WIRE_ROUTES` are its public names (see `forwarder`), `gateway_routes` mounts
them with `OtherEndpoints` (the models list and the wire's 404s, see `endpoints`); it needs the
`gateway` extra (aiohttp), and says so on import when that is missing.
"""

from .forwarder import WIRE_ROUTES, Forwarder
from .routes import OTHER_ROUTE, OtherEndpoints, gateway_routes

__all__ = ["OTHER_ROUTE", "WIRE_ROUTES", "Forwarder", "OtherEndpoints", "gateway_routes"]
