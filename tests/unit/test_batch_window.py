"""The batch's in-flight window (`app.engine.sharing.window`): it shrinks while online requests miss their
time-to-first-token target, holds its floor, grows back when they stop, and shrinking cancels no line in flight. The
rule is driven by hand on a clock the test moves; the batch runs on the fake engine.

The logic alone here; the tests through the app, a socket or a process are in
tests/integration/test_batch_window.py."""

from __future__ import annotations

import asyncio

from prometheus_client import generate_latest

from app.engine.sharing.window import QUIET_SECONDS, InFlightWindow
from app.engine.telemetry.metrics import Metrics

TARGET = 0.5  # seconds


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def window_of(*, wave: int = 16, max_size: int = 32, target: float = TARGET) -> tuple[InFlightWindow, Clock]:
    moved = Clock()
    return InFlightWindow(max_size=max_size, wave=wave, ttft_target_seconds=target, now=moved), moved


def online(window: InFlightWindow, moved: Clock, *, first_token: float, then: float = 0.25) -> None:
    """An online request arrives, has its first token `first_token` seconds later, and the clock moves on."""
    window.online_arrived()
    moved.now += first_token
    window.online_first_token(first_token)
    moved.now += then


def test_online_traffic_caps_the_window_a_wave_less_room_for_it_at_once():
    window, _ = window_of()
    assert window.tick() == 32  # nothing online: every place is the batch's, a wave queued in the engine
    window.online_arrived()  # not yet measured: no queue of batch lines for it to wait behind
    assert window.tick() == 14  # a wave (16) less twice the one online request in flight
    window.online_arrived()
    window.online_arrived()
    assert window.tick() == 10  # three in flight: six places kept free


def test_shrinks_by_half_on_fresh_misses_only_and_never_below_an_eighth_of_a_wave():
    window, moved = window_of()
    online(window, moved, first_token=2.0)
    online(window, moved, first_token=2.0)
    assert window.size == 12  # at each arrival, at once: under the ceiling (a wave, 16, less twice those in flight)
    assert window.tick() == 6  # half, for the misses
    assert window.tick() == 6  # the same misses again: nothing measured since the shrink, so it holds
    online(window, moved, first_token=1.0)  # arrived after the shrink, still over the target
    assert window.tick() == 3
    sizes = []
    for _ in range(2):
        online(window, moved, first_token=1.0)
        window.online_done()  # each comes and goes: 3 stay in flight
        sizes.append(window.tick())
    assert sizes == [2, 2]  # an eighth of the wave is the least


def test_many_online_requests_leave_batches_an_eighth_of_a_wave():
    window, moved = window_of()
    for _ in range(20):
        online(window, moved, first_token=5.0, then=0.0)
        moved.now += 0.25
        window.tick()
    assert window.online.in_flight == 20
    assert window.size == window.least == window.ceiling == 2


def test_grows_a_step_a_tick_under_the_target_up_to_its_ceiling_and_back_to_the_most_once_traffic_stops():
    window, moved = window_of()
    online(window, moved, first_token=2.0)
    window.online_done()
    window.tick()
    assert window.size == 7  # 14 at its arrival, then half
    sizes = []
    for _ in range(9):
        online(window, moved, first_token=0.1)
        window.online_done()
        sizes.append(window.tick())
    # A sixteenth of a wave a tick, up to the ceiling: with none in flight, a wave less one step (16 less 1).
    assert sizes == [8, 9, 10, 11, 12, 13, 14, 15, 15]
    moved.now += QUIET_SECONDS - 0.5
    assert window.tick() == 15  # none in flight, but one arrived moments ago: still under the ceiling
    moved.now += 0.5
    assert window.tick() == 32  # quiet: the batch takes every place back at once


def test_online_requests_not_yet_measured_hold_the_window_and_long_ones_alone_let_it_grow():
    window, moved = window_of()
    for _ in range(2):
        online(window, moved, first_token=2.0)
        window.online_done()
        window.tick()
    assert window.size == 3  # 14 at the first arrival, then 7, then 3
    window.online_arrived()  # waiting for its first token: nothing says the shrink was enough
    moved.now += 1.0
    assert window.tick() == 3
    moved.now += QUIET_SECONDS  # only a long request in flight, none arriving: no sign of pressure
    assert window.tick() == 4


def test_a_target_of_zero_keeps_the_window_at_its_most():
    window, moved = window_of(target=0)
    online(window, moved, first_token=30.0)
    assert window.tick() == 32


def test_a_shrink_lets_fewer_in_and_takes_none_back():
    asyncio.run(_shrink_lets_fewer_in_and_takes_none_back())


async def _shrink_lets_fewer_in_and_takes_none_back() -> None:
    window, _ = window_of(wave=4, max_size=4)
    for _ in range(4):
        await window.acquire()
    window.resize(2)
    assert window.held == 4  # the lines in flight keep their places
    entering = asyncio.create_task(window.acquire())
    given_up = asyncio.create_task(window.acquire())
    await asyncio.sleep(0)
    given_up.cancel()
    await asyncio.gather(given_up, return_exceptions=True)
    window.release()
    window.release()
    assert not entering.done() and window.held == 2  # still at the new size
    window.release()
    await entering  # under the size: the first waiter is let in, and the cancelled one took no place
    assert window.held == 2
    window.resize(4)
    async with window.place():
        assert window.held == 3


def test_arrivals_withdraw_the_youngest_lines_over_a_wave_once_each_down_to_the_least_target_zero_none():
    asyncio.run(_arrivals_withdraw_the_youngest())


async def hold_lines(window: InFlightWindow, count: int) -> tuple[list[asyncio.Future], list[asyncio.Task]]:
    """`count` batch lines, each in its place in `window` until the test answers (or withdraws) its request: their
    requests in the order they took places, and their tasks."""
    requests: list[asyncio.Future] = []
    entered = asyncio.Event()

    async def line() -> None:
        async with window.place() as place:
            place.request = asyncio.get_running_loop().create_future()
            requests.append(place.request)
            if len(requests) == count:
                entered.set()
            await asyncio.gather(place.request, return_exceptions=True)

    lines = [asyncio.create_task(line()) for _ in range(count)]
    await entered.wait()
    return requests, lines


async def _arrivals_withdraw_the_youngest() -> None:
    window, _ = window_of(wave=4, max_size=8)
    requests, lines = await hold_lines(window, 6)
    requests[5].set_result("answered")  # the youngest has its answer, not yet handed on: nothing to withdraw there
    window.online_arrived()  # 6 lines and 1 online request for 4 seats
    assert [r.cancelled() for r in requests] == [False, False, True, True, True, False]
    window.online_arrived()  # the three withdrawn are still leaving: one more, not four
    assert [r.cancelled() for r in requests] == [False, True, True, True, True, False]
    assert window.withdrawn == 4 and window.size == window.ceiling == window.least == 1
    for _ in range(5):
        window.online_arrived()  # more online requests than seats: the batch keeps its least (one place here)
    assert window.withdrawn == 5 and requests[0].cancelled() and not requests[5].cancelled()
    await asyncio.gather(*lines)
    assert window.held == 0

    window, _ = window_of(wave=4, max_size=8, target=0)
    requests, lines = await hold_lines(window, 8)
    window.online_arrived()
    assert window.withdrawn == 0 and not any(r.cancelled() for r in requests)
    for request in requests:
        request.set_result("answered")
    await asyncio.gather(*lines)


def test_no_window_series_before_an_engine_serves():
    metrics = Metrics()
    assert b"vbatch_batch_window" not in generate_latest(metrics.registry)
    metrics.watch_window(lambda: (5, 9), lambda: None, lambda: 4)
    text = generate_latest(metrics.registry).decode()
    assert "vbatch_batch_window 5.0" in text and "vbatch_batch_window_max 9.0" in text
    assert "vbatch_batch_lines_withdrawn_total 4.0" in text
    assert "vbatch_batch_preemptions" not in text  # an engine that does not say is not shown as 0


def test_the_preemptions_are_vllms_counter_summed_over_its_engines():
    from prometheus_client import CollectorRegistry
    from prometheus_client import Counter as PromCounter

    from app.engine.inference.vllm_adapter import _preemptions

    registry = CollectorRegistry()
    # As vLLM's PrometheusStatLogger makes it: one child per engine, made at start.
    counter = PromCounter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                          ["model_name", "engine"], registry=registry)  # fmt: skip
    assert _preemptions(registry) is None
    counter.labels("m", "0").inc(2)
    counter.labels("m", "1").inc(3)
    assert _preemptions(registry) == 5
