"""No process started below vbatch outlives it, however vbatch ends (app/core/orphans.py), with real processes: a
stand-in for `vbatch serve` that starts its children as vLLM does, on the CPU (exec'd, the engine core starting its
worker) and on a GPU (forked from vbatch's process), each naming itself with `setproctitle` as vLLM's do. The engine
itself is in tests/e2e/test_no_orphans.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

# A parent inside no_orphans() with four processes below it; it prints their pids and waits. SIGTERM ends it
# through Python, SIGKILL does not.
PARENT = textwrap.dedent(
    """
    import multiprocessing, os, signal, subprocess, sys, time
    from app.core.orphans import no_orphans, start_in_lineage

    start_in_lineage()  # as `vbatch serve` does first
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

    def titled(title):
        import setproctitle  # zeroes the environment block that /proc/PID/environ shows, for room for the title
        setproctitle.setproctitle(title)

    def forked_engine(pids):
        titled("VLLM::EngineCore")
        worker = os.fork()
        if worker == 0:
            titled("VLLM::Worker")
            time.sleep(600)
            os._exit(0)
        pids.send(worker)
        time.sleep(600)

    TITLED_SLEEPER = "import setproctitle, time; setproctitle.setproctitle('VLLM::Worker'); time.sleep(600)"
    SPAWNED_ENGINE = [sys.executable, "-c", "import setproctitle, subprocess, sys, time; "
                      "setproctitle.setproctitle('VLLM::EngineCore'); "
                      "p = subprocess.Popen([sys.executable, '-c', %r]); print(p.pid, flush=True); time.sleep(600)"
                      % TITLED_SLEEPER]
    with no_orphans(grace=2):
        spawned = subprocess.Popen(SPAWNED_ENGINE, stdout=subprocess.PIPE, text=True)
        spawned_worker = int(spawned.stdout.readline())
        fork = multiprocessing.get_context("fork")
        receiving, sending = fork.Pipe(duplex=False)
        forked = fork.Process(target=forked_engine, args=(sending,))
        forked.start()
        print(spawned.pid, spawned_worker, forked.pid, receiving.recv(), flush=True)
        while True:  # not signal.pause(): a SIGTERM landing just before the pause would be handled after it: never
            time.sleep(0.1)
    """
)


def _start_parent() -> tuple[subprocess.Popen, list[psutil.Process]]:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, cwd=os.getcwd(), start_new_session=True
    )
    assert parent.stdout is not None
    pids = [int(pid) for pid in parent.stdout.readline().split()]
    processes = [psutil.Process(pid) for pid in pids]
    assert len(processes) == 4 and all(p.is_running() for p in processes)
    return parent, processes


def _reapers(parent: subprocess.Popen) -> list[psutil.Process]:
    return [p for p in psutil.Process(parent.pid).children() if p.cmdline()[1:3] == ["-m", "app.core.orphans"]]


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_children_end_with_their_parent(how):
    parent, below = _start_parent()
    try:
        os.kill(parent.pid, how)
        parent.wait(timeout=30)
        gone, alive = psutil.wait_procs(below, timeout=30)
        assert alive == [], f"still running after the parent's {how.name}: {[(p.pid, p.name()) for p in alive]}"
        assert len(gone) == 4
    finally:
        for process in below:
            if process.is_running():
                process.kill()


def test_the_parent_keeps_its_pid_and_every_child_starts_with_its_token():
    parent, below = _start_parent()
    try:
        lineage = psutil.Process(parent.pid).environ()["VBATCH_LINEAGE"]
        assert lineage.startswith(f"{parent.pid}-")
        assert [p.environ().get("VBATCH_LINEAGE") for p in below] == [lineage] * 4
    finally:
        os.kill(parent.pid, signal.SIGTERM)
        parent.wait(timeout=30)


def test_a_normal_exit_leaves_no_reaper():
    parent, below = _start_parent()
    reapers = _reapers(parent)
    assert len(reapers) == 1
    os.kill(parent.pid, signal.SIGTERM)
    assert parent.wait(timeout=30) == 0
    _, alive = psutil.wait_procs(reapers + below, timeout=30)
    assert alive == []
