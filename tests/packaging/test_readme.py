"""Every command the README shows is run somewhere as a user runs it, and its code excerpt is
the example file's own code.

A command added to the README without a place that runs it fails here: say where it runs.
"""

from __future__ import annotations

import re
import tomllib

from servers import ROOT

README = (ROOT / "README.md").read_text()

# Each README command -> (file that runs it, what in that file shows it runs this command).
RUN_BY = {
    "python3 -m venv .venv && .venv/bin/pip install -e '.[example]' && "
    ".venv/bin/python examples/starlette_app.py": [
        (".ci/installs", "'.[example]'"),  # the install, in a fresh virtualenv
        ("tests/examples/test_example_default.py", '"examples/starlette_app.py"'),  # the command
    ],
    "curl -s http://127.0.0.1:8000/v1/messages -H 'content-type: application/json' "
    '-H \'x-api-key: anything\' -D - -d \'{"model": "claude-opus-5", "max_tokens": 100, '
    '"messages": [{"role": "user", "content": "Hello"}]}\'': [
        ("tests/examples/test_example_default.py", "readme_curls()"),  # as written, in bash
    ],
    "curl -s -X PUT http://127.0.0.1:9100/_mock/behaviours/mock-key-a -d '{\"status\": 401}'": [
        ("tests/examples/test_example_default.py", "readme_curls()"),
    ],
    "curl -s -X PUT http://127.0.0.1:9100/_mock/behaviours/mock-judge-key "
    '-d \'{"reply": "simple"}\'': [
        ("tests/examples/test_example_default.py", "readme_curls()"),
    ],
    "python3 -m venv .venv && .venv/bin/pip install -e '.[dev]' && .venv/bin/pytest": [
        (".ci/run", "python3 -m venv .venv"),
        (".ci/run", "pip install -q -e '.[dev]'"),
        (".ci/run", ".venv/bin/pytest"),
    ],
    "MOCK_KEY_A=key-a MOCK_KEY_B=key-b MOCK_JUDGE_KEY=key-j "
    ".venv/bin/uvicorn examples.wrap_your_app:app --port 8001": [
        ("tests/examples/test_example_wrap.py", "readme_commands()"),
        ("tests/examples/test_readme_sequence.py", "readme_servers()"),  # beside the others
    ],
    ".venv/bin/switchyard-mw check-config my.toml": [
        ("tests/gateway/test_serve_live.py", "readme_serve_commands()"),  # as written, in bash
    ],
    ".venv/bin/switchyard-mw serve my.toml --port 8002 --workers 2 --log-format json": [
        ("tests/gateway/test_serve_live.py", "readme_serve_commands()"),
    ],
    "SWITCHYARD_MOCK_PORT=9101 .venv/bin/python examples/envoy/run.py": [
        ("tests/examples/test_example_extra.py", '"examples/envoy/run.py"'),
        ("tests/examples/test_readme_sequence.py", "readme_servers()"),  # beside the others
    ],
    ".venv/bin/pip install build && .venv/bin/python -m build": [
        (".ci/check_wheel.sh", "pip install build"),
        (".ci/check_wheel.sh", "-m build"),
    ],
    ".venv/bin/pip install 'dist/switchyard_mw-0.1.0-py3-none-any.whl[example]'": [
        (".ci/check_wheel.sh", 'pip install "$wheel[example]"'),
    ],
    ".venv/bin/mkdocs build --strict --site-dir site": [
        (".ci/run", "mkdocs build --strict"),
    ],
    "python3 bench/fresh_run.py": [
        ("tests/bench/test_fresh_run.py", '"bench/fresh_run.py"'),  # its --smoke, end to end
    ],
}


def readme_commands() -> list[str]:
    """Every shell command in the README's sh blocks: continuations joined, comments dropped."""
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", README, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = re.sub(r"\s+#.*$", "", line).strip()
            if command and not command.startswith("#"):
                commands.append(re.sub(r"\s+", " ", command))
    return commands


def test_every_readme_command_is_run_somewhere() -> None:
    commands = readme_commands()
    assert sorted(commands) == sorted(RUN_BY), "a README command with no place that runs it"
    for command, places in RUN_BY.items():
        for path, needle in places:
            assert needle in (ROOT / path).read_text(), (command, path, needle)


def test_the_wheel_named_is_the_version_built() -> None:
    with (ROOT / "pyproject.toml").open("rb") as f:
        version = tomllib.load(f)["project"]["version"]
    named = re.findall(r"switchyard_mw-([0-9][^-]*)-py3-none-any\.whl", README)
    assert named
    assert set(named) == {version}


def test_the_wrap_excerpt_is_the_example_files_code() -> None:
    section = README.split("\n## Wrap your own app\n", 1)[1].split("\n## ", 1)[0]
    excerpt = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    source = (ROOT / "examples" / "wrap_your_app.py").read_text().splitlines()
    at = 0
    for line in excerpt.splitlines():
        if not line.strip():
            continue
        # in the file, in the same order
        found = next((i for i in range(at, len(source)) if source[i] == line), None)
        assert found is not None, f"not in examples/wrap_your_app.py (in order): {line!r}"
        at = found + 1
