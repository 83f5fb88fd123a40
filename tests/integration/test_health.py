"""/health tells the truth: about the engine, and about the database, the disk and the engine loop behind it."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from app.core.config import Settings
from app.core.db import DatabaseTaken, make_engine, write_problem
from app.domain import batches
from app.engine.online.view import WorkersView
from app.engine.service import EngineService
from app.main import Role, create_app
from app.testing import FakeEngine
from tests.helpers import create_batch, jsonl, request_line, upload, wait_for, wait_status


def test_a_loop_that_cannot_read_its_batches_says_so_and_recovers(client, monkeypatch):
    assert client.get("/health").json() == {"status": "ok", "model": "fake-model", "problems": []}
    real_active = batches.active_among  # what the loop reads of the batches it holds

    def broken(*, db, batch_ids):
        raise OSError("disk I/O error")

    monkeypatch.setattr(batches, "active_among", broken)
    source = upload(client, jsonl([request_line("a")]))
    batch = create_batch(client, source["id"])
    unavailable = wait_for(lambda: (r := client.get("/health")).status_code == 503 and r.json())
    assert unavailable["status"] == "unavailable"
    assert unavailable["problems"] == ["the engine loop cannot read its batches (OSError)"]
    monkeypatch.setattr(batches, "active_among", real_active)
    done = wait_status(client, batch["id"], {"completed"})  # the loop lived through it
    assert done["request_counts"]["completed"] == 1
    assert wait_for(lambda: client.get("/health").status_code == 200)


def test_a_nearly_full_disk_makes_the_service_unavailable(client, settings):
    settings.min_free_disk_bytes = 1 << 62
    response = client.get("/health")
    assert response.status_code == 503 and response.json()["status"] == "unavailable"
    assert "VBATCH_MIN_FREE_DISK_BYTES" in response.json()["problems"][0]


def test_a_database_that_cannot_be_written_is_reported(tmp_path):
    garbage = tmp_path / "vbatch.db"
    garbage.write_bytes(b"this is no database" * 100)
    assert "cannot be" in (write_problem(create_engine(f"sqlite:///{garbage}")) or "")
    assert write_problem(create_engine(f"sqlite:///{tmp_path / 'missing.db'}")) is not None
    assert not (tmp_path / "missing.db").exists()


def test_a_postgres_that_takes_no_writes_or_cannot_be_reached_is_reported(postgres, tmp_path):
    url = postgres.new_database()
    assert write_problem(make_engine(url)) is None
    name = make_url(url).database
    with make_engine(url).connect() as connection:
        connection.execute(text(f"ALTER DATABASE {name} SET default_transaction_read_only = on"))
        connection.commit()
    assert "takes no writes" in (write_problem(make_engine(url)) or "")
    nowhere = make_url(url).set(query={"host": str(tmp_path)}).render_as_string(hide_password=False)
    assert "cannot be reached" in (write_problem(make_engine(nowhere)) or "")


def test_probes_ready_only_when_work_can_run_and_live_unless_a_restart_is_what_helps(client, settings, fake_engine):
    assert client.get("/health/ready").status_code == 200 and client.get("/health/live").status_code == 200
    settings.min_free_disk_bytes = 1 << 62  # a full disk: not ready, but a restart would not help
    assert client.get("/health/ready").status_code == 503
    assert client.get("/health/live").status_code == 200
    settings.min_free_disk_bytes = 0
    fake_engine.fail_restarts = True  # an engine that dies and cannot be started again
    create_batch(client, upload(client, jsonl([request_line("poison", seed=1)]))["id"])
    wait_for(lambda: client.get("/health/live").status_code == 503)
    assert client.get("/health/live").json()["status"] == "down"
    assert client.get("/health/ready").status_code == 503


@pytest.mark.parametrize("backend", ["sqlite", "postgres"], indirect=True)
def test_serve_runs_alone_on_its_database_and_api_and_worker_run_together(settings, engine_service):
    """`vbatch serve` sweeps what no row refers to and expects nobody beside it; API replicas and workers share."""
    serve, api, worker = Role.SERVE, Role.API, Role.WORKER
    with TestClient(create_app(settings, engine_service)) as running:
        for role, refusal in ((serve, "runs alone"), (api, "not beside it"), (worker, "not beside it")):
            with pytest.raises(DatabaseTaken, match=refusal), TestClient(app_for(settings, role)):
                pass
        assert running.get("/health").status_code == 200
    # Stopped, it lets the others in, any number of them; then `serve` is the one refused.
    with TestClient(app_for(settings, api)), TestClient(app_for(settings, worker)) as beside:
        assert beside.get("/health").status_code == 200
        with pytest.raises(DatabaseTaken, match="runs alone"), TestClient(app_for(settings, serve)):
            pass


def app_for(settings: Settings, role: Role):
    engine = WorkersView() if role == Role.API else EngineService(FakeEngine())
    return create_app(settings, engine, role)
