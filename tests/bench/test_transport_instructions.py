"""`bench/transport_instructions.py` records what a real Envoy sends its processor, then feeds
the transport those reads with either handler (the count's child, run here without valgrind:
it asserts every stream was answered and ended, none left open)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from process_group import run_in_own_group
from servers import ROOT

sys.path.insert(0, str(ROOT / "bench"))

from _harness import envoy_binary  # bench/ is a folder of scripts, not a package
from transport_instructions import HANDLERS, TRANSPORTS, load, reads_for, record

pytestmark = pytest.mark.integration  # Envoy, the mock provider and the processor


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if envoy_binary() is None or shutil.which("h2load") is None:
        pytest.skip("Envoy and h2load are needed (.ci/run installs them)")
    workdir = tmp_path_factory.mktemp("record")
    return record("1KB", 25, workdir, into=workdir / "bytes")


def test_a_recording_holds_the_streams_it_was_asked_for(recording: Path) -> None:
    reads = load(recording)
    assert reads[0].startswith(b"PRI * HTTP/2.0")
    assert 0 < len(reads_for(reads, 25)) <= len(reads)  # all 25 there
    with pytest.raises(ValueError, match="streams"):
        reads_for(reads, 26)


@pytest.mark.parametrize("handler", HANDLERS)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.timeout(120)  # a guard against a hang, not a time target
def test_the_count_child_answers_every_recorded_stream(
    recording: Path, transport: str, handler: str
) -> None:
    script = str(ROOT / "bench" / "transport_instructions.py")
    cmd = [sys.executable, script, "--child", transport, str(recording), "5", handler]
    code, _, err = run_in_own_group(cmd, cwd=ROOT, timeout=100)
    assert code == 0, err[-2000:]
    assert "written" in err  # the answers' bytes went to the socket
