"""Batch lines paced by their prompt tokens while live requests are about (`app.engine.sharing.pacing`), the engine's
steps that pace them (`app.engine.telemetry.steps`), and the bounds the window takes from those steps
(`app.engine.sharing.window`).

The batch runs on the fake engine, whose steps the tests report by hand (`FakeServing.step`): the pace refills at
each step only, so what enters between two steps is what one step would carry.

The logic alone here; the tests through the app, a socket or a process are in
tests/integration/test_live_pacing.py."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from app.engine.inference.serving import EngineStep
from app.engine.sharing import pacing
from app.engine.sharing.execution import FixedSlots, run_lines
from app.engine.sharing.pacing import PrefillPacer
from app.engine.sharing.window import InFlightWindow
from app.engine.telemetry.steps import LIVE_OWED_SECONDS, EngineSteps, fitted
from tests.unit.test_batch_window import hold_lines

BUDGET = 40  # batch prompt tokens a step: two of the lines below (18 tokens each by the estimate), not three


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def steps_costing(*, fixed: float, per_prefill: float, per_decode: float, count: int = 64) -> EngineSteps:
    """Steps whose times are exactly `fixed + per_prefill x prompt + per_decode x decode`, with a spread in both."""
    steps = EngineSteps()
    for i in range(count):
        prefill, decode = (i % 7) * 100, (i % 5) * 20
        steps.record(EngineStep(fixed + per_prefill * prefill + per_decode * decode, prefill, decode))
    return steps


def test_the_cost_of_a_step_is_fitted_from_its_tokens_and_a_kind_with_no_spread_keeps_its_last_value():
    costs = steps_costing(fixed=0.01, per_prefill=2e-5, per_decode=1e-4).costs()
    assert costs.fixed == pytest.approx(0.01)
    assert costs.per_prefill == pytest.approx(2e-5)
    assert costs.per_decode == pytest.approx(1e-4)
    decode_only = [EngineStep(0.02 + 1e-4 * d, 0, d) for d in range(1, 40)]
    again = fitted(decode_only, costs)
    assert again.per_prefill == costs.per_prefill  # no prompt tokens in these steps: nothing new said of them
    assert again.per_decode == pytest.approx(1e-4) and again.fixed == pytest.approx(0.02)
    assert fitted(decode_only[:5], costs) == costs  # too few to fit


def test_a_steps_prompt_tokens_pay_the_live_prompts_that_arrived_first_and_the_rest_is_the_batchs():
    steps = EngineSteps()
    steps.online_arrived(100)
    steps.record(EngineStep(0.05, 300, 10))  # the live prompt and 200 of the batch's
    steps.online_arrived(500)
    steps.record(EngineStep(0.05, 200, 10))  # part of a long live prompt: all of it live
    steps.record(EngineStep(0.05, 400, 10))  # the rest of it (300), then 100 of the batch's
    registry = CollectorRegistry()
    registry.register(steps)
    samples = {
        (s.name, s.labels.get("kind")): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }
    assert samples[("vbatch_engine_step_tokens_total", "batch_prefill")] == 300
    assert samples[("vbatch_engine_step_tokens_total", "live_prefill")] == 600
    assert samples[("vbatch_engine_step_tokens_total", "decode")] == 30
    assert samples[("vbatch_engine_steps_total", None)] == 3
    assert samples[("vbatch_engine_step_seconds_count", None)] == 3
    assert samples[("vbatch_engine_step_seconds_sum", None)] == pytest.approx(0.15)
    summary = steps.summary()
    assert summary is not None and summary.steps == 3
    assert summary.batch_prefill == pytest.approx(100) and summary.live_prefill == pytest.approx(200)


def test_an_online_prompt_no_step_computed_in_ten_seconds_is_no_longer_counted_as_live():
    moved = Clock()
    steps = EngineSteps(now=moved)
    steps.online_arrived(50)  # refused before the engine, or aborted: no step will compute it
    moved.now += LIVE_OWED_SECONDS + 1
    steps.online_arrived(30)
    steps.record(EngineStep(0.05, 100, 0))
    summary = steps.summary()
    assert summary is not None and (summary.live_prefill, summary.batch_prefill) == (30, 70)


def test_the_budget_is_the_batchs_part_of_a_step_less_its_decode_or_the_one_set():
    steps = steps_costing(fixed=0.01, per_prefill=2e-5, per_decode=1e-4)
    now = Clock()
    pacer = PrefillPacer(steps=steps, ttft_target_seconds=0.5, max_step_tokens=16384, now=now)
    steps.record(EngineStep(0.01 + 1e-4 * 200, 0, 200))  # the last step decoded 200 tokens
    # A tenth of 500 ms is the batch's: 20 ms of it decode, 30 ms left at 20 us a prompt token.
    assert pacer.budget() == pytest.approx(1500, abs=2)
    assert pacer.ramp_budget() == 2048  # a new batch's first wave: an eighth of the engine's step budget
    assert PrefillPacer(steps=steps, ttft_target_seconds=0.5, max_step_tokens=16384, budget_tokens=300).budget() == 300
    steps.record(EngineStep(0.01 + 1e-4 * 900, 0, 900))  # decode alone over the batch's part: a line a step
    assert pacer.budget() == 1
    now.now += pacing.STEP_FRESH_SECONDS + 0.1  # no step since: that decode is over
    assert pacer.budget() == 2500
    unmeasured = PrefillPacer(steps=EngineSteps(), ttft_target_seconds=0.5, max_step_tokens=4096)
    assert unmeasured.budget() == 512  # nothing measured yet: an eighth of the step budget
    small_steps = PrefillPacer(steps=EngineSteps(), ttft_target_seconds=0.5, max_step_tokens=512, budget_tokens=40)
    assert small_steps.ramp_budget() == 512  # not an eighth of 512: the engine bounds its steps itself
    assert admitted(small_steps, [300] * 4, ramp=True) == [300] * 4  # so a first wave is not paced at all


def test_a_target_of_zero_paces_nothing_not_even_a_first_wave():
    pacer = PrefillPacer(steps=EngineSteps(), ttft_target_seconds=0, max_step_tokens=4096)
    pacer.activate(True)
    assert admitted(pacer, [4096] * 3, ramp=True) == [4096] * 3


def admitted(pacer: PrefillPacer, lines: list[int], *, ramp: bool = False) -> list[int]:
    """The lines (their tokens) that enter, in their order, before one does not fit."""
    entered: list[int] = []
    for tokens in lines:
        if not pacer.fits(tokens, ramp=ramp):
            break
        pacer.take(tokens, ramp=ramp)
        entered.append(tokens)
    return entered


def test_a_step_lets_in_its_budget_a_larger_line_alone_and_the_steps_after_pay_for_it():
    steps = EngineSteps()
    pacer = PrefillPacer(steps=steps, ttft_target_seconds=0.5, max_step_tokens=8192, budget_tokens=BUDGET)
    assert admitted(pacer, [30, 30, 30]) == [30, 30, 30]  # no live traffic: no pace
    pacer.activate(True)
    assert admitted(pacer, [18, 18, 18]) == [18, 18]
    steps.record(EngineStep(0.05, 0, 0))
    assert admitted(pacer, [100, 18]) == [100]  # over the budget: alone, with a step's allowance whole
    allowed = []
    for _ in range(3):  # 60 tokens over: the next step pays 40 of them, the one after 20 and lets 20 in
        steps.record(EngineStep(0.05, 0, 0))
        allowed.append(admitted(pacer, [18, 18, 18]))
    assert allowed == [[], [18], [18, 18]]
    pacer.activate(False)
    assert admitted(pacer, [500, 500]) == [500, 500]  # quiet again: full pace
    steps.record(EngineStep(0.05, 0, 0))
    assert admitted(pacer, [400] * 5, ramp=True) == [400, 400]  # a first wave: an eighth of 8,192 a step


def test_a_line_that_does_not_fit_waits_for_the_next_step_or_without_one_about_two_steps():
    asyncio.run(_waits_for_the_next_step())


async def _waits_for_the_next_step() -> None:
    steps = EngineSteps()
    pacer = PrefillPacer(steps=steps, ttft_target_seconds=0.5, max_step_tokens=8192, budget_tokens=BUDGET)
    pacer.activate(True)
    assert admitted(pacer, [30, 30]) == [30]
    waiting = asyncio.create_task(pacer.opened())
    await asyncio.sleep(0)
    assert not waiting.done()
    steps.record(EngineStep(0.2, 0, 0))  # a step: the pace refills
    await waiting
    assert admitted(pacer, [30, 30]) == [30]
    started = time.monotonic()
    await pacer.opened()  # no step reported: on its own after about two of the last one (0.2 s)
    assert 0.3 <= time.monotonic() - started < 2.0
    assert admitted(pacer, [30]) == [30]


def test_an_idle_engine_forgives_what_a_large_line_left_owing_so_a_batch_never_waits_on_nothing():
    asyncio.run(_idle_engine_forgives())


async def _idle_engine_forgives() -> None:
    steps = EngineSteps()
    pacer = PrefillPacer(steps=steps, ttft_target_seconds=0.5, max_step_tokens=8192, budget_tokens=1)
    pacer.activate(True)  # live traffic about (a live request in flight), and a budget of one token a step
    steps.record(EngineStep(0.001, 0, 0))
    assert admitted(pacer, [5000, 300]) == [5000]  # alone: 4,999 tokens owed, paid a token a step
    steps.record(EngineStep(0.001, 0, 0))
    assert admitted(pacer, [300]) == []
    started = time.monotonic()
    while not pacer.fits(300):  # no step comes (the engine is idle): a refill each 2 ms would take 10 s
        await pacer.opened()
        assert time.monotonic() - started < pacing.IDLE_FORGIVE_SECONDS + 2 * pacing.MAX_REFILL_SECONDS
    assert time.monotonic() - started >= pacing.IDLE_FORGIVE_SECONDS - 0.1


def test_live_traffic_gone_quiet_starts_a_first_waves_pace_afresh_and_the_windows_ticks_do_not_starve_it():
    """Seen in make test: a 1-line batch created just after a live request waited 600 s. Its line (a first wave's)
    owed what a line before it took under the live budget; once live traffic went quiet, the window's tick told the
    pace so every quarter second, each time waking the waiting line with no refill, before the refill it waits for
    on its own (two of the last step's seconds) could come."""
    asyncio.run(asyncio.wait_for(_quiet_starts_afresh(), timeout=5))


async def _quiet_starts_afresh() -> None:
    steps = EngineSteps()
    pacer = PrefillPacer(steps=steps, ttft_target_seconds=0.5, max_step_tokens=8192, budget_tokens=1)
    pacer.activate(True)
    steps.record(EngineStep(0.5, 0, 0))  # a CPU's step: with no step reported, the pace refills after a second
    assert admitted(pacer, [5000], ramp=True) == [5000]  # alone, under the live budget of a token: 4,999 owed

    async def window_ticks() -> None:  # the window's ticks once no live request is about (faster here)
        while True:
            pacer.activate(False)
            await asyncio.sleep(0.05)

    ticking = asyncio.create_task(window_ticks())
    try:
        while not pacer.fits(400, ramp=True):
            await pacer.opened()
    finally:
        ticking.cancel()
    assert admitted(pacer, [400, 400, 400], ramp=True) == [400, 400]  # a first wave's pace, whole: 1,024 a step


def test_lines_reach_the_engine_in_their_order_when_one_waits_for_the_pace_and_a_smaller_one_would_fit():
    asyncio.run(_lines_in_order())


async def _lines_in_order() -> None:
    steps = EngineSteps()
    pacer = PrefillPacer(steps=steps, ttft_target_seconds=0.5, max_step_tokens=8192)  # a first wave: 1,024 a step
    sizes = [900, 900, 10, 10, 900, 10]  # the second does not fit beside the first; the third would
    lines = [(i, {"custom_id": f"p{i}", "body": {"messages": [{"role": "user", "content": "x" * 4 * size}]}}, None)
             for i, size in enumerate(sizes)]  # fmt: skip
    seen: list[str] = []

    class Recording:
        async def execute(self, endpoint: str, body: dict, rank: int | None = None) -> tuple[int, dict]:
            seen.append(next(line[1]["custom_id"] for line in lines if line[1]["body"] is body))
            return 200, {"usage": {}}

    async def source():
        for line in lines:
            yield line

    async def stepping() -> None:  # the engine's steps, each refilling the pace
        while True:
            await asyncio.sleep(0.01)
            steps.record(EngineStep(0.01, 0, 0))

    engine = asyncio.create_task(stepping())
    outcomes: dict[int, object] = {}
    await run_lines(source(), executor=Recording(), endpoint="/v1/chat/completions", slots=FixedSlots(6), workers=6,
                    on_outcome=outcomes.__setitem__, pacer=pacer, ramp=4)  # fmt: skip
    engine.cancel()
    assert seen == [f"p{i}" for i in range(6)] and len(outcomes) == 6
    assert pacer.refusals > 0  # the second waited for a step; the third, which would have fit, waited behind it


def test_a_line_waits_while_the_kv_cache_lacks_room_for_it_and_the_live_requests():
    steps = EngineSteps()
    pacer = PrefillPacer(
        steps=steps, ttft_target_seconds=0.5, max_step_tokens=8192, budget_tokens=BUDGET, live_reserve=lambda: 40
    )
    pacer.activate(True)
    steps.record(EngineStep(0.05, 0, 0, kv_usage=0.95, kv_tokens=1000))  # 50 free, 40 of them kept for live ones
    assert admitted(pacer, [18]) == []
    steps.record(EngineStep(0.05, 0, 0, kv_usage=0.9, kv_tokens=1000))  # 100 free
    assert admitted(pacer, [18, 18, 18]) == [18, 18]  # the room, then the pace


def test_an_online_arrival_withdraws_the_batch_lines_whose_decode_does_not_fit_the_batchs_part_of_a_step():
    asyncio.run(_arrival_withdraws_beyond_the_decode_bound())


async def _arrival_withdraws_beyond_the_decode_bound() -> None:
    # A CPU's step: 10 ms a decoded token, so 5 lines fill a tenth of 500 ms.
    steps = steps_costing(fixed=0.04, per_prefill=6e-4, per_decode=0.01)
    pacer = PrefillPacer(steps=steps, ttft_target_seconds=0.5, max_step_tokens=4096)
    window = InFlightWindow(max_size=32, wave=64, ttft_target_seconds=0.5, pacer=pacer, now=Clock())
    assert window.decode_bound == 5 and window.least == 8
    requests, lines = await hold_lines(window, 20)
    window.online_arrived({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16})
    # 20 lines, a wave of 64: room enough, but the decode of more than the least (8) is over the batch's part.
    assert [r.cancelled() for r in requests] == [False] * 8 + [True] * 12
    assert window.withdrawn == 12 and window.size == 8 and pacer.active
    for request in requests[:8]:
        request.set_result("answered")
    await asyncio.gather(*lines)


def test_vllms_iteration_details_become_engine_steps_and_their_log_lines_stay_out_unless_asked(caplog):
    from app.engine.inference import vllm_adapter

    heard: list[EngineStep] = []
    stats = SimpleNamespace(stat_loggers=[])
    cache = SimpleNamespace(num_gpu_blocks=10, block_size=16)
    client = SimpleNamespace(logger_manager=stats, vllm_config=SimpleNamespace(cache_config=cache))
    vllm_adapter._record_steps(client, heard.append)
    (recorder,) = stats.stat_loggers
    details = SimpleNamespace(elapsed_ms=12.5, num_ctx_tokens=100, num_generation_tokens=7, is_dummy=False)
    recorder.record(SimpleNamespace(iteration_details=details, kv_cache_usage=0.25), None, engine_idx=0)
    recorder.record(SimpleNamespace(iteration_details=None), None)  # a client's stats without a step
    assert heard == [EngineStep(0.0125, 100, 7, 0.25, 160)]

    args = SimpleNamespace(
        enable_logging_iteration_details=False, scheduling_policy="fcfs", max_num_batched_tokens=2048
    )
    vllm_adapter.apply_batch_defaults(args)
    assert args.enable_logging_iteration_details is True
    vllm_logger = logging.getLogger("vllm.v1.metrics.loggers")
    vllm_adapter._quiet_iteration_lines(args)
    try:
        with caplog.at_level(logging.INFO, logger="vllm.v1.metrics.loggers"):
            vllm_logger.info("%sIteration(%d): ...", "Engine 000: ", 1)
            vllm_logger.info("Engine 000: Avg prompt throughput")
        assert [r.getMessage() for r in caplog.records] == ["Engine 000: Avg prompt throughput"]
    finally:
        for quiet in [f for f in vllm_logger.filters if isinstance(f, vllm_adapter._NoIterationLines)]:
            vllm_logger.removeFilter(quiet)
    asked = SimpleNamespace(
        enable_logging_iteration_details=True, scheduling_policy="fcfs", max_num_batched_tokens=4096
    )
    vllm_adapter.apply_batch_defaults(asked)
    assert asked.max_num_batched_tokens == 4096  # the user's own
    vllm_adapter._quiet_iteration_lines(asked)
    assert not any(isinstance(f, vllm_adapter._NoIterationLines) for f in vllm_logger.filters)  # the user's flag
