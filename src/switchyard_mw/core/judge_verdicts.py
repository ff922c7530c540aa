"""The judge's side of an LLM route, sans-IO: the request we send it and how we read its verdict.

The judge is any OpenAI Chat Completions endpoint. It is asked for one label and nothing else;
its reply is read strictly (a label, give or take whitespace, quotes and case, or a JSON object
with a `label` field), because a loose reading would turn a chatty or confused judge into a
confident routing decision instead of a counted fail-open.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from .base_errors import BadVerdict as BadVerdict  # its home before core/base_errors.py

JUDGE_MAX_TOKENS = 16
"""A label is a word or two; a small cap keeps a rambling judge cheap and fast."""

_QUOTES = "\"'`\u2018\u2019\u201c\u201d"
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


def build_judge_request(
    *, judge_model: str, labels: Sequence[str], user_text: str, max_chars: int
) -> bytes:
    """The Chat Completions body asking `judge_model` to pick one of `labels` for `user_text`.

    Only the first `max_chars` characters of the text are sent: the judge needs the gist, and
    a long prompt would spend the judge's deadline on reading.
    """
    listed = "\n".join(f"- {label}" for label in labels)
    system = (
        "You route requests to the model best suited to them. Classify the user's request "
        "below into exactly one of these labels:\n"
        f"{listed}\n"
        "Answer with exactly one of the labels above and nothing else: no explanation, "
        "no punctuation, no quotes."
    )
    if len(user_text) > max_chars:
        shown = user_text[:max_chars]
        content = (
            f"{shown}\n\n[truncated: the request continues; only its first {max_chars} "
            f"of {len(user_text)} characters are shown]"
        )
    else:
        content = user_text or "(the request has no text)"
    return _encode(
        {
            "model": judge_model,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": content},
            ],
            "max_tokens": JUDGE_MAX_TOKENS,
            "temperature": 0,
            "stream": False,
        }
    )


def parse_verdict(body: bytes, labels: Sequence[str]) -> str:
    """The label (spelled as in `labels`) a judge reply names; `BadVerdict` otherwise.

    `body` is a `chat.completion` JSON object or an SSE stream of `chat.completion.chunk`s
    (a judge behind a proxy may stream even when asked not to).
    """
    text = body.lstrip()
    content = _completion_content(text) if text.startswith(b"{") else _stream_content(text)
    return match_label(content, labels)


def match_label(content: str, labels: Sequence[str]) -> str:
    """`content` as one of `labels`: surrounding whitespace, quotes and case ignored."""
    answer = _bare(content)
    if answer.startswith("{"):
        answer = _bare(_json_label(answer))
    wanted = answer.casefold()
    for label in labels:
        if label.casefold() == wanted:
            return label
    raise BadVerdict("the judge's answer is not one of the route's labels")


def _bare(content: str) -> str:
    return content.strip().strip(_QUOTES).strip()


def _json_label(content: str) -> str:
    try:
        data = _decode(content)
    except msgspec.DecodeError:
        raise BadVerdict("the judge's answer is malformed JSON") from None
    label = data.get("label") if isinstance(data, dict) else None
    if not isinstance(label, str):
        raise BadVerdict("the judge's JSON answer has no string `label` field")
    return label


def _completion_content(body: bytes) -> str:
    data = _json(body)
    content = _dig(data, "choices", 0, "message", "content")
    if not isinstance(content, str):
        raise BadVerdict("the judge's reply has no choices[0].message.content text")
    return content


def _stream_content(body: bytes) -> str:
    parts: list[str] = []
    seen_chunk = False
    for line in body.splitlines():
        if not line.startswith(b"data:"):
            continue  # `event:`, `id:`, comments and blank separators carry no content
        payload = line[5:].strip()
        if payload == b"[DONE]":
            break
        data = _json(payload)
        if isinstance(data, dict) and "error" in data:
            raise BadVerdict("the judge's stream carried an error event")
        seen_chunk = True
        delta = _dig(data, "choices", 0, "delta", "content")
        if isinstance(delta, str):
            parts.append(delta)
    if not seen_chunk:
        raise BadVerdict("the judge's reply is neither a JSON completion nor an SSE stream")
    return "".join(parts)


def _json(raw: bytes) -> Any:
    try:
        return _decode(raw)
    except msgspec.DecodeError:
        raise BadVerdict("the judge's reply is not valid JSON") from None


def _dig(data: Any, *path: str | int) -> Any:
    """`data[p0][p1]...`, or None where the shape differs (a judge reply is untrusted input)."""
    for step in path:
        if isinstance(step, int):
            if not isinstance(data, list) or len(data) <= step:
                return None
            data = data[step]
        elif isinstance(data, dict):
            data = data.get(step)
        else:
            return None
    return data
