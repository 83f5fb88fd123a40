"""Cost after running (issue 31): the engine's busy time, shared by tokens between batches and online requests,
kept per batch at each checkpoint, shown on its progress, in the console and on /metrics, and priced with
VBATCH_GPU_HOUR_PRICE; the batch object keeps OpenAI's shape."""

from __future__ import annotations

from time import sleep

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError
from sqlmodel import Session

from app.core.config import Settings
from app.core.db import make_engine
from app.domain.cost import apportion, spend, weighed_tokens, weights
from app.domain.models import BatchRow
from app.domain.schemas import Batch
from app.engine.telemetry.metrics import BATCH, LIVE, EngineTime, Payer
from app.testing import FakeEngine
from tests.helpers import app_on, create_batch, held_batch, jsonl, request_line, upload, wait_for, wait_status


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def batch_payer(batch_id: str, key: str = "alice") -> Payer:
    return Payer(BATCH, key, "m", batch_id)


def test_an_answers_tokens_are_its_uncached_prompt_and_its_output():
    usage = {"prompt_tokens": 50, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 40}}
    assert weighed_tokens(usage) == 10 + 7
    assert weighed_tokens({"input_tokens": 9, "output_tokens": 3, "input_tokens_details": {"cached_tokens": 0}}) == 12
    assert weighed_tokens({"prompt_tokens": 4, "total_tokens": 4}) == 4  # an embedding
    assert weighed_tokens({}) == 0


def test_busy_time_times_the_gpus_is_shared_by_tokens_between_two_batches_and_online_requests():
    clock = Clock()
    time = EngineTime(clock)
    time.devices = 2
    for _ in range(3):
        time.started()
    clock.now += 4.0
    for _ in range(3):
        time.ended()
    time.used(batch_payer("batch_a"), 300)
    time.used(batch_payer("batch_b", key="bob"), 100)
    time.used(Payer(LIVE, "carol", "m"), 100)
    # 4 s busy on 2 GPUs: 8 GPU-seconds, split 3:1:1.
    assert time.take("batch_a") == pytest.approx(4.8)
    assert time.take("batch_b") == pytest.approx(1.6)
    assert time.take("batch_a") == 0.0  # taken once
    assert time.totals() == pytest.approx(
        {(BATCH, "alice", "m"): 4.8, (BATCH, "bob", "m"): 1.6, (LIVE, "carol", "m"): 1.6}
    )
    assert apportion(8.0, {"a": 0, "b": 0}) == {}


def test_an_idle_engines_time_is_charged_to_nobody():
    clock = Clock()
    time = EngineTime(clock)
    time.started()
    clock.now += 1.0
    time.ended()
    clock.now += 10.0  # idle
    time.started()
    clock.now += 2.0
    time.ended()
    clock.now += 30.0  # idle again before anyone reads
    time.used(batch_payer("batch_a"), 5)
    assert time.take("batch_a") == pytest.approx(3.0)
    clock.now += 60.0
    assert time.take("batch_a") == 0.0
    assert time.totals() == pytest.approx({(BATCH, "alice", "m"): 3.0})


def test_time_in_flight_waits_for_the_tokens_that_pay_it():
    clock = Clock()
    time = EngineTime(clock)
    time.started()
    clock.now += 5.0
    assert time.take("batch_a") == 0.0  # a long request has finished nothing yet: its time is nobody's yet
    clock.now += 5.0
    time.ended()
    time.used(batch_payer("batch_a"), 1)
    assert time.take("batch_a") == pytest.approx(10.0)


def test_requests_that_left_unanswered_weigh_their_seconds_at_the_answered_rate():
    a, b = batch_payer("batch_a"), batch_payer("batch_b", key="bob")
    # 300 tokens in 3 request-seconds answered: 100 a second; b's aborted lines were in flight 2 s: 200.
    assert weights({a: 300}, 3.0, {b: 2.0}) == {a: 300.0, b: 200.0}
    assert apportion(10.0, weights({a: 300}, 3.0, {b: 2.0})) == pytest.approx({a: 6.0, b: 4.0})
    assert weights({}, 0.0, {b: 2.0, a: 6.0}) == {b: 2.0, a: 6.0}  # nothing answered: by seconds alone
    assert weights({a: 300}, 0.0, {b: 2.0}) == {a: 300.0}  # no rate to weigh them by
    assert weights({a: 0}, 0.0, {}) == {}


def test_a_cancelled_batchs_aborted_lines_pay_for_their_time_not_the_next_batch():
    clock = Clock()
    time = EngineTime(clock)
    for _ in range(4):  # batch_a's lines: in flight 16 s, then aborted by its cancel
        time.started()
    clock.now += 16.0
    for _ in range(4):
        time.ended()
        time.timed(batch_payer("batch_a"), 16.0, answered=False)
    time.started()  # batch_b's one line, answered at once
    clock.now += 0.01
    time.ended()
    time.timed(batch_payer("batch_b"), 0.01, answered=True)
    time.used(batch_payer("batch_b"), 1)
    # b's line made 1 token in 0.01 s: 100 a second; a's 64 request-seconds weigh 6,400 tokens against b's 1.
    assert time.take("batch_b") == pytest.approx(16.01 * 1 / (1 + 6400), rel=1e-6)
    assert time.take("batch_a") == pytest.approx(16.01, rel=1e-3)


def test_a_price_gives_the_cost_and_the_cost_per_million_input_and_output_tokens():
    priced = spend(7200.0, input_tokens=1_000_000, output_tokens=500_000, price=2.5)
    assert (priced.gpu_seconds, priced.cost_usd) == (7200.0, 5.0)
    assert (priced.cost_per_million_input_tokens, priced.cost_per_million_output_tokens) == (5.0, 10.0)
    unpriced = spend(7200.0, input_tokens=1_000_000, output_tokens=500_000, price=None)
    assert (unpriced.gpu_seconds, unpriced.cost_usd, unpriced.cost_per_million_input_tokens) == (7200.0, None, None)
    no_output = spend(36.0, input_tokens=10, output_tokens=0, price=1.0)
    assert (no_output.cost_usd, no_output.cost_per_million_output_tokens) == (0.01, None)
    assert spend(None, input_tokens=0, output_tokens=0, price=1.0).cost_usd is None


def test_a_price_is_a_number_zero_or_more(monkeypatch):
    monkeypatch.setenv("VBATCH_GPU_HOUR_PRICE", "2.75")
    assert Settings().gpu_hour_price == 2.75
    for bad in ("-1", "inf", "nan", "two"):
        monkeypatch.setenv("VBATCH_GPU_HOUR_PRICE", bad)
        with pytest.raises(ValidationError):
            Settings()


def scrape(client) -> dict[tuple[str, tuple], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(client.get("/metrics").text)
        for sample in family.samples
    }


def slow_engine(seconds: float = 0.02) -> FakeEngine:
    engine = FakeEngine()
    engine.executor.seconds_per_answer = seconds
    return engine


@pytest.mark.both_backends
def test_a_finished_batch_shows_its_gpu_seconds_and_cost_on_progress_console_and_metrics(settings):
    settings.gpu_hour_price = 3.6
    with app_on(settings, slow_engine(0.2)) as client:
        source = upload(client, jsonl([request_line(f"r{i}") for i in range(6)]))
        created = create_batch(client, source["id"])
        before = client.get(f"/v1/batches/{created['id']}/progress").json()
        done = wait_status(client, created["id"], {"completed"})
        progress = client.get(f"/v1/batches/{created['id']}/progress").json()
        metrics = scrape(client)
        page = client.get(f"/console/batches/{created['id']}").text
        listing = client.get("/console/batches").text

    if before["status"] == "validating":
        assert before["gpu_seconds"] is None
    used = progress["gpu_seconds"]
    assert used > 0
    assert progress["gpu_hour_price"] == 3.6
    assert progress["cost_usd"] == pytest.approx(used / 3600 * 3.6, abs=2e-6)
    # The figures are rounded (GPU-seconds to the millisecond): compared at a precision that allows for it.
    for kind in ("input", "output"):
        per_million = used / 3600 * 3.6 * 1e6 / done["usage"][f"{kind}_tokens"]
        assert progress[f"cost_per_million_{kind}_tokens"] == pytest.approx(per_million, rel=1e-2)
    labels = (("key", "anonymous"), ("model", "fake-model"))
    assert metrics[("vbatch_batch_gpu_seconds_total", labels)] == pytest.approx(used, abs=1e-3)
    assert metrics[("vbatch_batch_cost_usd_total", labels)] == pytest.approx(progress["cost_usd"], abs=1e-5)
    assert 'id="batch-gpu-seconds"' in page and "GPU-s" in page and 'id="batch-cost"' in page
    assert "GPU time, cost" in listing and "$" in listing
    # Cost lives only in vbatch's extensions: the batch object is OpenAI's.
    assert set(done) == set(Batch.model_fields) and not {key for key in done if "gpu" in key or "cost" in key}


def test_without_a_price_there_are_gpu_seconds_and_no_cost(settings):
    with app_on(settings, slow_engine()) as client:
        created = create_batch(client, upload(client, jsonl([request_line("r0"), request_line("r1")]))["id"])
        wait_status(client, created["id"], {"completed"})
        progress = client.get(f"/v1/batches/{created['id']}/progress").json()
        names = {name for name, _ in scrape(client)}
        listing = client.get("/console/batches").text
    assert progress["gpu_seconds"] > 0
    assert progress["gpu_hour_price"] is None and progress["cost_usd"] is None
    assert progress["cost_per_million_input_tokens"] is None and progress["cost_per_million_output_tokens"] is None
    assert "vbatch_batch_gpu_seconds_total" in names and "vbatch_batch_cost_usd_total" not in names
    assert "GPU-s" in listing and "GPU time, cost" not in listing


def test_online_requests_share_is_counted_by_key_and_model(settings):
    settings.gpu_hour_price = 1.0
    with app_on(settings, slow_engine()) as client:
        for _ in range(3):
            answer = client.post("/v1/chat/completions", json=request_line("x")["body"])
            assert answer.status_code == 200
        streamed = client.post(
            "/v1/chat/completions",
            json={**request_line("y")["body"], "stream": True, "stream_options": {"include_usage": True}},
        )
        assert streamed.status_code == 200 and "[DONE]" in streamed.text
        metrics = scrape(client)
    labels = (("key", "anonymous"), ("model", "fake-model"))
    assert metrics[("vbatch_live_gpu_seconds_total", labels)] > 0
    assert metrics[("vbatch_live_cost_usd_total", labels)] == pytest.approx(
        metrics[("vbatch_live_gpu_seconds_total", labels)] / 3600
    )


def test_a_cancelled_batch_pays_for_the_time_of_its_aborted_lines_and_the_next_batch_does_not(settings):
    engine = FakeEngine()
    engine.executor.answer_first = 0  # the first batch's lines wait in the engine until its cancel aborts them
    with app_on(settings, engine) as client:
        cancelled = create_batch(client, upload(client, jsonl([request_line(f"a{i}") for i in range(3)]))["id"])
        wait_for(lambda: engine.executor.calls >= 3)
        sleep(0.5)  # not a wait for anything: the lines' time in flight, which someone must pay for
        client.post(f"/v1/batches/{cancelled['id']}/cancel")
        wait_status(client, cancelled["id"], {"cancelled"})
        assert len(engine.executor.aborted) == 3
        engine.executor.answer_first = None
        answered = create_batch(client, upload(client, jsonl([request_line(f"b{i}") for i in range(3)]))["id"])
        wait_status(client, answered["id"], {"completed"})
        spent = {
            b["id"]: client.get(f"/v1/batches/{b['id']}/progress").json()["gpu_seconds"] for b in (cancelled, answered)
        }
    assert spent[cancelled["id"]] >= 0.5
    assert spent[answered["id"]] < 0.5  # its lines are answered at once: it pays for none of the cancelled ones


def stored_gpu_seconds(settings: Settings, batch_id: str) -> float:
    engine = make_engine(settings.database)
    try:
        with Session(engine) as session:
            row = session.get(BatchRow, batch_id)
            assert row is not None
            return row.gpu_seconds
    finally:
        engine.dispose()


@pytest.mark.both_backends
def test_gpu_seconds_are_checkpointed_and_a_restart_goes_on_from_them(settings):
    with held_batch(settings, lines=12, answered=4) as held:
        batch_id = held.batch["id"]
        wait_for(lambda: held.client.get(f"/v1/batches/{batch_id}/progress").json()["gpu_seconds"])
    kept = stored_gpu_seconds(settings, batch_id)
    assert kept > 0

    with app_on(settings, slow_engine()) as client:
        wait_status(client, batch_id, {"completed"})
        progress = client.get(f"/v1/batches/{batch_id}/progress").json()
        this_run = scrape(client)[("vbatch_batch_gpu_seconds_total", (("key", "anonymous"), ("model", "fake-model")))]
    assert this_run > 0
    # The restart went on from the checkpoint's engine time: it added its own, it did not start again from 0.
    assert progress["gpu_seconds"] == pytest.approx(kept + this_run, abs=2e-3)
