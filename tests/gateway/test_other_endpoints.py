"""`gateway_routes`: the forwarding app's /v1/ routes in process, the models list following a
reload of the stack's config."""

from __future__ import annotations

import httpx
from starlette.applications import Starlette

from switchyard_mw.asgi.stack import switchyard_stack
from switchyard_mw.config import parse_config
from switchyard_mw.gateway import Forwarder, gateway_routes
from switchyard_mw.testing import MockProvider


def config(*models: str) -> str:
    listed = ", ".join(f'"{m}"' for m in models)
    return f'[llm_clients.a]\nbase_url = "http://mock.test"\nmodels = [{listed}]\n'


async def test_the_models_list_follows_a_reload() -> None:
    upstream = httpx.AsyncClient(transport=httpx.ASGITransport(app=MockProvider()))
    gateway = Starlette()
    stack = switchyard_stack(gateway, config=parse_config(config("m1", "m2")), environ={})
    gateway.router.routes.extend(gateway_routes(Forwarder(upstream), lambda: stack.config))
    transport = httpx.ASGITransport(app=stack)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw.test") as client:

        async def listed() -> list[str]:
            response = await client.get("/v1/models")
            assert response.status_code == 200
            return [m["id"] for m in response.json()["data"]]

        assert await listed() == ["m1", "m2"]
        assert (await client.get("/v1/models/m3")).status_code == 404
        assert stack.reload(parse_config(config("m3"))) == []
        assert await listed() == ["m3"]
        assert (await client.get("/v1/models/m3")).status_code == 200
        # The LLM routes stay the forwarder's: a count is forwarded, not a 404.
        count = {"model": "m3", "messages": [{"role": "user", "content": "hi"}]}
        counted = await client.post("/v1/messages/count_tokens", json=count)
        assert counted.status_code == 200, counted.text
        assert counted.json()["input_tokens"] > 0
    await upstream.aclose()
