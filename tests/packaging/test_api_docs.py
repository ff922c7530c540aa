"""The Python API page (docs/api.md) shows every name the package exports, and every name it
shows, with each public member, has a docstring saying what it promises."""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

import switchyard_mw
from servers import ROOT

PAGE = (ROOT / "docs" / "api.md").read_text()
SHOWN = re.findall(r"^::: (\S+)$", PAGE, re.M)
# The policies' hooks for the stack, left off the page (mkdocs.yml `filters`).
HIDDEN = {"handle", "other"}


def _resolve(dotted: str) -> Any:
    module, _, name = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError:  # a class's member: module.Class.name
        return getattr(_resolve(module), name)


def _undocumented_members(cls: type) -> list[str]:
    missing = []
    for name, member in vars(cls).items():
        if name.startswith("_") or name in HIDDEN:
            continue
        target = member.fget if isinstance(member, property) else member
        if isinstance(target, staticmethod | classmethod):
            target = target.__func__
        if callable(target) and not inspect.getdoc(target):
            missing.append(f"{cls.__qualname__}.{name}")
    return missing


def test_every_exported_name_is_on_the_api_page() -> None:
    exported = {f"switchyard_mw.{name}" for name in switchyard_mw.__all__} - {
        "switchyard_mw.__version__"
    }
    assert exported <= set(SHOWN), exported - set(SHOWN)


def test_every_name_on_the_api_page_says_what_it_promises() -> None:
    assert SHOWN
    missing = []
    for dotted in SHOWN:
        obj = _resolve(dotted)
        if isinstance(obj, tuple | str | int | float):  # a constant: its docstring is in source
            source = inspect.getsource(importlib.import_module(obj_module(dotted)))
            name = dotted.rpartition(".")[2]
            if not re.search(rf"^{name} = .*\n\"\"\"", source, re.M):
                missing.append(dotted)
            continue
        if not inspect.getdoc(obj):
            missing.append(dotted)
        if inspect.isclass(obj):
            missing += _undocumented_members(obj)
    assert not missing, missing


def obj_module(dotted: str) -> str:
    """The module that defines a constant shown under `dotted` (its package re-exports it)."""
    module = importlib.import_module(dotted.rpartition(".")[0])
    name = dotted.rpartition(".")[2]
    for sub in vars(module).values():
        if inspect.ismodule(sub) and getattr(sub, name, None) is getattr(module, name):
            return sub.__name__
    return module.__name__
