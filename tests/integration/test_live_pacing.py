"""Batch lines paced by their prompt tokens while live requests are about (`app.engine.sharing.pacing`), the engine's
steps that pace them (`app.engine.telemetry.steps`), and the bounds the window takes from those steps
(`app.engine.sharing.window`).

The batch runs on the fake engine, whose steps the tests report by hand (`FakeServing.step`): the pace refills at
each step only, so what enters between two steps is what one step would carry.

Through the app, a socket or a process here; the logic alone is in tests/unit/test_live_pacing.py."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from app.core import clock
from app.engine.inference.serving import EngineStep
from app.engine.service import EngineService
from app.engine.sharing import pacing
from app.engine.sharing.pacing import estimated_tokens
from app.engine.sharing.window import QUIET_SECONDS
from app.testing import FakeEngine, FakeExecutor, FakeServing, fake_frontends
from tests.helpers import app_on, create_batch, jsonl, read_jsonl, request_line, upload, wait_for, wait_status

BUDGET = 40  # batch prompt tokens a step: two of the lines below (18 tokens each by the estimate), not three
TEXT = "x" * 40  # 10 tokens by characters, and 8 for the chat template around its message


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def engine_of(executor: FakeExecutor) -> FakeEngine:
    engine = FakeEngine()
    engine.executor = executor
    return engine


def test_batch_lines_enter_within_the_budget_each_step_while_a_live_request_is_in_flight_then_at_full_pace(
    settings, monkeypatch
):
    moved = Clock()
    monkeypatch.setattr(clock, "monotonic", moved)
    monkeypatch.setattr(pacing, "MIN_REFILL_SECONDS", 3600.0)  # the steps this test reports refill the pace
    monkeypatch.setattr(pacing, "MAX_REFILL_SECONDS", 3600.0)
    monkeypatch.setattr(pacing, "CALIBRATION_WEIGHT", 0.0)  # the fake's usage says 5 prompt tokens a line
    # A wave of 8: the window has room (lines are answered at once), and past the first wave's 8 lines, which are
    # paced whatever the traffic, lines go at full pace once no live request is about.
    monkeypatch.setattr(FakeServing, "max_num_seqs", 8)
    settings = settings.model_copy(update={"live_prefill_tokens": BUDGET})
    executor = FakeExecutor()
    with app_on(settings, engine_of(executor)) as client:
        service: EngineService = client.app.state.engine
        window = wait_for(lambda: service._ctx).window  # the engine serves
        pacer = window.pacer
        on_engine_loop = service._loop.call_soon_threadsafe  # type: ignore[union-attr]
        live = {"model": "fake-model", "messages": [{"role": "user", "content": "now"}], "max_tokens": 4}
        on_engine_loop(window.online_arrived, live)  # in flight until the test says it is done
        wait_for(lambda: pacer.active)
        lines = [request_line(f"r{i:02}", messages=[{"role": "user", "content": TEXT}]) for i in range(24)]
        assert estimated_tokens(lines[0]["body"]) == 18
        batch = create_batch(client, upload(client, jsonl(lines))["id"])
        entered_per_step, refused = [], 0
        for _ in range(6):
            wait_for(lambda refused=refused: pacer.refusals > refused)  # the next line waits for the next step
            refused = pacer.refusals
            entered_per_step.append(len(executor.bodies) - sum(entered_per_step))
            on_engine_loop(service.engine._serving.step, EngineStep(0.05, 36, 0))  # type: ignore[union-attr]
        tokens_per_step = [18 * count for count in entered_per_step]
        assert all(0 < tokens <= BUDGET for tokens in tokens_per_step), tokens_per_step
        assert entered_per_step == [2] * 6
        on_engine_loop(window.online_done)
        moved.now += QUIET_SECONDS
        on_engine_loop(window.tick)  # quiet: full pace, with no step reported from here on
        done = wait_status(client, batch["id"], {"completed"})
        assert not pacer.active and len(executor.bodies) == 24
    output = read_jsonl(client, done["output_file_id"])
    assert sorted(line["custom_id"] for line in output) == [f"r{i:02}" for i in range(24)]


def test_the_engine_steps_are_on_metrics_and_on_the_consoles_engine_page(settings):
    executor = FakeExecutor()
    executor.report_steps = True
    with app_on(settings, engine_of(executor)) as client:
        batch = create_batch(client, upload(client, jsonl([request_line(f"s{i}") for i in range(6)]))["id"])
        wait_status(client, batch["id"], {"completed"})
        families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
        assert families["vbatch_engine_steps"].samples[0].value == 6
        tokens = {s.labels["kind"]: s.value for s in families["vbatch_engine_step_tokens"].samples}
        assert tokens == {"batch_prefill": 12, "live_prefill": 0, "decode": 6}  # "hi sN": two words a line
        assert "vbatch_batch_prefill_budget_tokens" in families and "vbatch_batch_paced" in families
        page = " ".join(client.get("/console/engine").text.split())
    assert 'id="step-time"' in page and "1.0 ms median" in page
    assert "2.0 batch prefill, 0 live prefill, 1.0 decode" in page
    assert "off: full pace" in page


def test_front_end_processes_pass_each_engine_step_they_hear_of_to_the_pool():
    asyncio.run(_front_ends_pass_steps())


async def _front_ends_pass_steps() -> None:
    heard: list[EngineStep] = []
    async with fake_frontends(2, report_steps=True) as pool:
        pool.on_step(heard.append)
        answers = await asyncio.gather(
            *(pool.execute("/v1/chat/completions", request_line(f"f{i}")["body"]) for i in range(4))
        )
        assert [status for status, _ in answers] == [200] * 4
        async with asyncio.timeout(20):
            while len(heard) < 4:
                await asyncio.sleep(0.01)  # the steps travel with the front ends' online news, apart from the answers
    assert sorted(step.prefill_tokens for step in heard) == [2] * 4 and {step.decode_tokens for step in heard} == {1}
