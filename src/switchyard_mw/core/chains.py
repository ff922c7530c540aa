"""Fallback chains as a graph: the order a request's models are tried in, and cycles.

Pure functions over `{model: [next models]}`; the config checks chains with `cycles` and the
engine orders a request's models with `expand`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["cycles", "expand"]


def expand(chains: Mapping[str, Sequence[str]], model: str) -> tuple[str, ...]:
    """The models after `model`, in the order they are tried: its own chain first, then the
    chains of those models in turn (breadth first), each model once and never `model` itself.

    Breadth first keeps the operator's order: `a = [b, c]` tries `c` before `b`'s own chain.
    """
    order: list[str] = []
    seen = {model}
    queue = [model]
    while queue:
        for after in chains.get(queue.pop(0), ()):
            if after not in seen:
                seen.add(after)
                order.append(after)
                queue.append(after)
    return tuple(order)


def cycles(chains: Mapping[str, Sequence[str]]) -> list[list[str]]:
    """Each cycle through the chains once, as the path that closes it (`[a, b, a]`), found
    from the models in the mapping's order."""
    found: list[list[str]] = []
    done: set[str] = set()
    for start in chains:
        if start not in done:
            _walk(chains, start, [], set(), done, found)
    return found


def _walk(
    chains: Mapping[str, Sequence[str]],
    model: str,
    path: list[str],
    on_path: set[str],
    done: set[str],
    found: list[list[str]],
) -> None:
    # Depth first; a model on the current path reached again closes a cycle. A model whose
    # every path was walked (`done`) cannot close a new one. Chains are short: recursion is
    # bounded by the number of models in the config.
    path.append(model)
    on_path.add(model)
    for after in chains.get(model, ()):
        if after in on_path:
            found.append([*path[path.index(after) :], after])
        elif after not in done:
            _walk(chains, after, path, on_path, done, found)
    path.pop()
    on_path.discard(model)
    done.add(model)
