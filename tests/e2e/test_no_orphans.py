"""A stop while the real engine is still starting leaves no vLLM process behind (issue: `kill -TERM` about 35 s after
the start left `VLLM::EngineCore` and `VLLM::Worker` running as orphans), and neither does a SIGKILL of vbatch."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from app.testing import VbatchServer, free_port
from tests.e2e.conftest import engine_flags

ENGINE_SPAWN_SECONDS = 300


def _engine_processes_once_spawned(server: VbatchServer) -> list[psutil.Process]:
    """Every process below vbatch once its engine core exists, while /health still says the engine is starting."""
    deadline = time.monotonic() + ENGINE_SPAWN_SECONDS
    while time.monotonic() < deadline:
        assert server.process.poll() is None, f"vbatch exited early; see {server.log_path}"
        if server.engine_core_pids():
            below = psutil.Process(server.process.pid).children(recursive=True)
            return [p for p in below if "app.core.orphans" not in " ".join(p.cmdline())]
        time.sleep(0.2)
    raise AssertionError(f"no engine core within {ENGINE_SPAWN_SECONDS} s; see {server.log_path}")


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_stop_during_the_engine_start_leaves_no_engine_process(tmp_path, model_path, how):
    # A short drain: vbatch gives up waiting for the engine that is still starting, as in the report (30 s there).
    env = {"VBATCH_DRAIN_SECONDS": "2"}
    server = VbatchServer(tmp_path / "data", free_port(), engine_flags(model_path), tmp_path / "serve.log", env=env)
    below: list[psutil.Process] = []
    try:
        below = _engine_processes_once_spawned(server)
        assert below, "the engine core was seen, so something runs below vbatch"
        os.kill(server.process.pid, how)  # vbatch alone, not its group: as `kill PID` or an OOM killer would
        server.wait_exit(timeout=120)
        _, alive = psutil.wait_procs(below, timeout=60)
        assert alive == [], f"left running after vbatch's {how.name}: {[(p.pid, p.name()) for p in alive]}"
    finally:
        for process in below:
            if process.is_running():
                process.kill()
        server.stop()
