"""The reload signal before a server takes it over (`engine.early_signal`): noted, not fatal,
and one reload once the server handles it.

Each case runs in a fresh interpreter: only a process's main thread may set signal handlers
(pytest's workers may run tests in another), and a mistake here ends the process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP")


def run(code: str) -> None:
    """Run `code` in a new interpreter; it must end normally (a SIGHUP unhandled ends it)."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=os.environ,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert done.stdout.strip() == "ok", done.stdout


def test_a_held_signal_is_noted_once() -> None:
    run("""
        import os, signal
        from switchyard_mw.engine import early_signal
        early_signal.hold_early()
        os.kill(os.getpid(), signal.SIGHUP)  # Python's default would end this process
        assert early_signal.taken()
        assert not early_signal.taken()  # cleared
        print("ok")
    """)


def test_the_server_taking_it_over_reloads_once_for_noted_signals() -> None:
    run("""
        import asyncio, os, signal
        from switchyard_mw.engine import early_signal, reload

        async def main():
            reloads = []
            assert reload.on_signal(lambda: reloads.append(1))
            await asyncio.sleep(0.05)
            assert reloads == [1], reloads  # two noted, one reload: the file as it is now
            os.kill(os.getpid(), signal.SIGHUP)  # the server's handler from now on
            await asyncio.sleep(0.05)
            assert reloads == [1, 1], reloads
            reload.off_signal()

        early_signal.hold_early()
        os.kill(os.getpid(), signal.SIGHUP)
        os.kill(os.getpid(), signal.SIGHUP)
        asyncio.run(main())
        print("ok")
    """)


def test_without_a_noted_signal_no_reload() -> None:
    run("""
        import asyncio
        from switchyard_mw.engine import early_signal, reload

        async def main():
            reloads = []
            assert reload.on_signal(lambda: reloads.append(1))
            await asyncio.sleep(0.05)
            assert reloads == [], reloads

        early_signal.hold_early()
        asyncio.run(main())
        print("ok")
    """)


def test_a_worker_started_blocked_takes_the_signal_at_its_hold() -> None:
    """A child started inside `blocked_for_children` (fork and exec keep the mask): a SIGHUP
    sent before its hold waits, then is noted; the parent's own SIGHUP waits out the block."""
    run("""
        import os, signal, subprocess, sys
        from switchyard_mw.engine import early_signal

        child = '''
        import os, signal, sys, time
        assert signal.SIGHUP in signal.pthread_sigmask(signal.SIG_BLOCK, set())
        print("started", flush=True)
        sys.stdin.readline()  # the parent has sent its SIGHUP
        assert signal.SIGHUP in signal.sigpending()
        from switchyard_mw.engine import early_signal
        early_signal.hold_early()
        assert early_signal.taken()
        print("noted", flush=True)
        '''
        early_signal.hold_early()
        with early_signal.blocked_for_children():
            proc = subprocess.Popen(
                [sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                text=True,
            )
            os.kill(os.getpid(), signal.SIGHUP)
            assert not early_signal.taken()  # blocked here too, until the block ends
        assert early_signal.taken()
        assert proc.stdout.readline() == "started\\n"
        proc.send_signal(signal.SIGHUP)
        proc.stdin.write("\\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "noted\\n"
        assert proc.wait(30) == 0
        print("ok")
    """)
