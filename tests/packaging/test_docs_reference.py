"""docs/ is made from the code where it can be (it cannot drift); nothing public is undocumented."""

from __future__ import annotations

import importlib.util
import inspect
from typing import Any

import switchyard_mw
from servers import ROOT


def _generator() -> Any:  # docs/gen_config_reference.py, loaded as the docs build runs it
    spec = importlib.util.spec_from_file_location("gen", ROOT / "docs" / "gen_config_reference.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_page_is_what_the_code_says() -> None:
    generator = _generator()
    assert generator.OUT.read_text() == generator.render(), (
        "docs/configuration.md is out of date: run python docs/gen_config_reference.py"
    )


def test_every_config_key_is_in_the_reference_with_a_meaning() -> None:
    import msgspec

    generator = _generator()
    page = generator.OUT.read_text()
    for _, kind, _ in generator.TABLES:
        docs = generator.field_docs(kind)
        for field in msgspec.structs.fields(kind):
            assert f"| `{field.encode_name}` |" in page
            assert docs.get(field.encode_name), f"{kind.__name__}.{field.encode_name}: no docstring"


def test_every_public_name_says_what_it_promises() -> None:
    for name in switchyard_mw.__all__:
        if name == "__version__":
            continue
        doc = inspect.getdoc(getattr(switchyard_mw, name))
        assert doc, f"switchyard_mw.{name} has no docstring"
        assert len(doc) > 20, f"switchyard_mw.{name}: {doc!r} says too little"
