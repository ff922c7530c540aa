"""No import circle inside the package: each module's imports, TYPE_CHECKING ones included (a
reader follows those too), form no loop. The layer contracts (pyproject's import-linter) keep
the layers apart; this keeps the modules of one layer apart too (issue 47 found four circles:
machine and policies, the HTTP clients, the flights and the policy, the h2 stream and
transport)."""

from __future__ import annotations

from collections.abc import Mapping, Set

import grimp

PACKAGE = "switchyard_mw"


def circles(imports: Mapping[str, Set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(imports.get(module, ())):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == module:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(imports):
        if module not in index:
            visit(module)
    return found


def package_imports() -> dict[str, set[str]]:
    # No cache: grimp's is per working folder and keyed by file times, and a graph of another
    # checkout's files (a worktree, a stash) was read back from it here as this one's.
    graph = grimp.build_graph(PACKAGE, cache_dir=None)
    modules = {m for m in graph.modules if m.startswith(PACKAGE) and "._protos" not in m}
    return {m: graph.find_modules_directly_imported_by(m) & modules for m in modules}


def test_no_module_of_the_package_imports_itself_round_a_circle() -> None:
    assert circles(package_imports()) == []


def test_a_circle_is_found() -> None:
    # The check itself: a loop of three and one of two, beside modules in no loop.
    imports = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}}
    assert sorted(circles(imports)) == [["a", "b", "c"], ["e", "f"]]
