"""One streamed answer per wire with its usage, shared by the usage parser's tests
(`engine/test_usage.py`) and the ext_proc usage tests (`extproc/test_extproc_usage.py`)."""

from __future__ import annotations

from typing import Any

ANTHROPIC_STREAM = (
    b"event: message_start\n"
    b'data: {"type":"message_start","message":{"id":"m","usage":{"input_tokens":10,'
    b'"cache_read_input_tokens":5,"output_tokens":1}}}\n\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"text":"hi"}}\n\n'
    b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":42}}\n\n'
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
)
CHAT_STREAM = (
    b'data: {"choices":[{"delta":{"content":"hi"}}],"usage":null}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}}\n\n'
    b"data: [DONE]\n\n"
)
RESPONSES_STREAM = (
    b'event: response.created\ndata: {"type":"response.created","response":{"usage":null}}\n\n'
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta"}\n\n'
    b'event: response.completed\ndata: {"type":"response.completed","response":{"usage":'
    b'{"input_tokens":8,"output_tokens":9}}}\n\n'
)


def all_input(usage: Any) -> int:
    """An Anthropic answer's input tokens as the GenAI conventions count them (and switchyard
    records them): the uncached part plus what the prompt cache read and wrote. `usage` is
    the SDK's object or the answer's JSON."""
    get = usage.get if isinstance(usage, dict) else lambda name: getattr(usage, name, None)
    fields = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    return sum(get(name) or 0 for name in fields)
