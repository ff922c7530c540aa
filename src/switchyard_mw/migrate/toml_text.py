"""Write a config as TOML text, with the comments a translation wants beside its keys.

The standard library reads TOML but does not write it, and a translated config needs what no
writer gives: a comment saying where each table and key came from. The values written are
the few a switchyard config holds: strings, numbers, booleans, lists of strings and inline
tables of those.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

Value = str | int | float | bool | Sequence[str] | Mapping[str, "Value"]

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+\Z")


@dataclass
class Table:
    """One `[header]` table: its keys in order, each with an optional trailing comment."""

    header: str
    comments: list[str] = field(default_factory=list)
    """Lines written under the header, before the keys."""
    entries: list[tuple[str, Value, str]] = field(default_factory=list)

    def set(self, key: str, value: Value, comment: str = "") -> None:
        self.entries.append((key, value, comment))


def key(name: str) -> str:
    """A key as TOML takes it: bare when it can be, else a basic string."""
    return name if _BARE_KEY.match(name) else string(name)


def string(text: str) -> str:
    # JSON's string escapes (\" \\ \n \t \uXXXX) are all TOML basic-string escapes too;
    # JSON leaves DEL as it is, which TOML wants escaped.
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def value(v: Value) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"not a TOML number: {v!r}")
        return str(int(v)) if v.is_integer() else repr(v)
    if isinstance(v, str):
        return string(v)
    if isinstance(v, Mapping):
        inner = ", ".join(f"{key(k)} = {value(item)}" for k, item in v.items())
        return f"{{ {inner} }}" if inner else "{}"
    return "[" + ", ".join(value(item) for item in v) + "]"


def one_line(text: str) -> str:
    """`text` fit for a comment: names from the translated file never break out of it."""
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in " ".join(text.split()))


def comment_lines(lines: Sequence[str]) -> list[str]:
    return [f"# {one_line(line)}".rstrip() for line in lines]


def render(preamble: Sequence[str], tables: Sequence[Table]) -> str:
    """The whole file: `preamble` as comment lines, then each table."""
    out = comment_lines(preamble)
    for table in tables:
        if out:
            out.append("")
        out.append(f"[{table.header}]")
        out.extend(comment_lines(table.comments))
        for name, v, note in table.entries:
            line = f"{key(name)} = {value(v)}"
            out.append(f"{line}  # {one_line(note)}" if note else line)
    return "\n".join(out) + "\n"
