"""What the optional compiled build (mypyc; docs/performance.md, "A compiled build") reads in
the source: `mypyc_attr`, mypy_extensions' class decorator, or a no-op where that package is
absent (the pure-Python install has no mypy_extensions, and needs none)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")

try:  # read by mypyc in the compiled build; a no-op in Python
    from mypy_extensions import mypyc_attr
except ImportError:

    def mypyc_attr(*attrs: str, **kwattrs: object) -> Callable[[_T], _T]:
        return lambda cls: cls


__all__ = ["mypyc_attr"]
