"""`core/` is sans-IO in fact: no module in it defines a coroutine or awaits anything."""

from __future__ import annotations

import ast
from pathlib import Path

import switchyard_mw.core

CORE = Path(switchyard_mw.core.__file__).parent


def test_nothing_in_core_awaits() -> None:
    found = []
    for path in sorted(CORE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.AsyncFunctionDef | ast.Await | ast.AsyncFor | ast.AsyncWith):
                found.append(f"{path.name}:{node.lineno}")
    assert not found
