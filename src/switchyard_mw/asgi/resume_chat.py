"""Resumed OpenAI Chat Completions streams, sans-IO: the continuation request and the splice.

Chat has no prefill of its own; only accounts marked as accepting one get a continuation: the
conversation plus the partial assistant text as a trailing assistant message. The splice
carries the client's stream on with the continuation's chunks under the first answer's ``id``,
``created`` and ``model`` (a client may key on the id), without a second ``role`` delta, with
the usage chunk's counts summed with the first part's last usage, and one ``[DONE]``, which
the front writes after the last chunk as it does for any stream. A tool call in progress or
sent is refused (``ResumeRefusal.TOOL_USE``); Chat carries no signed thinking.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from .resume_refusal import ResumeRefusal

Chunk = dict[str, Any]


class _Sent:
    def __init__(self, chunks: Iterable[Mapping[str, Any]]) -> None:
        self.first: Mapping[str, Any] | None = None
        self.text = ""
        self.tool_calls = False
        self.usage: dict[str, int] = {}
        for chunk in chunks:
            self.first = self.first or chunk
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                self.text += delta.get("content") or ""
                self.tool_calls = self.tool_calls or bool(delta.get("tool_calls"))
            if chunk.get("usage"):
                self.usage = _ints(chunk["usage"])

    def refusal(self) -> ResumeRefusal | None:
        if self.first is None:
            return ResumeRefusal.NOT_STARTED
        return ResumeRefusal.TOOL_USE if self.tool_calls else None


def _ints(usage: Mapping[str, Any]) -> dict[str, int]:
    return {k: v for k, v in usage.items() if isinstance(v, int) and not isinstance(v, bool)}


def continuation_request(
    request: Mapping[str, Any], sent: Iterable[Mapping[str, Any]]
) -> dict[str, Any] | ResumeRefusal:
    seen = _Sent(sent)
    why = seen.refusal()
    if why is not None:
        return why
    messages = list(request.get("messages", []))
    if seen.text:
        messages.append({"role": "assistant", "content": seen.text})
    return {**request, "messages": messages}


class ChatSplice:
    """Turns a continuation's chunks into the chunks that carry the client's stream on."""

    def __init__(self, sent: Iterable[Mapping[str, Any]]) -> None:
        seen = _Sent(sent)
        why = seen.refusal()
        if why is not None or seen.first is None:
            raise ValueError(f"cannot splice: {why.value if why else 'nothing sent'}")
        self._same = {k: seen.first[k] for k in ("id", "created", "model") if k in seen.first}
        self._first_usage = seen.usage

    def feed(self, chunk: Mapping[str, Any]) -> Chunk:
        out: Chunk = {**chunk, **self._same}
        out["choices"] = [_without_role(c) for c in chunk.get("choices") or []]
        if chunk.get("usage"):
            second = _ints(chunk["usage"])
            keys = sorted(set(second) | set(self._first_usage))
            out["usage"] = {k: self._first_usage.get(k, 0) + second.get(k, 0) for k in keys}
        return out


def _without_role(choice: Mapping[str, Any]) -> dict[str, Any]:
    delta = {k: v for k, v in (choice.get("delta") or {}).items() if k != "role"}
    return {**choice, "delta": delta}


def encode(chunk: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
