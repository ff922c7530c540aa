"""A resumable stream's bookkeeping: where it broke, who may take the continuation, and the
machine's `broke` event."""

from __future__ import annotations

import json

import pytest
from machine_moves import machine_moves  # noqa: F401 (autouse: each move is a row)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from test_machine import Env, sent

from switchyard_mw.accounts import build_accounts
from switchyard_mw.asgi.resume_refusal import ResumeRefusal
from switchyard_mw.asgi.resume_stream import (
    SpliceReader,
    Transcript,
    accepts_prefill,
    enabled,
    frames_end,
    prefill_accounts,
    refusal,
    splice_for,
)
from switchyard_mw.config import LLMClient, Server, parse_config
from switchyard_mw.engine.machine import (
    DONE,
    FORWARD,
    AttemptMachine,
    How,
    MachineError,
    Send,
    State,
)
from switchyard_mw.telemetry import names as tm
from switchyard_mw.wire import Wire


def frame(event: dict[str, object]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


START = frame({"type": "message_start", "message": {"usage": {"input_tokens": 5}}})
BLOCK = frame(
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
)
HELLO = frame(
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hel"}}
)
ERROR = b'event: error\ndata: {"type":"error","error":{"type":"upstream_error","message":"x"}}\n\n'


def test_the_transcript_says_where_the_error_frame_begins_and_counts_what_went_before() -> None:
    transcript = Transcript(Wire.ANTHROPIC)
    assert transcript.feed(START + BLOCK) is None
    assert not transcript.content  # an empty text block is no content yet
    data = HELLO + ERROR
    assert transcript.feed(data) == len(HELLO)
    assert transcript.content
    assert transcript.sent_bytes == len(START + BLOCK + HELLO)
    assert [e["type"] for e in transcript.events][-1] == "content_block_delta"


def test_a_stop_reason_says_the_answer_is_complete_before_its_last_event() -> None:
    anthropic_ = Transcript(Wire.ANTHROPIC)
    anthropic_.feed(START + BLOCK + HELLO)
    assert not anthropic_.said_done
    anthropic_.feed(frame({"type": "message_delta", "delta": {"stop_reason": "end_turn"}}))
    assert anthropic_.said_done
    assert not anthropic_.ended
    chat = Transcript(Wire.OPENAI_CHAT)
    chat.feed(b'data: {"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n')
    assert not chat.said_done
    chat.feed(b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n')
    assert chat.said_done


def test_a_chat_error_chunk_breaks_and_done_ends() -> None:
    transcript = Transcript(Wire.OPENAI_CHAT)
    chunk = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'
    assert transcript.feed(chunk) is None
    assert transcript.content
    assert not transcript.ended
    assert transcript.feed(b'data: {"error":{"message":"x"}}\n\n') == 0
    done = Transcript(Wire.OPENAI_CHAT)
    done.feed(chunk + b"data: [DONE]\n\n")
    assert done.ended


def test_frames_end_is_the_end_of_the_last_whole_frame() -> None:
    assert frames_end(START + HELLO[:10]) == len(START)
    assert frames_end(HELLO[:10]) == 0
    assert frames_end(b"data: x\r\n\r\ndata: y") == len(b"data: x\r\n\r\n")


def test_signed_thinking_and_tool_use_are_refused() -> None:
    thinking = {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "thinking", "thinking": "", "signature": ""},
    }
    start = {"type": "message_start", "message": {"usage": {}}}
    assert refusal(Wire.ANTHROPIC, [start, thinking]) is ResumeRefusal.SIGNED_THINKING
    call = {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"name": "f"}}]}}]}
    assert refusal(Wire.OPENAI_CHAT, [call]) is ResumeRefusal.TOOL_USE


@pytest.mark.parametrize(
    ("own", "wire", "expected"),
    [
        (None, Wire.ANTHROPIC, True),
        (None, Wire.OPENAI_CHAT, False),
        (True, Wire.OPENAI_CHAT, True),
        (False, Wire.ANTHROPIC, False),
        (True, Wire.OPENAI_RESPONSES, False),
    ],
)
def test_a_prefill_is_taken_by_anthropic_accounts_and_chat_accounts_that_say_so(
    own: bool | None, wire: Wire, expected: bool
) -> None:
    spec = LLMClient(base_url="http://x", models=["m"], accepts_prefill=own)
    assert accepts_prefill(spec, wire) is expected


def test_the_continuation_goes_only_to_accounts_of_the_model_that_take_a_prefill() -> None:
    config = parse_config(
        """
[llm_clients.claude]
base_url = "http://x"
models = ["m"]
[llm_clients.chat]
base_url = "http://x"
models = ["m"]
accepts_prefill = true
[llm_clients.no-prefill]
base_url = "http://x"
models = ["m"]
accepts_prefill = false
[llm_clients.other]
base_url = "http://x"
models = ["n"]
"""
    )
    accounts = build_accounts(config, {})
    assert prefill_accounts(accounts, "m", Wire.ANTHROPIC, None) == {"claude", "chat"}
    assert prefill_accounts(accounts, "m", Wire.OPENAI_CHAT, None) == {"chat"}
    assert prefill_accounts(accounts, "m", Wire.ANTHROPIC, frozenset({"chat"})) == {"chat"}
    assert prefill_accounts(accounts, "m", Wire.OPENAI_RESPONSES, None) == frozenset()


def test_the_account_s_own_setting_wins_over_the_server_s() -> None:
    on, off = Server(resume_streams=True), Server()
    assert enabled(LLMClient(models=["m"]), on)
    assert not enabled(LLMClient(models=["m"]), off)
    assert enabled(LLMClient(models=["m"], resume_streams=True), off)
    assert not enabled(LLMClient(models=["m"], resume_streams=False), on)
    assert Server().resume_streams is False  # off by default


def test_the_splice_reader_ends_only_on_the_continuation_s_last_event() -> None:
    sent_events = [json.loads(f.split(b"data: ")[1]) for f in (START, BLOCK, HELLO)]
    reader = SpliceReader(Wire.ANTHROPIC, splice_for(Wire.ANTHROPIC, sent_events))
    delta = frame(
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "lo"}}
    )
    out = reader.feed(START + BLOCK + delta[:7])
    assert b"message_start" not in out  # the client has its own
    out += reader.feed(delta[7:] + frame({"type": "message_stop"}))
    assert b'"text":"lo"' in out
    assert reader.ended
    assert not reader.failed
    failing = SpliceReader(Wire.ANTHROPIC, splice_for(Wire.ANTHROPIC, sent_events))
    assert failing.feed(START + ERROR + frame({"type": "message_stop"})) == b""
    assert failing.failed
    assert not failing.ended


# --- the machine's `broke` -------------------------------------------------------------------


def broken(env: Env) -> AttemptMachine:
    machine = env.machine()
    sent(env, machine)
    assert machine.started(200) is FORWARD
    env.ctx.report_upstream(502)  # the forwarder's word for a cut stream
    assert machine.ended(How.RETURNED) is DONE
    return machine


def test_a_broken_stream_continues_on_another_account_of_its_model() -> None:
    env = Env()
    machine = broken(env)
    assert env.faults("a") == 1  # the broken account is faulted as any cut is
    action = machine.broke("cut", 120, {"a", "b"})
    assert isinstance(action, Send)
    assert action.lease.account == "b"
    assert machine.state is State.SENT
    # The continuation is the last attempt: its 500 is not held for another account, and
    # its end is the end (the driver answers with the original break).
    assert machine.started(500) is FORWARD
    assert machine.ended(How.RETURNED) is DONE
    assert machine.tried == ["a", "b"]


def test_no_account_that_takes_a_prefill_means_done() -> None:
    env = Env()
    machine = broken(env)
    assert machine.broke("idle", 10, {"a"}) is DONE


def test_broke_is_only_for_an_ended_attempt() -> None:
    env = Env()
    machine = env.machine()
    sent(env, machine)
    with pytest.raises(MachineError):
        machine.broke("cut", 1, {"b"})


def test_the_continuation_s_span_says_where_it_resumed_and_after_how_many_bytes(
    otel_spans: InMemorySpanExporter,
) -> None:
    env = Env()
    machine = env.machine(traced=True)
    sent(env, machine)
    machine.started(200)
    env.ctx.deadline_phase = "idle"
    assert machine.ended(How.RETURNED) is DONE
    assert isinstance(machine.broke("idle", 612, {"b"}), Send)
    machine.started(200)
    machine.ended(How.FINISHED)
    spans = [s for s in otel_spans.get_finished_spans() if s.name == tm.SPAN_ATTEMPT]
    assert [(s.attributes or {})[tm.ACCOUNT] for s in spans] == ["a", "b"]
    resumed = spans[1].attributes or {}
    assert (resumed[tm.RESUMED_FROM], resumed[tm.RESUME_REASON]) == ("a", "idle")
    assert resumed[tm.RESUMED_AFTER] == 612
    assert tm.RESUMED_FROM not in (spans[0].attributes or {})
