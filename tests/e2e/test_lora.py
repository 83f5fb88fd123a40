"""LoRA adapters per line on the real engine (issue 30): `vbatch serve` with vLLM's own LoRA flags, `--max-loras 2`
and four small adapters of SmolLM2 written by the test session; through the openai SDK a batch mixing the base
model and two adapters is answered line by line by the model each line names, and so is one over all four in
random order (fed two adapters at a time); /v1/models lists the adapters with their base model, and an online
request runs on an adapter. The same server finds adapters by name in `VBATCH_LORA_DIR`: one only there answers a
batch, another an online request, and each is listed after; a too wide one fails validation on its line."""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from app.engine.inference.vllm_adapter import is_cpu_build
from app.testing import VbatchServer, free_port, write_lora_adapter
from tests.e2e.conftest import MODEL, engine_flags
from tests.e2e.helpers import chat_line, lines_of, submit, wait_terminal

STARTUP_SECONDS = 900
RANK = 8
ADAPTERS = ("a", "b", "c", "d")  # more than --max-loras (2)
FOUND = "found"  # only in VBATCH_LORA_DIR
FOUND_ONLINE = "found-online"  # only in VBATCH_LORA_DIR, and named only by an online request
TOO_WIDE = "too-wide"  # in VBATCH_LORA_DIR, of a rank above --max-lora-rank


def write_adapter(folder: Path, base_model: Path, seed: int, rank: int = RANK) -> Path:
    return write_lora_adapter(folder, base_model, seed=seed, rank=rank)


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory, model_path) -> Iterator[tuple[VbatchServer, dict[str, Path]]]:
    base = tmp_path_factory.mktemp("vbatch-lora")
    paths = {name: write_adapter(base / f"adapter-{name}", model_path, seed) for seed, name in enumerate(ADAPTERS)}
    flags = [*engine_flags(model_path), "--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "2"]
    flags += ["--lora-modules", *(f"{name}={path}" for name, path in paths.items())]
    paths[FOUND] = write_adapter(base / "lora-dir" / FOUND, model_path, seed=7)
    paths[FOUND_ONLINE] = write_adapter(base / "lora-dir" / FOUND_ONLINE, model_path, seed=9)
    write_adapter(base / "lora-dir" / TOO_WIDE, model_path, seed=8, rank=2 * RANK)
    if is_cpu_build():
        flags += ["--gpu-memory-utilization", "0.15"]
    env = {"VBATCH_MAX_IN_FLIGHT": "8", "VBATCH_PROGRESS_LOG_SECONDS": "2", "VBATCH_LORA_DIR": str(base / "lora-dir")}
    server = VbatchServer(base / "data", free_port(), flags, base / "serve.log", env=env)
    try:
        server.wait_ready(timeout=STARTUP_SECONDS)
        yield server, paths
    finally:
        server.stop()
        log = (base / "serve.log").read_text(errors="replace")
        sys.stderr.write(f"\n--- last lines of the LoRA server log ---\n{log[-4000:]}\n")


@pytest.fixture(scope="module")
def client(lora_server) -> OpenAI:
    server, _ = lora_server
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="e2e", max_retries=0, timeout=120)


def test_a_batch_mixing_the_base_model_and_two_adapters_answers_each_line_with_the_model_it_names(client):
    models = [MODEL, "a", "b", "a", MODEL, "b"]
    lines = [chat_line(f"r{i}", f"Name a colour ({i}).") for i in range(len(models))]
    for line, model in zip(lines, models, strict=True):
        line["body"]["model"] = model
    batch = wait_terminal(client, submit(client, lines).id)
    assert batch.status == "completed", batch.errors
    assert batch.model == MODEL
    assert batch.request_counts is not None and batch.request_counts.completed == len(models)
    answered = {row["custom_id"]: row["response"] for row in lines_of(client, batch.output_file_id)}
    assert {custom_id: response["status_code"] for custom_id, response in answered.items()} == {
        f"r{i}": 200 for i in range(len(models))
    }
    assert {custom_id: response["body"]["model"] for custom_id, response in answered.items()} == {
        f"r{i}": model for i, model in enumerate(models)
    }


def test_a_batch_over_more_adapters_than_max_loras_answers_each_line_with_the_adapter_it_names(client, lora_server):
    models = [*ADAPTERS * 3, MODEL, MODEL]
    random.Random(30).shuffle(models)
    lines = [chat_line(f"r{i}", f"Name a fruit ({i}).", max_tokens=4) for i in range(len(models))]
    for line, model in zip(lines, models, strict=True):
        line["body"]["model"] = model
    batch = wait_terminal(client, submit(client, lines).id)
    assert batch.status == "completed", batch.errors
    assert batch.request_counts is not None and batch.request_counts.completed == len(models)
    answered = {row["custom_id"]: row["response"] for row in lines_of(client, batch.output_file_id)}
    assert {
        custom_id: (response["status_code"], response["body"]["model"]) for custom_id, response in answered.items()
    } == {f"r{i}": (200, model) for i, model in enumerate(models)}
    # The engine said how many adapters it runs at once, and the feed kept to it.
    assert (
        f"batch {batch.id}: lines of 4 LoRA adapters, fed 2 adapters at a time" in lora_server[0].log_path.read_text()
    )


def test_models_lists_the_adapters_with_the_base_model_as_parent(client, lora_server):
    del lora_server  # it started the server; where its adapters lie is never shown
    listed = {model.id: model for model in client.models.list().data}
    assert set(listed) - {FOUND, FOUND_ONLINE} == {MODEL, *ADAPTERS}
    for name in ADAPTERS:
        card = listed[name].model_dump()
        assert card["parent"] == MODEL and "root" not in card
    assert "parent" not in listed[MODEL].model_dump()
    assert client.models.retrieve("a").model_dump()["parent"] == MODEL


def test_an_online_request_naming_an_adapter_is_answered_by_it(client):
    answer = client.chat.completions.create(model="b", messages=[{"role": "user", "content": "Say hi."}], max_tokens=8)
    assert answer.model == "b"
    assert answer.choices[0].message.content is not None


def test_an_adapter_only_in_the_lora_dir_answers_a_batch_and_is_listed_after(client, lora_server):
    del lora_server  # it started the server; where its adapters lie is never shown
    models = [FOUND, MODEL, FOUND]
    lines = [chat_line(f"f{i}", f"Name a fruit ({i}).") for i in range(len(models))]
    for line, model in zip(lines, models, strict=True):
        line["body"]["model"] = model
    batch = wait_terminal(client, submit(client, lines).id)
    assert batch.status == "completed", batch.errors
    answered = {row["custom_id"]: row["response"] for row in lines_of(client, batch.output_file_id)}
    assert {custom_id: (r["status_code"], r["body"]["model"]) for custom_id, r in answered.items()} == {
        f"f{i}": (200, model) for i, model in enumerate(models)
    }
    card = client.models.retrieve(FOUND).model_dump()
    assert card["parent"] == MODEL and "root" not in card
    assert FOUND in {model.id for model in client.models.list().data}


def test_an_adapter_of_the_lora_dir_above_the_max_lora_rank_fails_validation_on_its_line(client):
    lines = [chat_line("w0", "Hi."), chat_line("w1", "Hi.")]
    lines[1]["body"]["model"] = TOO_WIDE
    batch = wait_terminal(client, submit(client, lines).id)
    assert batch.status == "failed"
    assert batch.errors is not None and batch.errors.data is not None
    assert [(e.code, e.line) for e in batch.errors.data] == [("adapter_rank_too_large", 2)]


def test_an_adapter_only_in_the_lora_dir_answers_an_online_request_and_is_listed_after(client, lora_server):
    del lora_server  # it started the server; where its adapters lie is never shown
    assert FOUND_ONLINE not in {model.id for model in client.models.list().data}
    answer = client.chat.completions.create(
        model=FOUND_ONLINE, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8
    )
    assert answer.model == FOUND_ONLINE
    card = client.models.retrieve(FOUND_ONLINE).model_dump()
    assert card["parent"] == MODEL and "root" not in card
