"""Why a broken stream cannot be continued with a prefill: one answer for every wire."""

from __future__ import annotations

import enum


class ResumeRefusal(enum.Enum):
    NOT_STARTED = "not_started"  # nothing reached the client: a plain retry serves
    SIGNED_THINKING = "signed_thinking"  # thinking cannot be prefilled without its signature
    TOOL_USE = "tool_use"  # a tool call (in progress or complete) is not text to prefill
