"""Outbound HTTP clients: the client every upstream call goes through, and its failures mapped.

`make_http_client()` builds it (over aiohttp's pool with the `gateway` extra, else httpx's),
`timeout_for()` bounds a call by the request's deadline, `map_exceptions()` turns any transport
failure into switchyard's `TransportError` of its kind. Below the engine: the judge and the
forwarding app call upstream through it, and nothing here decides anything about a request.
"""
