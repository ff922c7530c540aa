"""The TOML key locator: each key path of a text -> the line it is written on."""

from __future__ import annotations

import tomllib
from pathlib import Path as FilePath
from typing import Any

import pytest

from switchyard_mw.toml_lines import Path, key_lines, line_of, parse_key_path

NESTED = """\
# a comment [not.a.table]
top = 1

[llm_clients.a]
base_url = "http://x"   # trailing comment
models = ["m1",
  "m2"]

[llm_clients."b.c"]
timeout_secs = 0

[llm_clients.a.vertex]
project = "p"
"""


def test_nested_tables_and_their_keys() -> None:
    lines = key_lines(NESTED)
    assert lines[("top",)] == 2
    assert lines[("llm_clients",)] == 4  # made implicitly: its first mention
    assert lines[("llm_clients", "a")] == 4
    assert lines[("llm_clients", "a", "base_url")] == 5
    assert lines[("llm_clients", "a", "models")] == 6
    assert lines[("llm_clients", "a", "models", 0)] == 6
    assert lines[("llm_clients", "a", "models", 1)] == 7
    assert lines[("llm_clients", "b.c")] == 9  # a quoted name with a dot is one part
    assert lines[("llm_clients", "b.c", "timeout_secs")] == 10
    assert lines[("llm_clients", "a", "vertex")] == 12
    assert lines[("llm_clients", "a", "vertex", "project")] == 13
    assert ("not",) not in lines  # a comment is not a table


def test_arrays_of_tables_count_their_elements() -> None:
    text = """\
[[limits]]
tokens = 5

[[limits]]
tokens = 0
per = "minute"

[[tenants.t.limits]]
usd = 1
"""
    lines = key_lines(text)
    assert lines[("limits", 0)] == 1
    assert lines[("limits", 0, "tokens")] == 2
    assert lines[("limits", 1)] == 4
    assert lines[("limits", 1, "tokens")] == 5
    assert lines[("limits", 1, "per")] == 6
    assert lines[("tenants", "t", "limits", 0, "usd")] == 9


def test_inline_tables_and_arrays_of_inline_tables() -> None:
    text = """\
[canaries.m]
variants = { m2 = 10, "odd name" = 5 }
guard = { max_fault_rate = 2, min_requests = 1, window_secs = { nested = true } }
limits = [
  { tokens = 1, per = "day" },
  { requests = 0, per = "minute" },
]
"""
    lines = key_lines(text)
    assert lines[("canaries", "m", "variants", "m2")] == 2
    assert lines[("canaries", "m", "variants", "odd name")] == 2
    assert lines[("canaries", "m", "guard", "window_secs", "nested")] == 3
    assert lines[("canaries", "m", "limits", 0, "per")] == 5
    assert lines[("canaries", "m", "limits", 1, "requests")] == 6


def test_dotted_keys_under_a_table_and_at_the_top() -> None:
    text = """\
server.expose_headers = false
[llm_clients]
a.base_url = "http://x"
a . "models" = ["m"]
a.vertex.region = "r"
"""
    lines = key_lines(text)
    assert lines[("server", "expose_headers")] == 1
    assert lines[("llm_clients", "a")] == 3
    assert lines[("llm_clients", "a", "models")] == 4
    assert lines[("llm_clients", "a", "vertex", "region")] == 5


def test_strings_that_look_like_tables_or_keys_are_skipped() -> None:
    text = '''\
a = """
[fake]
b = 1 \\""" still inside
"""
c = 'x = [y]'
d = "esc \\" [z] \\\\"
"e\\u0041" = 1
when = 1979-05-27 07:32:00
f = 2
g = \'\'\'two quotes end it\'\'\'\'\'
h = 3
'''
    lines = key_lines(text)
    assert ("fake",) not in lines
    assert ("b",) not in lines
    assert lines[("c",)] == 5
    assert lines[("d",)] == 6
    assert lines[("eA",)] == 7  # a quoted key compares by its value
    assert lines[("f",)] == 9
    assert lines[("h",)] == 11


EXAMPLES = sorted((FilePath(__file__).parents[2] / "examples").rglob("*.toml"))


def _paths(value: Any, at: Path = ()) -> list[Path]:
    found: list[Path] = [at] if at else []
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*at, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += _paths(item, (*at, index))
    return found


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_key_of_the_shipped_configs_is_found_on_its_own_line(example: FilePath) -> None:
    text = example.read_text()
    lines = key_lines(text)
    source = text.splitlines()
    paths = _paths(tomllib.loads(text))
    assert paths
    for path in paths:
        assert path in lines, path
        name = path[-1]
        if isinstance(name, str) and name.isidentifier():
            assert name in source[lines[path] - 1], (path, lines[path])


@pytest.mark.parametrize(
    ("problem", "path"),
    [
        ("llm_clients.a.timeout_secs: must be > 0", ("llm_clients", "a", "timeout_secs")),
        ('canaries."x y".variants.m2: no entry', ("canaries", "x y", "variants", "m2")),
        ('canaries."a: b".salt: bad', ("canaries", "a: b", "salt")),
        ("state.sentinels[1]: expected `str`", ("state", "sentinels", 1)),
        ("llm_clients.a.models[...]: expected `str`", ("llm_clients", "a", "models")),
        ("bogus: unknown key", ("bogus",)),
        ("/tmp/c.toml: no such file", None),
        ("c.toml: invalid TOML: x", ("c", "toml")),  # looks like a path; it has no line
    ],
)
def test_the_key_path_a_problem_opens_with(problem: str, path: Path | None) -> None:
    assert parse_key_path(problem) == path


def test_a_missing_key_is_placed_on_its_table() -> None:
    lines = key_lines(NESTED)
    assert line_of(lines, ("llm_clients", "b.c", "models")) == 9
    assert line_of(lines, ("llm_clients", "a", "models", 1)) == 7
    assert line_of(lines, ("nowhere",)) is None
