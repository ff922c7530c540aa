"""`examples/providers/`: one model served three ways (the Anthropic API, Bedrock, Vertex AI),
run offline on the bundled mock as docs/providers.md says, answers from the API, then from
Bedrock when the API fails, then from Vertex when Bedrock throttles too, JSON and streams."""

from __future__ import annotations

import subprocess
import sys

import pytest

from servers import ROOT, free_port

pytestmark = pytest.mark.integration
pytest.importorskip("botocore")
pytest.importorskip("google.auth")


def test_the_three_provider_example_fails_over_from_the_api_to_bedrock_to_vertex() -> None:
    run = subprocess.run(
        [
            sys.executable,
            "examples/providers/run.py",
            "--demo",
            "--port",
            str(free_port()),
            "--mock-port",
            str(free_port()),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    answered = [line.split("->")[1].split() for line in run.stdout.splitlines() if "->" in line]
    reply = ["Hello", "from", "the", "mock", "provider."]
    assert answered == [
        ["anthropic", *reply],
        ["anthropic", *reply],
        ["bedrock", *reply],
        ["bedrock", *reply],
        ["vertex", *reply],
        ["vertex", *reply],
    ]
    assert "Traceback" not in run.stderr
