"""The endpoints clients call besides the LLM calls, answered from the config by both fronts.

    GET /v1/models          the public models, in OpenAI's list shape, or Anthropic's (paged:
                            `limit`, `after_id`, `before_id`) when the request carries
                            `anthropic-version`
    GET /v1/models/{id}     one of them, in the same shapes; 404 in the wire's shape if unknown
    anything else /v1/...   404 in the wire's shape (`wire.unknown_url`), never plain text

No account is called and no key is needed: the list is what the config lets clients ask for.
Token counting (`/v1/messages/count_tokens`) is an LLM call (`wire.WIRE_PATHS`), forwarded.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote

import msgspec

from ..config import Config
from ..wire import Wire, answer_wire, error_body, unknown_url
from .paths import llm_paths

API_PREFIX = "/v1/"
MODELS_PATH = "/v1/models"
RELEASED_AT = "1970-01-01T00:00:00Z"
"""A model's release time, which a config does not know: the epoch, as Anthropic's API says to
read an unknown one (OpenAI's `created` is 0 alike)."""
OWNED_BY = "switchyard"
"""OpenAI's `owned_by`: the gateway's config is what makes these models available."""
DEFAULT_PAGE = 20
MAX_PAGE = 1000
"""Anthropic's `limit`: 20 unless set, 1 to 1000."""

_ENCODE = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
class LocalAnswer:
    """An answer switchyard makes itself: `status` and a JSON `body`."""

    status: int
    body: bytes


def public_models(config: Config) -> tuple[str, ...]:
    """The names clients may send, in the config's order: every account's public model names
    (`"*"` names none) and every route (`auto`...)."""
    names: dict[str, None] = {}
    for client in config.llm_clients.values():
        names.update(dict.fromkeys(m for m in client.models if m != "*"))
    names.update(dict.fromkeys(config.routes))
    return tuple(names)


class Endpoints:
    """The answers of one config's endpoints (built once per config: the list is fixed)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.models = public_models(config)
        self._known = frozenset(self.models)
        self._paths = llm_paths(config.server)
        self._openai_list = _ENCODE({"object": "list", "data": [_openai(m) for m in self.models]})

    def ours(self, method: str, path: str) -> bool:
        """Whether a request that is not read as an LLM call is answered here: under `/v1/`,
        but not a POST on an LLM path (its body is not JSON: it passes through unread, as
        the design says)."""
        return path.startswith(API_PREFIX) and not (method == "POST" and path in self._paths)

    def answer(self, method: str, path: str, query: str, *, anthropic_version: bool) -> LocalAnswer:
        """The answer to `method` on `path` (without its `query`)."""
        wire = answer_wire(path, anthropic_version)
        if method == "GET":
            if path == MODELS_PATH:
                return self._list(wire, query)
            model = path[len(MODELS_PATH) + 1 :] if path.startswith(MODELS_PATH + "/") else ""
            if model:
                return self._one(wire, unquote(model))
        return LocalAnswer(404, unknown_url(wire, method, path))

    def _one(self, wire: Wire, model: str) -> LocalAnswer:
        if model not in self._known:
            return LocalAnswer(404, _no_model(wire, model))
        shape = _anthropic(model) if wire.anthropic_style else _openai(model)
        return LocalAnswer(200, _ENCODE(shape))

    def _list(self, wire: Wire, query: str) -> LocalAnswer:
        if not wire.anthropic_style:
            return LocalAnswer(200, self._openai_list)
        page = self._page(parse_qs(query))
        if isinstance(page, str):
            return LocalAnswer(400, error_body(wire, "invalid_request_error", page))
        return LocalAnswer(200, _ENCODE(_anthropic_page(page)))

    def _page(self, params: dict[str, list[str]]) -> _Page | str:
        """The models `limit`, `after_id` and `before_id` select (Anthropic's cursors: the
        page after, or before, a model's id); a problem's text otherwise."""
        limit_text = params.get("limit", [str(DEFAULT_PAGE)])[-1]
        if not limit_text.isdigit() or not 1 <= int(limit_text) <= MAX_PAGE:
            return f"limit: must be an integer from 1 to {MAX_PAGE}"
        limit = int(limit_text)
        after, before = params.get("after_id", [""])[-1], params.get("before_id", [""])[-1]
        if after and before:
            return "after_id and before_id: set at most one"
        for name, cursor in (("after_id", after), ("before_id", before)):
            if cursor and cursor not in self._known:
                return f"{name}: no model `{cursor}`"
        models = self.models
        if before:
            end = models.index(before)
            start = max(0, end - limit)
            return _Page(models[start:end], more=start > 0)
        start = models.index(after) + 1 if after else 0
        return _Page(models[start : start + limit], more=start + limit < len(models))


@dataclass(frozen=True, slots=True)
class _Page:
    models: tuple[str, ...]
    more: bool


def _openai(model: str) -> dict[str, object]:
    return {"id": model, "object": "model", "created": 0, "owned_by": OWNED_BY}


def _anthropic(model: str) -> dict[str, object]:
    return {
        "type": "model",
        "id": model,
        "display_name": model,
        "created_at": RELEASED_AT,
        "lifecycle": "active",
    }


def _anthropic_page(page: _Page) -> dict[str, object]:
    models = page.models
    return {
        "data": [_anthropic(m) for m in models],
        "has_more": page.more,
        "first_id": models[0] if models else None,
        "last_id": models[-1] if models else None,
    }


def _no_model(wire: Wire, model: str) -> bytes:
    """A model the config does not list, as each provider answers it."""
    message = f"model `{model}` is not served by any account"
    if wire.anthropic_style:
        return error_body(wire, "not_found_error", message)
    error = {"message": message, "type": "invalid_request_error", "param": "model"}
    return _ENCODE({"error": {**error, "code": "model_not_found"}})
