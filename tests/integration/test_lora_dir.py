"""Adapters found by name at first use (issue 30, `VBATCH_LORA_DIR`): folders written by the test in PEFT's layout,
in a local folder or under an s3:// prefix of the session's S3 server. A line naming one is checked at validation
(not an adapter, another base model, a rank above --max-lora-rank: errors with their line numbers), a good one runs
and is listed in /v1/models after; the serving layer loads it once, at its first request. The real engine runs one
in tests/e2e/test_lora_dir.py."""

from __future__ import annotations

import asyncio
import functools
import json
import pickle
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel
from safetensors.numpy import save_file
from starlette.datastructures import State

from app.core.config import Settings
from app.core.lora_dir import LoraDir, lora_dir
from app.domain.adapters import Adapter, AdapterFinder, AdapterProblem
from app.domain.validation import Limits, validate_file
from app.engine.inference.found_adapters import RECHECK_SECONDS, ClaimableAdapters
from app.engine.scheduling.holder import LeaseHolder
from app.engine.service import EngineService
from app.main import create_app
from app.testing import FAKE_MODEL, FakeEngine
from tests.helpers import create_batch, jsonl, read_jsonl, request_line, upload, wait_for, wait_status

MAX_RANK = 16


def write_adapter(folder: Path, *, rank: int = 8, base: str = f"/models/{FAKE_MODEL}", config: bool = True) -> Path:
    """PEFT's layout: adapter_config.json and the weights (small: nothing here runs them)."""
    folder.mkdir(parents=True)
    if config:
        fields = {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
        (folder / "adapter_config.json").write_text(json.dumps({**fields, "base_model_name_or_path": base}))
    weights = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((rank, 4), np.float32)}
    save_file(weights, str(folder / "adapter_model.safetensors"))
    return folder


@pytest.fixture
def adapters(tmp_path: Path) -> Path:
    root = tmp_path / "adapters"
    write_adapter(root / "tuned")
    write_adapter(root / "tuned-by-hub-id", base=f"HuggingFaceTB/{FAKE_MODEL}")
    write_adapter(root / "weights-only", config=False)
    write_adapter(root / "of-another-base", base="Qwen/Qwen3-8B")
    write_adapter(root / "too-wide", rank=MAX_RANK * 2)
    (root / "not-a-folder").write_text("{}")
    return root


@pytest.fixture
def settings(settings: Settings, adapters: Path) -> Settings:
    return settings.model_copy(update={"lora_dir": str(adapters)})


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine(max_lora_rank=MAX_RANK)


def lines_naming(models: list[str]) -> bytes:
    return jsonl([request_line(f"r{i}", model=model) for i, model in enumerate(models)])


def test_each_bad_adapter_fails_validation_on_its_line_and_the_batch_fails_cleanly(client: TestClient):
    models = [FAKE_MODEL, "tuned", "weights-only", "of-another-base", "too-wide", "nowhere", "not-a-folder", "tuned"]
    batch = create_batch(client, upload(client, lines_naming(models))["id"])
    failed = wait_status(client, batch["id"], {"failed", "completed"})
    assert failed["status"] == "failed"
    assert [(e["code"], e["line"], e["param"]) for e in failed["errors"]["data"]] == [
        ("invalid_adapter", 3, "body.model"),
        ("adapter_base_mismatch", 4, "body.model"),
        ("adapter_rank_too_large", 5, "body.model"),
        ("model_not_found", 6, "body.model"),
        ("model_not_found", 7, "body.model"),
    ]
    messages = [e["message"] for e in failed["errors"]["data"]]
    assert (
        "not a LoRA adapter" in messages[0] and "Qwen/Qwen3-8B" in messages[1] and "--max-lora-rank 16" in messages[2]
    )


def test_a_good_adapter_runs_its_lines_and_is_listed_with_its_base_model_after(
    client: TestClient, adapters: Path, engine_service: EngineService
):
    wait_for(lambda: client.get("/health").status_code == 200)
    assert "tuned" not in {card["id"] for card in client.get("/v1/models").json()["data"]}
    models = [FAKE_MODEL, "tuned", "tuned-by-hub-id", "tuned"]
    batch = create_batch(client, upload(client, lines_naming(models))["id"])
    done = wait_status(client, batch["id"], {"failed", "completed"})
    assert done["status"] == "completed", done["errors"]
    assert done["model"] == FAKE_MODEL
    answered = {
        row["custom_id"]: row["response"]["body"]["model"] for row in read_jsonl(client, done["output_file_id"])
    }
    assert answered == {f"r{i}": model for i, model in enumerate(models)}
    listed = {card["id"]: card for card in client.get("/v1/models").json()["data"]}
    assert listed["tuned"]["parent"] == FAKE_MODEL and "root" not in listed["tuned"]
    assert client.get("/v1/models/tuned-by-hub-id").json()["parent"] == FAKE_MODEL
    # the worker announces them as it does --lora-modules adapters
    assert {a.name for a in engine_service.worker_state().adapters} == {"tuned", "tuned-by-hub-id"}


def test_an_online_request_may_name_an_adapter_no_batch_used_is_listed_after_and_an_unknown_name_is_404(
    client: TestClient, fake_engine: FakeEngine
):
    wait_for(lambda: client.get("/health").status_code == 200)
    body = {"model": "tuned", "messages": [{"role": "user", "content": "hi"}]}
    answered = client.post("/v1/chat/completions", json=body)
    assert answered.status_code == 200, answered.text
    assert answered.json()["model"] == "tuned" == fake_engine.executor.bodies[-1]["model"]
    # listed from now on, as `vllm serve` lists an adapter its resolver loaded, and announced by the worker
    assert client.get("/v1/models/tuned").json()["parent"] == FAKE_MODEL
    assert "tuned" in {card["id"] for card in client.get("/v1/models").json()["data"]}
    assert "tuned-by-hub-id" not in {card["id"] for card in client.get("/v1/models").json()["data"]}
    for unknown in ("nowhere", "../adapters/tuned", "not-a-folder"):
        refused = client.post("/v1/chat/completions", json={**body, "model": unknown})
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found", unknown


def test_an_adapter_named_online_as_soon_as_the_engine_is_up_is_listed_before_batches_are_looked_for(
    settings: Settings, fake_engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
):
    """The engine is up (`/health` ok) a moment before the batch loop starts: held here until the request is done."""
    held = threading.Event()

    async def hold_first_look(self: object, db: object) -> None:
        await asyncio.to_thread(held.wait)

    monkeypatch.setattr(LeaseHolder, "release_dead", hold_first_look)
    service = EngineService(fake_engine)
    try:
        with TestClient(create_app(settings, service)) as client:
            wait_for(lambda: client.get("/health").status_code == 200)
            body = {"model": "tuned", "messages": [{"role": "user", "content": "hi"}]}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            assert client.get("/v1/models/tuned").json()["parent"] == FAKE_MODEL
            held.set()
    finally:
        held.set()


# The finder's checks, alone.


def finder(root: Path, **fields: Any) -> AdapterFinder:
    source = LoraDir(url=str(root), cache=root / "unused")
    return AdapterFinder(folder_of=source.folder, base=FAKE_MODEL, **fields)


def test_a_worker_claims_for_the_adapters_of_its_base_and_looks_again_at_other_names_only_later(adapters: Path):
    looked: list[str] = []
    found = finder(adapters, max_rank=MAX_RANK)

    def counting(name: str) -> Adapter | AdapterProblem | None:
        looked.append(name)
        if name == "flaky":
            raise OSError("the object store did not answer")
        return found(name)

    now = [0.0]
    claimable = ClaimableAdapters(lambda: counting, clock=lambda: now[0])  # type: ignore[arg-type]
    names = ["tuned", "of-another-base", "too-wide", "nowhere", "flaky"]
    assert claimable.among(names) == ["tuned"]
    assert claimable.among(names) == ["tuned"]
    assert sorted(looked) == sorted(names)  # each looked up once: found stays found, the rest wait
    now[0] += RECHECK_SECONDS + 1
    write_adapter(adapters / "nowhere")  # added since
    assert claimable.among(names) == ["tuned", "nowhere"]
    assert sorted(looked) == sorted(names + names[1:])
    assert claimable.looks_up
    no_engine_yet = ClaimableAdapters(lambda: None)
    assert not no_engine_yet.looks_up and no_engine_yet.among(names) == []


def test_the_base_model_matches_by_served_name_path_or_final_component(adapters: Path):
    find = finder(adapters, base_path="/elsewhere/checkpoint", max_rank=MAX_RANK)
    assert find("tuned") == Adapter("tuned", FAKE_MODEL, str(adapters / "tuned"))
    assert isinstance(find("tuned-by-hub-id"), Adapter)
    write_adapter(adapters / "by-path", base="/elsewhere/checkpoint")
    write_adapter(adapters / "by-name", base=FAKE_MODEL)
    write_adapter(adapters / "no-base-named", base="")
    assert all(isinstance(find(name), Adapter) for name in ("by-path", "by-name", "no-base-named"))
    mismatch = find("of-another-base")
    assert isinstance(mismatch, AdapterProblem) and mismatch.code == "adapter_base_mismatch"


def test_an_unknown_rank_is_left_to_the_engine_and_lora_off_refuses_every_adapter(adapters: Path):
    assert isinstance(finder(adapters, max_rank=None)("too-wide"), Adapter)
    off = finder(adapters, lora_enabled=False)("tuned")
    assert isinstance(off, AdapterProblem) and off.code == "lora_not_enabled" and "--enable-lora" in off.message
    assert finder(adapters, lora_enabled=False)("nowhere") is None


def test_names_never_climb_out_of_the_folder(adapters: Path, tmp_path: Path):
    write_adapter(tmp_path / "outside")
    source = LoraDir(url=str(adapters), cache=tmp_path / "cache")
    for name in ("../outside", "..", ".", "", "a/b", "x" * 300, "tuned\0"):
        assert source.folder(name) is None and not source.has(name), name
    assert source.has("tuned") and not source.has("not-a-folder")


def test_validation_asks_the_finder_once_a_name(adapters: Path, tmp_path: Path):
    asked: list[str] = []
    find = finder(adapters, max_rank=MAX_RANK)

    def counted(name: str):
        asked.append(name)
        return find(name)

    path = tmp_path / "in.jsonl"
    path.write_bytes(lines_naming(["tuned"] * 5 + ["nowhere"] * 3 + ["too-wide"] * 2))
    limits = Limits("/v1/chat/completions", frozenset({FAKE_MODEL}), 100, 10_000, find_adapter=counted)
    report = validate_file(path, limits)
    assert sorted(asked) == ["nowhere", "too-wide", "tuned"]
    assert [(e.code, e.line) for e in report.errors] == [("model_not_found", n) for n in (6, 7, 8)] + [
        ("adapter_rank_too_large", 9),
        ("adapter_rank_too_large", 10),
    ]
    assert report.found_adapters == [Adapter("tuned", FAKE_MODEL, str(adapters / "tuned"))]


def test_one_adapter_alone_makes_a_batch_of_that_adapter_and_with_the_base_a_batch_of_the_base(
    adapters: Path, tmp_path: Path
):
    limits = Limits("/v1/chat/completions", frozenset({FAKE_MODEL}), 100, 10_000, find_adapter=finder(adapters))
    path = tmp_path / "in.jsonl"
    path.write_bytes(lines_naming(["tuned", "tuned"]))
    assert validate_file(path, limits).model == "tuned"
    path.write_bytes(lines_naming(["tuned", FAKE_MODEL, "tuned-by-hub-id"]))
    report = validate_file(path, limits)
    assert report.ok and report.model == FAKE_MODEL
    # The index knows each line's adapter, found ones too: the feed gates them by --max-loras as served ones.
    index = report.index
    assert [index.adapter_names[n] for n in index.adapter_numbers] == ["tuned", "", "tuned-by-hub-id"]


# An s3:// prefix: each adapter copied once to the cache, at its first use.


def test_an_adapter_under_an_s3_prefix_is_copied_to_the_cache_once(s3, adapters: Path, tmp_path: Path):
    import obstore
    from obstore.store import from_url

    url = s3.new_url()
    store = from_url(url)
    for name in ("tuned", "too-wide"):
        for file in (adapters / name).iterdir():
            obstore.put(store, f"{name}/{file.name}", file.read_bytes())
    settings = Settings(data_dir=tmp_path / "data", lora_dir=url + "/")
    source = lora_dir(settings)
    assert source is not None and source.remote
    assert source.has("tuned") and not source.has("nowhere") and source.folder("nowhere") is None
    cached = source.folder("tuned")
    assert cached == settings.lora_cache_dir / "tuned"
    assert sorted(p.name for p in cached.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert (cached / "adapter_model.safetensors").read_bytes() == (
        adapters / "tuned/adapter_model.safetensors"
    ).read_bytes()
    # Gone from the store, it is still served from the cache: it was copied once, not at every use.
    obstore.delete(store, ["tuned/adapter_config.json", "tuned/adapter_model.safetensors"])
    assert source.folder("tuned") == cached and source.has("tuned")
    assert [p.name for p in settings.lora_cache_dir.iterdir()] == ["tuned"]  # no partial copy left beside it
    found = AdapterFinder(folder_of=source.folder, base=FAKE_MODEL, max_rank=MAX_RANK)("too-wide")
    assert isinstance(found, AdapterProblem) and found.code == "adapter_rank_too_large"


def _s3_adapters(s3, folder: Path, names: tuple[str, ...]) -> str:
    """A new s3:// prefix holding a copy of the adapter in `folder` under each of `names`."""
    import obstore
    from obstore.store import from_url

    url = s3.new_url()
    store = from_url(url)
    for name in names:
        for file in folder.iterdir():
            obstore.put(store, f"{name}/{file.name}", file.read_bytes())
    return url


def _put_raw(s3, url: str, key: str) -> None:
    """An object under `key` exactly as written: S3 takes `..` and empty segments in a key, obstore writes neither."""
    import boto3

    environ = s3.environ
    client = boto3.client(
        "s3",
        endpoint_url=environ["AWS_ENDPOINT_URL"],
        aws_access_key_id=environ["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=environ["AWS_SECRET_ACCESS_KEY"],
        region_name=environ["AWS_REGION"],
    )
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=b"{}")


HOSTILE_KEYS = {
    "climbs": "climbs/../../escaped/adapter_config.json",
    "ends-in-dots": "ends-in-dots/..",
    "rooted": "rooted//tmp/escaped-rooted.json",
    "dotted": "dotted/./adapter_config.json",
}


def test_an_s3_adapter_with_a_key_no_local_folder_can_hold_is_no_such_model(
    s3, adapters: Path, tmp_path: Path, fake_engine: FakeEngine
):
    """Keys with `..`, `.` or empty segments are legal in S3; copied as they are, one would be written outside the
    cache (`partial / "/tmp/x"` is /tmp/x). Such an adapter is no adapter: an online request naming it is a 404
    model_not_found (it was a 500), a batch line an error on its line (the batch failed with a file_not_found about
    its input), and nothing is written anywhere on the local disk; the good adapter beside them still runs."""
    url = _s3_adapters(s3, adapters / "tuned", ("tuned", *HOSTILE_KEYS))
    for key in HOSTILE_KEYS.values():
        _put_raw(s3, url, key)
    settings = Settings(data_dir=tmp_path / "data", lora_dir=url, checkpoint_seconds=0.05, disk_reserve_bytes=65536)
    with TestClient(create_app(settings, EngineService(fake_engine))) as client:
        wait_for(lambda: client.get("/health").status_code == 200)
        body = {"messages": [{"role": "user", "content": "hi"}]}
        for name in HOSTILE_KEYS:
            refused = client.post("/v1/chat/completions", json={**body, "model": name})
            assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found", refused.text
        assert client.post("/v1/chat/completions", json={**body, "model": "tuned"}).status_code == 200
        batch = create_batch(client, upload(client, lines_naming([FAKE_MODEL, "climbs", "rooted"]))["id"])
        failed = wait_status(client, batch["id"], {"failed", "completed"})
    assert [(e["code"], e["line"]) for e in failed["errors"]["data"]] == [
        ("model_not_found", 2),
        ("model_not_found", 3),
    ]
    assert not (tmp_path / "data" / "escaped").exists() and not Path("/tmp/escaped-rooted.json").exists()
    assert [p.name for p in settings.lora_cache_dir.iterdir()] == ["tuned"]  # no partial copy left either
    source = lora_dir(settings)
    assert source is not None
    for name in HOSTILE_KEYS:
        assert source.folder(name) is None and not source.has(name), name


# The serving layer over vLLM's objects: an adapter loaded once, at its first request, in each process that has one.


class _Body(BaseModel):
    model: str


class _Chat:
    def __init__(self) -> None:
        self.models: list[str] = []

    async def create_chat_completion(self, request: _Body, raw_request: Any) -> _Body:
        self.models.append(request.model)
        return request


class _Models:
    """vLLM's `OpenAIServingModels` as the serving layer uses it."""

    def __init__(self) -> None:
        self.base_model_paths = [SimpleNamespace(name=FAKE_MODEL, model_path=f"/models/{FAKE_MODEL}")]
        self.lora_requests: dict[str, Any] = {}
        self.loads: list[tuple[str, str, str | None]] = []

    def is_base_model(self, name: str) -> bool:
        return name == FAKE_MODEL

    async def load_lora_adapter(self, request: Any, base_model_name: str | None = None) -> str:
        await asyncio.sleep(0)  # others wait on the layer's lock meanwhile
        self.loads.append((request.lora_name, request.lora_path, base_model_name))
        self.lora_requests[request.lora_name] = SimpleNamespace(
            lora_name=request.lora_name, lora_path=request.lora_path, base_model_name=base_model_name
        )
        return "Success"


def _layer(adapters: Path) -> Any:
    from app.engine.inference.vllm_adapter import ServingLayer

    state = State()
    state.openai_serving_models = _Models()
    state.openai_serving_chat = _Chat()
    config = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=2048, model=f"/models/{FAKE_MODEL}", dtype="bfloat16"),
        scheduler_config=SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=2048, policy="priority"),
        cache_config=SimpleNamespace(enable_prefix_caching=True),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_size=1),
        lora_config=SimpleNamespace(max_lora_rank=MAX_RANK, max_loras=4),
    )
    engine_client = SimpleNamespace(vllm_config=config)
    return ServingLayer(engine_client, state, LoraDir(url=str(adapters), cache=adapters / "cache")), state


def test_the_serving_layer_loads_a_found_adapter_once_at_its_first_requests(adapters: Path):
    layer, state = _layer(adapters)

    async def run() -> list:
        body = {"model": "tuned"}
        return await asyncio.gather(*(layer.execute("/v1/chat/completions", body) for _ in range(5)))

    answers = asyncio.run(run())
    assert answers == [(200, {"model": "tuned"})] * 5
    assert state.openai_serving_models.loads == [("tuned", str(adapters / "tuned"), FAKE_MODEL)]
    assert layer.adapters == [Adapter("tuned", FAKE_MODEL, str(adapters / "tuned"))]
    assert "tuned" in layer.served_models


def test_the_serving_layer_answers_a_bad_adapter_with_a_400_and_leaves_unknown_names_to_vllm(adapters: Path):
    layer, state = _layer(adapters)
    status, body = asyncio.run(layer.execute("/v1/chat/completions", {"model": "too-wide"}))
    assert status == 400 and "--max-lora-rank" in body["error"]["message"]
    assert asyncio.run(layer.execute("/v1/chat/completions", {"model": "nowhere"})) == (200, {"model": "nowhere"})
    assert state.openai_serving_models.loads == []


def test_front_end_processes_get_the_lora_dir_with_their_target():
    from app.engine.inference.vllm_adapter import _frontend_main

    source = LoraDir(url="s3://bucket/adapters", cache=Path("/data/lora-cache"))
    target = pickle.loads(pickle.dumps(functools.partial(_frontend_main, lora_dir=source)))
    assert target.keywords == {"lora_dir": source}
