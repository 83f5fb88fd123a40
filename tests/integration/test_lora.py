"""LoRA adapters per line (issue 30) over the fake engine: a batch may mix the base model and its adapters, each
line running on the model it names; /v1/models lists adapters with their base model as vLLM does; an online request
may name one. The real engine runs them in tests/e2e/test_lora.py."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from app.core.config import Settings
from app.core.db import make_engine
from app.core.migrate import upgrade_to_head
from app.domain import workers
from app.domain.adapters import Adapter
from app.domain.validation import Limits, validate_file
from app.domain.workers import WorkerState
from app.engine.online.view import WorkersView
from app.engine.service import EngineService
from app.launch import announced_adapters
from app.main import Role, create_app
from app.testing import FAKE_MODEL, FakeEngine, fake_frontends
from tests.helpers import create_batch, jsonl, read_jsonl, request_line, upload, wait_for, wait_status

ADAPTERS = ["a", "b"]


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine(adapters=ADAPTERS)


@pytest.fixture
def ready(client: TestClient) -> TestClient:
    """The client once the engine serves: its own list of models, adapters included, has replaced the announced."""
    wait_for(lambda: client.get("/health").status_code == 200)
    return client


# Validation: which files may mix models, and the batch's model.

LIMITS = Limits(
    endpoint="/v1/chat/completions",
    served_models=frozenset({"base", "a", "b", "other", "c"}),
    max_requests=10,
    max_line_bytes=400,
    parents={"a": "base", "b": "base", "c": "other"},
)


def validated(tmp_path: Path, models: list[str | None]):
    """A file whose lines name these models (None: a line that names none)."""
    rows = []
    for i, model in enumerate(models):
        body = {} if model is None else {"model": model}
        rows.append({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(rows))
    return validate_file(path, LIMITS)


def test_a_file_mixing_a_base_model_and_its_adapters_is_valid_and_its_batch_is_the_base_models(tmp_path):
    report = validated(tmp_path, ["a", "base", "b", None, "a"])
    assert report.ok, report.errors
    assert report.model == "base"


def test_adapters_of_one_base_without_it_make_a_batch_of_the_base_model(tmp_path):
    assert validated(tmp_path, ["a", "b"]).model == "base"


def test_a_file_on_one_adapter_is_a_batch_of_that_adapter(tmp_path):
    report = validated(tmp_path, ["a", "a"])
    assert report.ok and report.model == "a"


def test_an_unknown_adapter_is_refused_on_its_line(tmp_path):
    report = validated(tmp_path, ["base", "a", "zz"])
    assert [(e.code, e.line, e.param) for e in report.errors] == [("model_not_found", 3, "body.model")]


def test_an_adapter_of_another_base_model_is_a_mismatch_on_its_line(tmp_path):
    report = validated(tmp_path, ["a", "base", "c"])
    assert [(e.code, e.line) for e in report.errors] == [("mismatched_model", 3)]
    assert validated(tmp_path, ["c", "other", "b"]).errors[0].line == 3


# The service over a fake engine that serves two adapters.


def test_a_mixed_batch_runs_each_line_on_the_model_it_names(client, fake_engine):
    models = [FAKE_MODEL, "a", "b", "a"]
    lines = [request_line(f"r{i}", model=model) for i, model in enumerate(models)]
    batch = create_batch(client, upload(client, jsonl(lines))["id"])
    done = wait_status(client, batch["id"], {"completed", "failed"})
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 4
    assert done["model"] == FAKE_MODEL
    answered = {
        row["custom_id"]: row["response"]["body"]["model"] for row in read_jsonl(client, done["output_file_id"])
    }
    assert answered == {f"r{i}": model for i, model in enumerate(models)}
    assert sorted(body["model"] for body in fake_engine.executor.bodies) == sorted(models)


def test_a_batch_naming_an_adapter_not_served_fails_validation_with_its_line(client):
    lines = [request_line("r0", model="a"), request_line("r1", model="nope")]
    batch = create_batch(client, upload(client, jsonl(lines))["id"])
    failed = wait_status(client, batch["id"], {"failed", "completed"})
    assert failed["status"] == "failed"
    assert [(e["code"], e["line"]) for e in failed["errors"]["data"]] == [("model_not_found", 2)]


def test_models_lists_adapters_with_their_base_model_and_base_models_as_openai_does(ready):
    client = ready
    listed = {card["id"]: card for card in client.get("/v1/models").json()["data"]}
    assert set(listed) == {FAKE_MODEL, *ADAPTERS}
    assert set(listed[FAKE_MODEL]) == {"id", "object", "created", "owned_by"}
    assert listed["a"]["parent"] == FAKE_MODEL and "root" not in listed["a"]  # no server path shown
    one = client.get("/v1/models/b").json()
    assert (one["id"], one["object"], one["parent"]) == ("b", "model", FAKE_MODEL)
    assert "parent" not in client.get(f"/v1/models/{FAKE_MODEL}").json()


def test_an_online_request_naming_an_adapter_runs_on_it(ready, fake_engine):
    client = ready
    body = {"model": "a", "messages": [{"role": "user", "content": "hi"}]}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "a"
    assert fake_engine.executor.bodies[-1]["model"] == "a"
    refused = client.post("/v1/chat/completions", json={**body, "model": "nope"})
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"


def test_the_adapters_of_lora_modules_are_announced_before_the_engine_serves():
    modules = [SimpleNamespace(name="a", path="/p/a", base_model_name=None)]
    modules.append(SimpleNamespace(name="b", path="/p/b", base_model_name="base-2"))
    modules.append(SimpleNamespace(name="c", path="/p/c", base_model_name="unknown"))
    args = argparse.Namespace(model="/m", served_model_name=["base", "base-2"], lora_modules=modules)
    assert announced_adapters(args) == [
        Adapter("a", "base", "/p/a"),
        Adapter("b", "base-2", "/p/b"),
        Adapter("c", "base", "/p/c"),
    ]
    service = EngineService(None, models=["base"], adapters=[Adapter("a", "base", "/p/a")])
    assert service.served_models == ["base", "a"]
    assert announced_adapters(argparse.Namespace(model="/m", served_model_name=None, lora_modules=None)) == []


def test_an_api_replica_lists_the_adapters_its_workers_announce(settings: Settings):
    upgrade_to_head(settings.database)
    db = make_engine(settings.database)
    adapter = Adapter("a", "base", "/p/a")
    beat = WorkerState(
        holder="w1",
        started_at=1,
        state="ok",
        served_models=["base", "a"],
        engine_config={},
        scheduler_error=None,
        engine_deaths=0,
        adapters=[adapter],
    )
    try:
        workers.beat(db=db, worker=beat)
        assert workers.seen(db=db, within_seconds=10)[0].adapters == [adapter]
        with TestClient(create_app(settings, WorkersView(), Role.API)) as api:
            listed = {card["id"]: card for card in api.get("/v1/models").json()["data"]}
    finally:
        db.dispose()
    assert "parent" not in listed["base"]
    assert listed["a"]["parent"] == "base" and "root" not in listed["a"]


def test_vllms_loaded_adapters_are_read_with_their_base_model():
    from app.engine.inference.vllm_adapter import served_adapters

    bases = [SimpleNamespace(name="base", model_path="/m")]
    first = SimpleNamespace(lora_name="a", lora_path="/p/a", base_model_name=None)
    second = SimpleNamespace(lora_name="b", lora_path="/p/b", base_model_name="base")
    models = SimpleNamespace(base_model_paths=bases, lora_requests={"a": first, "b": second})
    assert served_adapters(models) == [Adapter("a", "base", "/p/a"), Adapter("b", "base", "/p/b")]
    # older vLLM releases kept them in a list
    assert served_adapters(SimpleNamespace(base_model_paths=bases, lora_requests=[first])) == [
        Adapter("a", "base", "/p/a")
    ]
    assert served_adapters(SimpleNamespace(base_model_paths=bases, lora_requests={})) == []


def test_adapters_round_trip_through_the_workers_table_json():
    from app.domain import adapters

    listed = [Adapter("a", "base", "/p/a")]
    assert adapters.from_json(adapters.to_json(listed)) == listed
    assert json.loads(adapters.to_json([])) == []


def test_front_end_processes_tell_the_pool_the_adapters_their_engine_serves():
    async def greeted() -> tuple[list[str], list[Adapter]]:
        async with fake_frontends(2, adapters=["a"]) as pool:
            return pool.served_models, pool.adapters

    served, adapters = asyncio.run(greeted())
    assert served == [FAKE_MODEL, "a"]
    assert adapters == [Adapter("a", FAKE_MODEL, "/adapters/a")]
