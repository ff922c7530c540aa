"""LiteLLM's fallback settings as switchyard's `[fallbacks]` chains.

LiteLLM's `fallbacks` act when a model fails (switchyard's `unavailable`), its
`context_window_fallbacks` on a prompt too long for the model (`context_length`),
`default_fallbacks` for every model without a chain of its own. switchyard keeps one chain per
model, only over models it serves, and refuses a cycle through the chains (its chains compose);
what does not fit is listed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..core.chains import expand
from .litellm_site import Notes
from .toml_text import Table, Value

Chains = dict[str, tuple[list[str], str]]
"""{model: (its fallback models, where in config.yaml they were set)}"""


class SettingsView(Protocol):
    """The router-wide settings read: each key's value and where it was set."""

    @property
    def values(self) -> Mapping[str, Any]: ...

    @property
    def origin(self) -> Mapping[str, str]: ...


@dataclass
class Served:
    """The public models the translated accounts serve (`"*"`: any), and on which wires."""

    models: list[str]
    wires: dict[str, set[str]] = field(default_factory=dict)

    def __call__(self, model: str) -> bool:
        return "*" in self.models or model in self.models


def fallback_table(settings: SettingsView, served: Served, notes: Notes) -> Table:
    """`[fallbacks]`: each model's chain, and for which reasons."""
    general = _chains(settings, "fallbacks", notes)
    context = _chains(settings, "context_window_fallbacks", notes)
    for model in _chains(settings, "content_policy_fallbacks", notes):
        notes.add(
            f"{settings.origin['content_policy_fallbacks']} ({model})",
            "switchyard's chains act on unavailability and context length, not on a "
            "content-policy refusal",
        )
    _default_fallbacks(settings, general, served, notes)
    table = Table("fallbacks")
    graph: dict[str, list[str]] = {}
    for model in dict.fromkeys([*general, *context]):
        where = f"fallbacks ({model})"
        if not served(model):
            notes.add(where, f"no deployment of {model} was translated: its chain is dropped")
            continue
        g = _usable(model, general.get(model, ([], ""))[0], served, graph, notes)
        c = _usable(model, context.get(model, ([], ""))[0], served, graph, notes)
        entry, origin = _entry(model, g, c, general, context, notes)
        if entry is not None:
            graph[model] = g or c
            table.set(model, entry, origin)
            _same_wire(model, graph[model], served, notes)
    return table


def _same_wire(model: str, chain: list[str], served: Served, notes: Notes) -> None:
    """LiteLLM turns a request into each provider's format; switchyard rewrites only `model`,
    so a request falls back in the format it came in, which the chain's accounts must take."""
    for after in chain:
        missing = served.wires.get(model, set()) - served.wires.get(after, set())
        if missing and after in served.wires:
            theirs = " and ".join(sorted(served.wires[after]))
            notes.add(
                f"fallbacks ({model} -> {after})",
                f"{after}'s accounts take {theirs} requests only: a request for {model} in "
                f"the {' or '.join(sorted(missing))} format that falls back reaches them in it",
            )


def _chains(settings: SettingsView, key: str, notes: Notes) -> Chains:
    """`[{"a": ["b", "c"]}, ...]` (or one mapping) as {model: (chain, where from)}."""
    raw = settings.values.get(key)
    if raw is None:
        return {}
    where = settings.origin[key]
    items = raw if isinstance(raw, list) else [raw]
    chains: Chains = {}
    for item in items:
        if not isinstance(item, dict):
            notes.add(where, f"expected [{{model: [fallback, ...]}}, ...], got {item!r}")
            continue
        for model, after in item.items():
            after = [after] if isinstance(after, str) else after
            if isinstance(after, list) and all(isinstance(m, str) for m in after):
                chains[str(model)] = (after, where)
            else:
                notes.add(f"{where} ({model})", "expected a list of model names")
    return chains


def _default_fallbacks(
    settings: SettingsView, general: Chains, served: Served, notes: Notes
) -> None:
    """`default_fallbacks`: the chain of every model that has none of its own."""
    default = settings.values.get("default_fallbacks")
    if default is None:
        return
    where = settings.origin["default_fallbacks"]
    if not (isinstance(default, list) and all(isinstance(m, str) for m in default)):
        notes.add(where, "expected a list of model names")
        return
    for model in served.models:
        if model not in general and model not in default and model != "*":
            general[model] = (list(default), where)


def _entry(
    model: str,
    g: list[str],
    c: list[str],
    general: Mapping[str, tuple[list[str], str]],
    context: Mapping[str, tuple[list[str], str]],
    notes: Notes,
) -> tuple[Value | None, str]:
    """One model's chain: LiteLLM's `fallbacks` act when the model fails (`unavailable`), its
    `context_window_fallbacks` on a prompt too long for it (`context_length`)."""
    if g and g == c:
        return g, f"{general[model][1]} and {context[model][1]}"
    if g:
        if c:
            notes.add(
                f"{context[model][1]} ({model})",
                f"switchyard keeps one chain per model: {model}'s chain is its fallbacks, "
                "for unavailability only",
            )
        return {"models": g, "on": ["unavailable"]}, general[model][1]
    if c:
        return {"models": c, "on": ["context_length"]}, context[model][1]
    return None, ""


def _usable(
    model: str, after: list[str], served: Served, graph: Mapping[str, list[str]], notes: Notes
) -> list[str]:
    """The chain's models switchyard can take: served, named once, closing no cycle.

    LiteLLM follows `a -> b` and `b -> a` both; switchyard's chains compose (`a`'s includes
    `b`'s), so it refuses a cycle, and the chain that would close one loses that model."""
    usable: list[str] = []
    for name in after:
        where = f"fallbacks ({model} -> {name})"
        if not served(name):
            notes.add(where, f"no deployment of {name} was translated")
        elif name == model or model in expand(graph, name):
            notes.add(where, "closes a cycle through the chains, which switchyard refuses")
        elif name not in usable:
            usable.append(name)
    return usable
