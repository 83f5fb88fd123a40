"""No process that vbatch starts outlives it.

vLLM runs its engine core, its GPU workers and vbatch's front ends as child processes. Two ways of ending would leave
them running, holding a GPU's memory so that the next start fails: a stop while the engine is still starting (the
drain stops waiting for it) and a SIGKILL of vbatch itself (an out-of-memory killer, a Ray actor killed). So:

- `no_orphans()` wraps a whole run: when it exits, by any path Python still runs, every process below this one is
  sent SIGTERM, and SIGKILL after a grace;
- and for the paths Python does not run (SIGKILL), it starts a reaper: a small process of its own, started with
  `subprocess` (never forked from a process with threads), that waits for this process to be gone and then ends
  them.

Descendants are found by a token in their environment (`VBATCH_LINEAGE`), which every child inherits whatever starts
it (fork, spawn, exec), so a worker whose engine core died first, or a process started an instant before a SIGKILL,
is still found.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil

log = logging.getLogger("vbatch.orphans")

LINEAGE = "VBATCH_LINEAGE"
GRACE_SECONDS = 5.0
WATCH_SECONDS = 0.5


@contextmanager
def no_orphans(grace: float = GRACE_SECONDS) -> Iterator[None]:
    """Within it, every process started below this one ends when this one does, or when it leaves the block."""
    token = secrets.token_hex(8)
    outer = os.environ.get(LINEAGE)
    os.environ[LINEAGE] = token
    reaper = _start_reaper(token)
    try:
        yield
    finally:
        _end(_carrying(token, spare={reaper.pid}), grace)
        reaper.kill()
        reaper.wait()
        if outer is None:
            os.environ.pop(LINEAGE, None)
        else:
            os.environ[LINEAGE] = outer


def _start_reaper(token: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "app.core.orphans", str(os.getpid()), token]
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, close_fds=True)


def reap_after(parent_pid: int, token: str, grace: float = GRACE_SECONDS) -> None:
    """The reaper's life: once `parent_pid` is gone (this process then has another parent), end what it left."""
    # A signal to the whole group (Ctrl-C, a service manager's stop) is for vbatch, which ends its children itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while os.getppid() == parent_pid:
        time.sleep(WATCH_SECONDS)
    left = _carrying(token, spare={os.getpid()})
    if left:
        print(f"vbatch (pid {parent_pid}) is gone; ending the {len(left)} processes it left", file=sys.stderr)
    _end(left, grace)


def _carrying(token: str, *, spare: set[int]) -> list[psutil.Process]:
    """Every process of this machine started below the one that made `token` (this user's, or all for root)."""
    found = []
    for process in psutil.process_iter():
        if process.pid in spare:
            continue
        with contextlib.suppress(psutil.Error):
            if process.environ().get(LINEAGE) == token:
                found.append(process)
    return found


def _end(processes: list[psutil.Process], grace: float) -> None:
    for process in processes:
        log.warning("ending %s (pid %d), left running below vbatch", _name(process), process.pid)
        _signal(process, signal.SIGTERM)
    _, alive = psutil.wait_procs(processes, timeout=grace)
    for process in alive:
        _signal(process, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=grace)


def _signal(process: psutil.Process, number: int) -> None:
    with contextlib.suppress(psutil.Error):
        process.send_signal(number)  # psutil checks that the pid is still this process, not a reused one


def _name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.Error:
        return "a process"


if __name__ == "__main__":
    reap_after(int(sys.argv[1]), sys.argv[2])
