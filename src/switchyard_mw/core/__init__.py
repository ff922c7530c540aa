"""Sans-IO policy logic: no ASGI, no gRPC, time from an injected clock."""
