"""One real `vbatch serve` (CPU vLLM, SmolLM2-135M-Instruct) for the whole session, driven by the openai SDK."""

from __future__ import annotations

import re
import secrets
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from openai import OpenAI

from app.engine.inference import default_model
from app.testing import VbatchServer, free_port
from tests.fixtures import postgres, s3  # noqa: F401 - fixtures (tests/e2e/test_cluster_e2e.py)
from tests.helpers import wait_for

if TYPE_CHECKING:
    from tests.e2e.test_crash_recovery import Lineage

ROOT = Path(__file__).resolve().parents[2]
MODEL = default_model.NAME
STARTUP_SECONDS = 900
# Short enough to expire a batch mid-run in a test, alongside OpenAI's 24h.
TEST_WINDOW = "20s"
# USD per GPU-hour (VBATCH_GPU_HOUR_PRICE); on the CPU build the engine counts as one device.
GPU_HOUR_PRICE = 2.0
# The shared server runs with keys, as it would on a network; two, to show tenants apart.
KEYS = (f"sk-e2e-a-{secrets.token_hex(8)}", f"sk-e2e-b-{secrets.token_hex(8)}")
# A third key, in the keys file, with a limit on its online tokens a minute.
LIMITED_KEY, LIMITED_TPM = f"sk-e2e-limited-{secrets.token_hex(8)}", 2000


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/e2e" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def model_path() -> Path:
    return default_model.prepare(ROOT / "data" / "models")


def engine_flags(model_path: Path) -> list[str]:
    # Eager mode: the same speed on these CPUs and no two-minute compile at each start. One front end (the default
    # on 2 cores); tests/e2e/test_crash_recovery.py runs the engine behind two as well.
    return ["--model", str(model_path), "--served-model-name", MODEL, "--enforce-eager", "--max-model-len", "2048"]


@pytest.fixture(scope="session")
def server(tmp_path_factory, model_path) -> Iterator[VbatchServer]:
    base = tmp_path_factory.mktemp("vbatch-e2e")
    (base / "keys").write_text(f"{LIMITED_KEY} live_tpm={LIMITED_TPM}\n")
    env = {
        "VBATCH_COMPLETION_WINDOWS": f"24h,{TEST_WINDOW}",
        "VBATCH_MAX_IN_FLIGHT": "8",
        "VBATCH_PROGRESS_LOG_SECONDS": "2",
        "VBATCH_API_KEYS": ",".join(KEYS),
        "VBATCH_API_KEYS_FILE": str(base / "keys"),
        # Inert until a test creates the hold file (tests.e2e.helpers.holding).
        "VBATCH_FAILPOINT": "hold_after:4",
        # A price, so that every batch's progress has its cost (tests/e2e/test_cost.py); it changes nothing else.
        "VBATCH_GPU_HOUR_PRICE": str(GPU_HOUR_PRICE),
    }
    running = VbatchServer(base / "data", free_port(), engine_flags(model_path), base / "serve.log", env=env)
    running.log_path = base / "serve.log"
    try:
        running.wait_ready(timeout=STARTUP_SECONDS)
        yield running
        # Every online request the session sent was counted out: once quiet, batch lines are paced no more (one
        # counted forever would pace every batch after it).
        wait_for(lambda: _paced(running) == 0.0, timeout=30)
    finally:
        running.stop()
        log = (base / "serve.log").read_text(errors="replace")
        sys.stderr.write(f"\n--- last lines of the e2e server log ---\n{log[-4000:]}\n")


def _paced(server: VbatchServer) -> float | None:
    request = urllib.request.Request(f"{server.base_url}/metrics", headers={"Authorization": f"Bearer {KEYS[0]}"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        found = re.search(r"^vbatch_batch_paced ([0-9.]+)$", answer.read().decode(), re.MULTILINE)
    return float(found.group(1)) if found else None


@pytest.fixture(scope="session")
def openai_client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.base_url}/v1", api_key=KEYS[0], max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def other_tenant(server) -> OpenAI:
    return OpenAI(base_url=f"{server.base_url}/v1", api_key=KEYS[1], max_retries=0, timeout=60)


@pytest.fixture
def lineage(tmp_path, model_path) -> Iterator[Lineage]:
    """Servers started one after another on one data directory (tests/e2e/test_crash_recovery.py and the modules of
    engine deaths), stopped at the end."""
    from tests.e2e.test_crash_recovery import Lineage  # that module imports this one

    running = Lineage(tmp_path, model_path)
    yield running
    running.stop()
