"""A script run in a process group of its own, the whole group stopped when it ends.

The bench scripts start servers and valgrind counts of their own: a kill of the script alone
(a time-out) leaves those running; a signal to the group stops them all.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path


def run_in_own_group(cmd: Sequence[str], *, cwd: Path, timeout: float) -> tuple[int, str, str]:
    """Run `cmd` to its end (or `timeout`: TimeoutExpired); its exit code, stdout and stderr.
    Whatever ends it, nothing of its process group outlives the call."""
    proc = subprocess.Popen(
        list(cmd),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return proc.returncode, out, err
