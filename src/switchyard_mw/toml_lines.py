"""Where each key of a TOML text is written: `tomllib` keeps no positions, so check-config's
problems (`llm_clients.a.timeout_secs: must be > 0`) are mapped back to lines here.

The text has already parsed (tomllib), so the scanner trusts its shape: it reads table
headers (`[a."b c"]`, `[[a]]`), keys (bare, quoted, dotted), inline tables and arrays
(their elements as `key[0]`), and skips strings, multi-line ones included, and comments.
A path is the tuple of its parts: `("llm_clients", "a", "timeout_secs")`, `("limits", 0)`.
"""

from __future__ import annotations

import re

Path = tuple[str | int, ...]

_BARE = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPE = re.compile(r"\\(u[0-9A-Fa-f]{4}|U[0-9A-Fa-f]{8}|.)", re.S)
_SIMPLE_ESCAPES = {"b": "\b", "t": "\t", "n": "\n", "f": "\f", "r": "\r", '"': '"', "\\": "\\"}
_LOCAL_DATE_TIME = re.compile(r"\d{4}-\d{2}-\d{2} (?=\d)")
_SCALAR_END = re.compile(r"[,\]}\s#]")


def key_lines(text: str) -> dict[Path, int]:
    """Each key path written in `text` -> the 1-based line it is first written on.

    A table made implicitly (`[a.b]` makes `a`) takes the line of its first mention.
    """
    scanner = _Scanner(text)
    try:
        return scanner.run()
    except (ValueError, IndexError):  # a shape this scanner does not know: the lines so far
        return scanner.lines


def line_of(lines: dict[Path, int], path: Path) -> int | None:
    """The line of `path`, or of its longest written prefix (a missing key: its table's line)."""
    for end in range(len(path), 0, -1):
        if (line := lines.get(path[:end])) is not None:
            return line
    return None


def parse_key_path(problem: str) -> Path | None:
    """The key path a `key.path: rule` problem opens with (`a."b c"[0].d` -> `("a", "b c", 0,
    "d")`); None for a problem about the whole file."""
    parts: list[str | int] = []
    i = 0
    while i < len(problem):
        if problem.startswith('"', i):
            end = problem.find('"', i + 1)
            if end < 0:
                return None
            parts.append(problem[i + 1 : end])
            i = end + 1
        elif m := _BARE.match(problem, i):
            parts.append(m.group())
            i = m.end()
        else:
            return None
        while problem.startswith("[", i):  # `[3]` an index, `[...]` msgspec's unnamed key
            end = problem.find("]", i)
            if end < 0:
                return None
            index = problem[i + 1 : end]
            if not index.isdigit():
                return tuple(parts) if problem.startswith(":", end + 1) else None
            parts.append(int(index))
            i = end + 1
        if problem.startswith(": ", i) or i == len(problem):
            return tuple(parts)
        if not problem.startswith(".", i):
            return None
        i += 1
    return None


class _Scanner:
    def __init__(self, text: str) -> None:
        self.text = text
        self.i = 0
        self.lines: dict[Path, int] = {}
        self.arrays: dict[Path, int] = {}  # each `[[array]]`: the elements seen so far

    def run(self) -> dict[Path, int]:
        table: Path = ()
        while True:
            self._skip_blank(newlines=True)
            if self.i >= len(self.text):
                return self.lines
            if self.text.startswith("[[", self.i):
                self.i += 2
                name = self._key()
                index = self.arrays.get(name, -1) + 1
                self.arrays[name] = index
                table = (*name, index)
                self._mark(table)
                self.i = self.text.index("]]", self.i) + 2
            elif self.text.startswith("[", self.i):
                self.i += 1
                table = self._key()
                self._mark(table)
                self.i = self.text.index("]", self.i) + 1
            else:
                self._key_value(table)

    def _key_value(self, table: Path) -> None:
        key = (*table, *self._key())
        self._mark(key)
        self._skip_blank()
        self.i += 1  # "="
        self._value(key)

    def _value(self, at: Path) -> None:
        self._skip_blank()
        text, i = self.text, self.i
        if text.startswith("{", i):
            self.i += 1
            self._inline_table(at)
        elif text.startswith("[", i):
            self.i += 1
            self._array(at)
        elif text.startswith(('"', "'"), i):
            self._string()
        else:
            if m := _LOCAL_DATE_TIME.match(text, i):  # the one scalar with a space inside
                i = m.end()
            end = _SCALAR_END.search(text, i)
            self.i = len(text) if end is None else end.start()

    def _inline_table(self, at: Path) -> None:
        while True:
            self._skip_blank(newlines=True)
            if self.text.startswith("}", self.i):
                self.i += 1
                return
            if self.text.startswith(",", self.i):
                self.i += 1
                continue
            self._key_value(at)

    def _array(self, at: Path) -> None:
        index = 0
        while True:
            self._skip_blank(newlines=True)
            if self.text.startswith("]", self.i):
                self.i += 1
                return
            if self.text.startswith(",", self.i):
                self.i += 1
                continue
            self._mark((*at, index))
            self._value((*at, index))
            index += 1

    def _key(self) -> Path:
        """A dotted key (`a."b.c".d`), spaces around the dots allowed."""
        parts: list[str | int] = []
        while True:
            self._skip_blank()
            if self.text.startswith(('"', "'"), self.i):
                parts.append(self._string())
            else:
                m = _BARE.match(self.text, self.i)
                if m is None:
                    raise ValueError(f"no key at offset {self.i}")
                parts.append(m.group())
                self.i = m.end()
            self._skip_blank()
            if not self.text.startswith(".", self.i):
                return tuple(parts)
            self.i += 1

    def _string(self) -> str:
        """One string of any of TOML's four kinds; its value (keys are compared by value)."""
        text, i = self.text, self.i
        quote = text[i]
        delimiter = quote * 3 if text.startswith(quote * 3, i) else quote
        end = i + len(delimiter)
        while not text.startswith(delimiter, end):
            if end >= len(text):
                raise ValueError("unterminated string")
            end += 2 if quote == '"' and text[end] == "\\" else 1
        if len(delimiter) == 3:
            while text.startswith(quote, end + 3):  # up to two quotes may end the content
                end += 1
        self.i = end + len(delimiter)
        raw = text[i + len(delimiter) : end]
        return _ESCAPE.sub(_unescape, raw) if quote == '"' else raw

    def _skip_blank(self, *, newlines: bool = False) -> None:
        """Spaces and tabs (and newlines and comments where `newlines`), never a value."""
        text = self.text
        while self.i < len(text):
            c = text[self.i]
            if c in " \t" or (newlines and c in "\r\n"):
                self.i += 1
            elif c == "#" and newlines:
                end = text.find("\n", self.i)
                self.i = len(text) if end < 0 else end
            else:
                return

    def _mark(self, path: Path) -> None:
        line = self.text.count("\n", 0, self.i) + 1
        for end in range(1, len(path) + 1):
            self.lines.setdefault(path[:end], line)


def _unescape(m: re.Match[str]) -> str:
    code = m.group(1)
    if code[0] in "uU" and len(code) > 1:
        return chr(int(code[1:], 16))
    return _SIMPLE_ESCAPES.get(code, code)
