"""Test helpers shipped with switchyard-mw: a mock LLM provider for examples and tests."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from switchyard_mw.testing.mock_provider import (
        DEFAULT_KEY,
        DEFAULT_REPLY,
        MOCK_AWS_ACCESS_KEY_ID,
        MOCK_AWS_SECRET_ACCESS_KEY,
        Behaviour,
        MockProvider,
        MockProviderFault,
        RecordedRequest,
    )

__all__ = [
    "DEFAULT_KEY",
    "DEFAULT_REPLY",
    "MOCK_AWS_ACCESS_KEY_ID",
    "MOCK_AWS_SECRET_ACCESS_KEY",
    "Behaviour",
    "MockProvider",
    "MockProviderFault",
    "RecordedRequest",
]


def __getattr__(name: str) -> Any:
    # Imported lazily: an eager import would make
    # `python -m switchyard_mw.testing.mock_provider` load the module twice and warn.
    if name in __all__:
        return getattr(importlib.import_module("switchyard_mw.testing.mock_provider"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
