"""No process that vbatch starts outlives it.

vLLM runs its engine core, its GPU workers and vbatch's front ends as child processes, and they start compilers and
helpers of their own. Two ways of ending would leave them running, holding a GPU's memory so that the next start
fails: a stop while the engine is still starting (the drain stops waiting for it) and a SIGKILL of vbatch itself (an
out-of-memory killer, a Ray actor killed). So:

- `no_orphans()` wraps a whole run: when it exits, by any path Python still runs, every process below this one is
  sent SIGTERM, and SIGKILL after a grace;
- and for the paths Python does not run (SIGKILL, and uvicorn's exit on SIGTERM, which re-raises the signal), it
  starts a reaper: a small process of its own, started with `subprocess` (never forked from a process with
  threads), that waits for this process to be gone and then ends them.

Descendants are found by a lineage token in the environment they started with (`VBATCH_LINEAGE`, what
`/proc/PID/environ` shows), and by walking down from those: a process whose parent died first, or one started an
instant before a SIGKILL, is still found. Two things would hide the token, and both happened to vLLM's processes:

- a fork inherits the environment its parent *started* with, not the one it has now (`os.environ` changes reach
  exec'd children only): vLLM forks its engine core from vbatch's process on a GPU. So `start_in_lineage()`
  re-executes vbatch once, before anything else runs, with the token in its environment;
- `setproctitle` (vLLM names its processes `VLLM::EngineCore`, `VLLM::Worker`) zeroes that environment block to
  make room for a long title, unless `SPT_NOENV` is set; vbatch sets it for everything below it.
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
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import psutil

log = logging.getLogger("vbatch.orphans")

# Tokens separated by spaces, outermost first (a vbatch started below another carries both); each is `PID-HEX`, the
# pid of the process it belongs to.
LINEAGE = "VBATCH_LINEAGE"
KEEP_ENVIRONMENT = {"SPT_NOENV": "1"}
GRACE_SECONDS = 5.0
WATCH_SECONDS = 0.5
ROUNDS = 3


def start_in_lineage() -> None:
    """Make this process one that started with a lineage token of its own: unless it did, run the interpreter
    again in its place (same pid, same arguments) with one. Call it first, before any thread or child starts."""
    if _own_token() is not None or not sys.executable:
        return
    lineage = " ".join([*_tokens(os.environ), f"{os.getpid()}-{secrets.token_hex(8)}"])
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, {**os.environ, **KEEP_ENVIRONMENT, LINEAGE: lineage})
    except OSError as exc:  # no_orphans() then reaches the processes exec'd below this one only
        log.warning("could not restart with a lineage token (%s): forks of this process will not carry it", exc)


@contextmanager
def no_orphans(grace: float = GRACE_SECONDS) -> Iterator[None]:
    """Within it, every process started below this one ends when this one does, or when it leaves the block."""
    with _lineage() as token:
        reaper = _start_reaper(token)
        try:
            yield
        finally:
            _end_all_below(token, spare={reaper.pid}, grace=grace)
            reaper.kill()
            reaper.wait()


@contextmanager
def _lineage() -> Iterator[str]:
    """This process's token: the one it started with (`start_in_lineage`), else a new one that only the processes
    exec'd from now on carry (a Ray actor, which cannot be restarted in place; vLLM spawns its processes there)."""
    own = _own_token()
    if own is not None:
        yield own
        return
    saved = {name: os.environ.get(name) for name in (LINEAGE, *KEEP_ENVIRONMENT)}
    token = f"{os.getpid()}-{secrets.token_hex(8)}"
    os.environ.update({**KEEP_ENVIRONMENT, LINEAGE: " ".join([*_tokens(os.environ), token])})
    try:
        yield token
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _own_token() -> str | None:
    tokens = _tokens(os.environ)
    if tokens and tokens[-1].startswith(f"{os.getpid()}-"):
        return tokens[-1]
    return None


def _tokens(environment: dict[str, str] | os._Environ[str]) -> list[str]:
    return environment.get(LINEAGE, "").split()


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
    _end_all_below(token, spare={os.getpid()}, grace=grace, gone=parent_pid)


def _end_all_below(token: str, *, spare: set[int], grace: float, gone: int | None = None) -> None:
    """End what is below, and then what started below meanwhile (a compiler the engine's worker ran as it was
    being ended), a few rounds at most; a process that outlasts its SIGKILL (stuck in the kernel) is not waited
    for again."""
    ended: set[psutil.Process] = set()
    for _ in range(ROUNDS):
        left = [process for process in below(token, spare=spare) if process not in ended]
        if not left:
            return
        if gone is not None:
            print(f"vbatch (pid {gone}) is gone; ending the {len(left)} processes it left", file=sys.stderr)
        _end(left, grace)
        ended.update(left)


def below(token: str, *, spare: Iterable[int] = ()) -> list[psutil.Process]:
    """Every process of this machine started below the one that made `token` (this user's, or all for root): those
    whose environment carries it, what runs below those, and what runs below this process."""
    parents: dict[int, int] = {}
    processes: dict[int, psutil.Process] = {}
    roots = {os.getpid()}
    for process in psutil.process_iter(["ppid", "environ"]):
        processes[process.pid] = process
        parents[process.pid] = process.info["ppid"]
        if token in (process.info["environ"] or {}).get(LINEAGE, "").split():
            roots.add(process.pid)
    found = _descendants(roots, parents) | roots
    found -= {os.getpid(), *spare}
    return [processes[pid] for pid in sorted(found) if pid in processes]


def _descendants(roots: set[int], parents: dict[int, int]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    found: set[int] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
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
