"""What every wire's reply is built from: the request's answer in wire-neutral terms, SSE
frames, and a stream cut into blocks so faults fall between deltas."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from switchyard_mw.testing._tool_calls import ToolCall

encode = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
class ReplyContext:
    model: str
    text: str
    parts: tuple[str, ...]
    input_tokens: int
    """Input tokens neither read from nor written to the prompt cache."""
    output_tokens: int
    # Chat Completions only sends a usage chunk when the caller asks for one.
    include_usage: bool = False
    calls: tuple[ToolCall, ...] = ()
    """Tool calls to answer with instead of text, or after it (`text_first`)."""
    text_first: bool = False
    """Whether an answer with tool calls says its text before them."""
    thought: str = ""
    """What the model thinks before it answers, when the request asks it to ("": no thinking).
    Anthropic shows it as a thinking block; OpenAI only counts its reasoning tokens."""
    thought_parts: tuple[str, ...] = ()
    reasoning_tokens: int = 0
    """Of `output_tokens`, those spent thinking."""
    cut_short: bool = False
    """The text stops at the request's output cap (`max_tokens` and its kin)."""
    refused: bool = False
    """The provider's content filter stopped the answer (`Behaviour.content_filter`)."""
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0

    @property
    def says_text(self) -> bool:
        return self.text_first or not self.calls

    @property
    def prompt_tokens(self) -> int:
        """Every input token, cached or not: OpenAI's count (Anthropic's leaves cache out)."""
        return self.input_tokens + self.cache_read_tokens + self.cache_write_tokens


@dataclass(frozen=True, slots=True)
class StreamPlan:
    """SSE frames of one streamed reply.

    Split in three so the server can put stalls, gaps and faults between the deltas (of text,
    or of a tool call's arguments) while the framing around them stays exactly what the real
    API sends.
    """

    prelude: bytes
    deltas: tuple[bytes, ...]
    epilogue: bytes


@dataclass(frozen=True, slots=True)
class Block:
    """One content block (or output item, or tool call) of a stream: its opening frames, one
    frame per delta, and its closing frames."""

    opening: bytes
    deltas: tuple[bytes, ...]
    closing: bytes


def fold(blocks: Sequence[Block]) -> tuple[bytes, tuple[bytes, ...], bytes]:
    """Blocks as one opening, the deltas and one closing: a block's opening rides on its first
    delta and the closing before it on that too, so every stall and fault falls between two
    deltas, as in a one-block stream. Every block has at least one delta."""
    deltas: list[bytes] = []
    for before, block in zip((None, *blocks), blocks, strict=False):
        first, *rest = block.deltas
        if before is not None:
            first = before.closing + block.opening + first
        deltas += [first, *rest]
    return blocks[0].opening, tuple(deltas), blocks[-1].closing


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def event(name: str, fields: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + encode(fields) + b"\n\n"


def data(fields: dict[str, Any]) -> bytes:
    return b"data: " + encode(fields) + b"\n\n"
