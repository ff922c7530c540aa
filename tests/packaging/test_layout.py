"""The package's module names: each says which layer's part it is, so no name repeats.

`judge.py` in three packages made a reader (and a traceback, and an import) ask which one; the
ASGI middleware is now `asgi/judge_middleware.py`, the consultation `engine/judge.py`, the
verdict's parsing `core/judge_verdicts.py` (CONTRIBUTING.md, "The package's layers").
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import switchyard_mw

PACKAGE = Path(switchyard_mw.__file__).parent
GENERATED = PACKAGE / "_protos"  # Envoy's protos, generated under their upstream names


def module_names(root: Path) -> Counter[str]:
    return Counter(
        path.name
        for path in root.rglob("*.py")
        if path.name != "__init__.py" and not path.is_relative_to(GENERATED)
    )


def test_no_two_modules_share_a_name() -> None:
    repeated = sorted(name for name, count in module_names(PACKAGE).items() if count > 1)
    assert repeated == []


def test_a_repeated_name_is_found(tmp_path: Path) -> None:
    # The check itself: two packages with a `judge.py` each are reported.
    for package in ("core", "asgi"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "judge.py").write_text("")
        (tmp_path / package / "__init__.py").write_text("")
    assert module_names(tmp_path)["judge.py"] == 2
    assert "__init__.py" not in module_names(tmp_path)
