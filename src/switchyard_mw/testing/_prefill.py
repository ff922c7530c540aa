"""Prefills: a request whose last turn is the assistant's own, which the model continues.

Anthropic Messages takes a trailing `assistant` message as the start of its answer and sends
only what follows; so do the Chat Completions providers that accept one (vLLM's
`continue_final_message`, DeepSeek's prefix completion). Resumed streams rely on it: the
partial answer goes back as the prefill, and the continuation must not repeat it. The mock
answers the rest of its reply after a prefill that begins it, and its whole reply after one
that does not (it has nothing else to say).
"""

from __future__ import annotations

from typing import Any

_TEXT_PARTS = frozenset({"text", "output_text", "input_text"})


def continued(reply: str, prefill: str) -> str:
    """What the model says after `prefill`, its answer being `reply`."""
    if prefill and reply.startswith(prefill):
        return reply[len(prefill) :]
    if prefill and prefill.startswith(reply):
        return ""  # the prefill already says the whole reply
    return reply


def anthropic_prefill(request: dict[str, Any]) -> str:
    """The text of a trailing assistant message of Messages (a string or text blocks)."""
    return _assistant_text(_last(request.get("messages")))


def chat_prefill(request: dict[str, Any]) -> str:
    """The text of a trailing assistant message of Chat Completions."""
    return _assistant_text(_last(request.get("messages")))


def responses_prefill(request: dict[str, Any]) -> str:
    """The text of a trailing assistant message item of a Responses `input` list."""
    return _assistant_text(_last(request.get("input")))


def _last(turns: Any) -> Any:
    return turns[-1] if isinstance(turns, list) and turns else None


def _assistant_text(turn: Any) -> str:
    if not isinstance(turn, dict) or turn.get("role") != "assistant":
        return ""
    content = turn.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return "".join(
        part["text"]
        for part in content
        if isinstance(part, dict)
        and part.get("type") in _TEXT_PARTS
        and isinstance(part.get("text"), str)
    )
