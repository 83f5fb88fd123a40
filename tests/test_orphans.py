"""No process started below vbatch outlives it, however vbatch ends (app/core/orphans.py), with real processes: a
stand-in for `vbatch serve` that starts a child which starts a grandchild, as vLLM's engine core starts its worker.
The engine itself is in tests/e2e/test_no_orphans.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

# A parent inside no_orphans() with a child and a grandchild; it prints their pids and waits. SIGTERM ends it
# through Python (as uvicorn's handler does for vbatch), SIGKILL does not.
PARENT = textwrap.dedent(
    """
    import signal, subprocess, sys
    from app.core.orphans import no_orphans

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
    STARTER = [sys.executable, "-c", "import subprocess, sys, time; "
               "p = subprocess.Popen(%r); print(p.pid, flush=True); time.sleep(600)" % (SLEEPER,)]
    with no_orphans(grace=2):
        child = subprocess.Popen(STARTER, stdout=subprocess.PIPE, text=True)
        grandchild = int(child.stdout.readline())
        print(child.pid, grandchild, flush=True)
        signal.pause()
    """
)


def _start_parent() -> tuple[subprocess.Popen, list[psutil.Process]]:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, cwd=os.getcwd(), start_new_session=True
    )
    assert parent.stdout is not None
    pids = [int(pid) for pid in parent.stdout.readline().split()]
    processes = [psutil.Process(pid) for pid in pids]
    assert len(processes) == 2 and all(p.is_running() for p in processes)
    return parent, processes


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_children_end_with_their_parent(how):
    parent, below = _start_parent()
    try:
        os.kill(parent.pid, how)
        parent.wait(timeout=30)
        gone, alive = psutil.wait_procs(below, timeout=30)
        assert alive == [], f"still running after the parent's {how.name}: {[p.pid for p in alive]}"
        assert len(gone) == 2
    finally:
        for process in below:
            if process.is_running():
                process.kill()


def test_a_normal_exit_leaves_no_reaper():
    parent, below = _start_parent()
    reapers = [p for p in psutil.Process(parent.pid).children() if "app.core.orphans" in " ".join(p.cmdline())]
    assert len(reapers) == 1
    os.kill(parent.pid, signal.SIGTERM)
    assert parent.wait(timeout=30) == 0
    _, alive = psutil.wait_procs(reapers + below, timeout=30)
    assert alive == []
