"""One streamed answer per wire with its usage, shared by the usage parser's tests
(`engine/test_usage.py`) and the ext_proc usage tests (`extproc/test_extproc_usage.py`)."""

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
