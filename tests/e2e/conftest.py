"""One real `vbatch serve` (CPU vLLM, SmolLM2-135M-Instruct) for the whole session, driven by the openai SDK."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from app import default_model

ROOT = Path(__file__).resolve().parents[2]
MODEL = default_model.NAME
STARTUP_SECONDS = 900
# Short enough to expire a batch mid-run in a test, alongside OpenAI's 24h.
TEST_WINDOW = "20s"


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/e2e" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def model_path() -> Path:
    return default_model.prepare(ROOT / "data" / "models")


def engine_flags(model_path: Path) -> list[str]:
    # Eager mode: the same speed on these CPUs and no two-minute compile at each start.
    return ["--model", str(model_path), "--served-model-name", MODEL, "--enforce-eager", "--max-model-len", "2048"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    def __init__(self, data_dir: Path, model_path: Path, log_path: Path) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        env = {
            **os.environ,
            "VBATCH_COMPLETION_WINDOWS": f"24h,{TEST_WINDOW}",
            "VBATCH_MAX_IN_FLIGHT": "8",
            "VBATCH_PROGRESS_LOG_SECONDS": "2",
        }
        command = [sys.executable, "-m", "app", "serve", "--data-dir", str(data_dir), "--port", str(self.port)]
        self.log = log_path.open("wb")
        self.process = subprocess.Popen(
            command + engine_flags(model_path), env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
            start_new_session=True,
        )  # fmt: skip

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vbatch serve exited with {self.process.returncode}; see {self.log.name}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"vbatch serve was not ready in {STARTUP_SECONDS} s; see {self.log.name}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


@pytest.fixture(scope="session")
def server(tmp_path_factory, model_path) -> Iterator[Server]:
    base = tmp_path_factory.mktemp("vbatch-e2e")
    running = Server(base / "data", model_path, base / "serve.log")
    try:
        running.wait_ready()
        yield running
    finally:
        running.stop()
        log = (base / "serve.log").read_text(errors="replace")
        sys.stderr.write(f"\n--- last lines of the e2e server log ---\n{log[-4000:]}\n")


@pytest.fixture(scope="session")
def openai_client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="e2e", max_retries=0, timeout=60)
