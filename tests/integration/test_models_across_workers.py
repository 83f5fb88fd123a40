"""Several models across workers (issue 30): a batch's model is known from its file's first line when it is created;
a worker claims only batches for a model it serves (and those any worker can end: cancelled, or past their window);
a batch for a model no live worker serves waits, saying so in its progress and on the console, and expires with a
clear error when its window ends. On SQLite and on Postgres with an S3 store, in one process: two `vbatch worker`
apps over fake engines serving different models and a `vbatch api` app in front, as three processes would be."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import pytest
from fastapi.testclient import TestClient

from app.core import clock
from app.core.config import Settings
from app.core.db import make_engine, session_scope
from app.domain import batches, leases
from app.domain.lifecycle import BatchStatus
from app.domain.models import BatchRow
from app.engine.online.view import WorkersView
from app.engine.service import EngineService
from app.main import Role, create_app
from app.testing import FakeEngine
from tests.helpers import app_on, create_batch, jsonl, read_jsonl, request_line, upload, wait_for, wait_status
from tests.integration.test_lora_dir import write_adapter

pytestmark = pytest.mark.both_backends


@pytest.fixture
def db(settings, backend):
    with app_on(settings):  # migrated to head
        pass
    engine = make_engine(settings.database)
    yield engine
    engine.dispose()


def add_batch(db, batch_id: str, *, model: str | None, status=BatchStatus.VALIDATING, expires_in: int = 3600) -> str:
    now = clock.now()
    with session_scope(db) as session:
        session.add(
            BatchRow(
                id=batch_id,
                created_ns=time.time_ns(),
                endpoint="/v1/chat/completions",
                input_file_id="file-none",
                completion_window="24h",
                status=status,
                created_at=now,
                expires_at=now + expires_in,
                model=model,
            )
        )
        session.commit()
    return batch_id


def test_a_worker_claims_batches_for_the_models_it_serves_and_those_any_worker_ends(db):
    add_batch(db, "batch_a", model="model-a")
    add_batch(db, "batch_adapter", model="adapter-of-a")
    add_batch(db, "batch_any", model=None)  # its lines name no model: whichever engine takes it runs its default
    add_batch(db, "batch_b", model="model-b")
    add_batch(db, "batch_b_cancelling", model="model-b", status=BatchStatus.CANCELLING)
    add_batch(db, "batch_b_overdue", model="model-b", expires_in=-1)

    taken = leases.claim(db=db, holder="worker-a", seconds=30, models=["model-a", "adapter-of-a"])
    assert {lease.batch_id for lease in taken} == {
        "batch_a",
        "batch_adapter",
        "batch_any",
        "batch_b_cancelling",
        "batch_b_overdue",
    }
    [for_b] = leases.claim(db=db, holder="worker-b", seconds=30, models=["model-b"])
    assert for_b.batch_id == "batch_b"


def test_a_worker_alone_claims_every_batch(db):
    add_batch(db, "batch_a", model="model-a")
    add_batch(db, "batch_b", model="model-b")
    assert len(leases.claim(db=db, holder="serve", seconds=30)) == 2


@dataclass
class Cluster:
    api: TestClient
    workers: dict[str, EngineService]
    engines: dict[str, FakeEngine]


@contextmanager
def running_cluster(settings: Settings) -> Iterator[Cluster]:
    engines = {"model-a": FakeEngine(model="model-a", adapters=["a-lora"]), "model-b": FakeEngine(model="model-b")}
    services = {model: EngineService(engine, models=[model]) for model, engine in engines.items()}
    with ExitStack() as stack:
        for service in services.values():
            stack.enter_context(TestClient(create_app(settings, service, Role.WORKER)))
        api = stack.enter_context(TestClient(create_app(settings, WorkersView(), Role.API)))
        wait_for(lambda: {card["id"] for card in api.get("/v1/models").json()["data"]} >= {"model-a", "model-b"})
        yield Cluster(api, services, engines)


@pytest.fixture
def cluster(settings) -> Iterator[Cluster]:
    """A worker serving `model-a` (and its adapter `a-lora`), one serving `model-b`, and an API replica."""
    with running_cluster(settings) as running:
        yield running


def submit(client: TestClient, model: str, lines: int = 3, **create) -> dict:
    source = upload(client, jsonl([request_line(f"{model}-{n}", model=model) for n in range(lines)]))
    return create_batch(client, source["id"], **create)


def test_each_batch_runs_on_the_worker_that_serves_its_model(cluster, settings):
    created = {model: submit(cluster.api, model) for model in ("model-b", "model-a", "a-lora")}
    assert {model: batch["model"] for model, batch in created.items()} == {m: m for m in created}  # from creation
    for batch in created.values():
        assert wait_status(cluster.api, batch["id"], {"completed", "failed"})["status"] == "completed"

    db = make_engine(settings.database)
    try:
        ran_on = {model: batches.get(db=db, batch_id=b["id"], owner=None).lease_holder for model, b in created.items()}
    finally:
        db.dispose()
    holder = {model: service.holder for model, service in cluster.workers.items()}
    assert ran_on == {"model-b": holder["model-b"], "model-a": holder["model-a"], "a-lora": holder["model-a"]}
    asked = {model: {body["model"] for body in engine.executor.bodies} for model, engine in cluster.engines.items()}
    assert asked == {"model-a": {"model-a", "a-lora"}, "model-b": {"model-b"}}
    for model, batch in created.items():
        done = cluster.api.get(f"/v1/batches/{batch['id']}").json()
        answers = read_jsonl(cluster.api, done["output_file_id"])
        assert [line["response"]["body"]["model"] for line in answers] == [model] * 3


def test_a_batch_for_a_model_no_worker_serves_waits_saying_so_then_expires_with_a_clear_error(cluster):
    batch = submit(cluster.api, "model-c", completion_window="2s")
    assert batch["model"] == "model-c"
    progress = cluster.api.get(f"/v1/batches/{batch['id']}/progress").json()
    assert progress["status"] == "validating"
    assert progress["waiting"] == "waiting for a worker that serves 'model-c'"
    assert (
        "waiting for a worker that serves &#39;model-c&#39;"
        in cluster.api.get(f"/console/batches/{batch['id']}/panel").text
    )

    ended = wait_status(cluster.api, batch["id"], {"expired", "failed", "completed"}, timeout=30)
    assert ended["status"] == "expired"
    [error] = ended["errors"]["data"]
    assert error["code"] == "model_not_served" and "'model-c'" in error["message"]
    assert (ended["output_file_id"], ended["error_file_id"]) == (None, None)
    assert all(engine.executor.bodies == [] for engine in cluster.engines.values())


def test_a_waiting_batch_cancelled_ends_at_once(cluster):
    batch = submit(cluster.api, "model-c")
    assert cluster.api.post(f"/v1/batches/{batch['id']}/cancel").json()["status"] == "cancelling"
    assert wait_status(cluster.api, batch["id"], {"cancelled", "expired", "failed"})["status"] == "cancelled"


def test_the_api_lists_every_model_and_adapter_the_live_workers_serve(cluster):
    cards = {card["id"]: card for card in cluster.api.get("/v1/models").json()["data"]}
    assert set(cards) == {"model-a", "a-lora", "model-b"}
    assert cards["a-lora"]["parent"] == "model-a" and "root" not in cards["a-lora"]
    assert "parent" not in cards["model-b"]
    assert cluster.api.get("/v1/models/model-b").status_code == 200


def test_a_batch_for_an_adapter_of_the_lora_dir_is_claimed_by_the_worker_of_its_base_before_any_announces_it(
    settings, tmp_path
):
    lora_dir = tmp_path / "lora-dir"
    write_adapter(lora_dir / "found-a", base="/models/model-a")
    with running_cluster(settings.model_copy(update={"lora_dir": str(lora_dir)})) as cluster:
        assert "found-a" not in {card["id"] for card in cluster.api.get("/v1/models").json()["data"]}
        batch = submit(cluster.api, "found-a")
        assert batch["model"] == "found-a"
        done = wait_status(cluster.api, batch["id"], {"completed", "failed", "expired"})
        assert done["status"] == "completed", done["errors"]
        asked = {model: [body["model"] for body in engine.executor.bodies] for model, engine in cluster.engines.items()}
        assert asked == {"model-a": ["found-a"] * 3, "model-b": []}
        # listed once the worker's next beat announces it
        wait_for(lambda: cluster.api.get("/v1/models/found-a").status_code == 200)
        card = cluster.api.get("/v1/models/found-a").json()
        assert card["parent"] == "model-a" and "root" not in card
