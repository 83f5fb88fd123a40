"""The online benchmark's own parts (bench/online_load.py), without an engine: the server-sent-event timing on canned
bytes cut anywhere, the Poisson schedule, the percentiles, the Prometheus reading, and the open-loop and batch
clients against a loopback server that answers as `vllm serve` streams."""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import threading
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from app.testing import free_port
from bench.online import BatchPusher, Deadline
from bench.online_load import (
    Answer,
    SseTimer,
    StreamTimes,
    _push,
    online_bodies,
    open_loop,
    percentile,
    poisson_schedule,
    series_total,
    summarize,
    tokens_between,
)
from tests.helpers import serving, wait_for


def chunk(delta: dict | None = None, usage: dict | None = None, finish: str | None = None) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m", "choices": choices, "usage": usage}


# As `vllm serve` streams a chat answer: the role first (no text), three tokens, the finish, the usage, [DONE].
EVENTS = [
    chunk({"role": "assistant", "content": ""}),
    chunk({"content": "Hel"}),
    chunk({"content": "lo"}),
    chunk({"content": " there"}),
    chunk({"content": ""}, finish="stop"),
    chunk(usage={"prompt_tokens": 200, "completion_tokens": 3, "total_tokens": 203}),
]
STREAM = [f"data: {json.dumps(event)}\n\n".encode() for event in EVENTS] + [b"data: [DONE]\n\n"]


def test_each_event_is_timed_by_the_arrival_of_the_chunk_that_ends_it():
    timer = SseTimer()
    for at, event in enumerate(STREAM, start=1):
        timer.feed(float(at), event)
    assert timer.times.content_at == [2.0, 3.0, 4.0]  # the role and the finish carry no text: not tokens
    assert timer.times.done_at == 7.0
    assert (timer.times.prompt_tokens, timer.times.completion_tokens, timer.times.error) == (200, 3, None)


@pytest.mark.parametrize("line_end", [b"\n", b"\r\n"])
def test_cut_anywhere_the_stream_reads_the_same(line_end):
    parts = [part.replace(b"\n", line_end) for part in STREAM]
    whole = b"".join(parts)
    ends = [sum(len(part) for part in parts[: i + 1]) for i in (1, 2, 3)]  # where each text event ends
    for cut in range(1, len(whole)):
        timer = SseTimer()
        timer.feed(1.0, whole[:cut])
        timer.feed(2.0, whole[cut:])
        # An event whole in the first part arrived at 1; one cut in two, or after the cut, at 2.
        assert timer.times.content_at == [1.0 if end <= cut else 2.0 for end in ends], cut
        assert timer.times.done_at == 2.0 and timer.times.completion_tokens == 3


def test_events_in_one_chunk_arrive_together_and_comments_are_not_events():
    timer = SseTimer()
    timer.feed(1.0, b": keep-alive\n\n" + b"".join(STREAM[:3]))
    timer.feed(5.0, b"".join(STREAM[3:]))
    assert timer.times.content_at == [1.0, 1.0, 5.0]


def test_an_error_event_fails_the_answer():
    timer = SseTimer()
    timer.feed(1.0, STREAM[1])
    error = {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}
    timer.feed(2.0, f"data: {json.dumps(error)}\n\n".encode() + b"data: [DONE]\n\n")
    answer = Answer(due=0.0, sent_at=0.5, lag=0.0, times=timer.times)
    assert not answer.ok and "boom" in (answer.reason() or "")
    assert answer.ttft() is None


def test_an_answer_gives_ttft_itl_and_end_to_end_from_its_send():
    times = StreamTimes(content_at=[10.25, 10.5, 11.0], done_at=11.5, prompt_tokens=200, completion_tokens=3)
    answer = Answer(due=1.0, sent_at=10.0, lag=0.01, times=times)
    assert (answer.ttft(), answer.itls(), answer.e2e()) == (0.25, [0.25, 0.5], 1.5)
    cut = Answer(due=2.0, sent_at=10.0, lag=0.0, times=StreamTimes(content_at=[10.5]))  # no [DONE]
    summary = summarize([answer, cut])
    assert (summary["sent"], summary["done"], summary["failed"]) == (2, 1, 1)
    assert summary["errors"] == {"the stream ended without [DONE]": 1}
    assert (summary["ttft_p50_ms"], summary["itl_p50_ms"], summary["e2e_p99_s"]) == (250.0, 375.0, 1.5)
    assert tokens_between([answer, cut], 10.4, 10.6) == 2


def test_percentile_interpolates_between_ranks_like_numpy():
    values = list(range(1, 101))
    assert percentile(values, 0.5) == 50.5
    assert percentile(values, 0.99) == pytest.approx(99.01)
    assert percentile(reversed(values), 0.0) == 1 and percentile(values, 1.0) == 100
    assert percentile([7.0], 0.99) == 7.0
    assert percentile([], 0.5) is None


def test_the_poisson_schedule_is_fixed_by_its_seed_and_has_exponential_gaps():
    schedule = poisson_schedule(4.0, 1000.0, seed=29)
    assert schedule == poisson_schedule(4.0, 1000.0, seed=29)
    assert schedule != poisson_schedule(4.0, 1000.0, seed=30)
    assert all(0 <= a < b < 1000 for a, b in itertools.pairwise(schedule))
    gaps = [b - a for a, b in zip([0.0, *schedule], schedule, strict=False)]
    assert 3800 < len(schedule) < 4200
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.05)
    # Exponential gaps spread as much as they average (a coefficient of variation of 1); a fixed rate's would not.
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, abs=0.1)
    assert poisson_schedule(4.0, 45.0, seed=29) == [t for t in schedule if t < 45.0]


def test_online_bodies_are_streamed_and_each_prompt_is_its_own():
    bodies = online_bodies("m", 50, words=180, max_tokens=128, sampling={"temperature": 0.7}, seed=29)
    assert bodies == online_bodies("m", 50, words=180, max_tokens=128, sampling={"temperature": 0.7}, seed=29)
    prompts = [body["messages"][0]["content"] for body in bodies]
    assert len({prompt[:24] for prompt in prompts}) == 50  # different from their first words on
    assert all(len(prompt.split()) == 9 + 180 for prompt in prompts)
    assert bodies[0]["stream"] is True and bodies[0]["stream_options"] == {"include_usage": True}
    assert (bodies[0]["max_tokens"], bodies[0]["temperature"]) == (128, 0.7)


def test_a_prometheus_series_is_summed_over_its_labels():
    text = (
        "# HELP vllm:generation_tokens_total Number of generation tokens processed.\n"
        "# TYPE vllm:generation_tokens_total counter\n"
        'vllm:generation_tokens_total{engine="0",model_name="a {b} c"} 1500.0\n'
        'vllm:generation_tokens_total{engine="1",model_name="m"} 500.0\n'
        'vllm:generation_tokens_created{engine="0",model_name="m"} 1.7e+09\n'
        "vllm:num_requests_running 3.0\n"
    )
    assert series_total(text, "vllm:generation_tokens_total") == 2000.0
    assert series_total(text, "vllm:num_requests_running") == 3.0
    assert series_total(text, "vllm:num_preemptions_total") is None


def test_windows_shrink_alike_to_end_before_the_deadline():
    deadline = Deadline(100.0)
    assert deadline.windows([30.0, 45.0], reserve=10.0) == [30.0, 45.0]
    shrunk = deadline.windows([60.0, 90.0], reserve=25.0)
    assert shrunk[1] / shrunk[0] == pytest.approx(1.5) and sum(shrunk) == pytest.approx(75.0, abs=0.5)
    with pytest.raises(RuntimeError, match="no time left"):
        deadline.windows([30.0], reserve=99.0)


def sse_app() -> FastAPI:
    """Streams EVENTS for each request; the first is held until the second has arrived (an open loop sends the
    second anyway). A body with `"fail": true` is refused, as vLLM refuses a bad body; a plain one is answered."""
    app = FastAPI()
    state: dict = {"arrived": 0}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        if body.get("fail"):
            return JSONResponse({"error": {"message": "bad"}}, status_code=400)
        if body.get("hold"):  # answered never: held until its client goes away
            while not await request.is_disconnected():
                await asyncio.sleep(0.05)
            return JSONResponse({}, status_code=499)
        if not body.get("stream"):
            return {"usage": {"completion_tokens": body["max_tokens"]}}
        state["arrived"] += 1
        second = state.setdefault("second", asyncio.Event())
        if state["arrived"] == 1:
            await second.wait()
        else:
            second.set()

        async def events():
            for event in STREAM:
                yield event

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_the_open_loop_sends_on_schedule_while_earlier_answers_are_still_open():
    bodies = [{"stream": True}, {"stream": True}, {"stream": True, "fail": True}]
    with serving(sse_app(), free_port()) as port:
        start = time.monotonic()
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        answers = asyncio.run(open_loop(url, bodies, [0.0, 0.2, 0.3], start, start + 30))
    first, second, refused = answers
    assert first.ok and second.ok
    assert second.sent_at >= start + 0.2  # never early
    assert first.times.content_at[0] >= second.sent_at  # the first was still unanswered when the second went
    assert first.times.completion_tokens == 3 and len(first.itls()) == 2
    assert not refused.ok and (refused.error or "").startswith("HTTP 400")


def test_the_batch_client_sends_each_line_once_and_says_when_the_file_ran_out(tmp_path):
    bodies = [{"max_tokens": n} for n in range(1, 8)]
    records = tmp_path / "pushed.json"
    with serving(sse_app(), free_port()) as port:
        asyncio.run(_push(f"http://127.0.0.1:{port}/v1/chat/completions", bodies, 3, threading.Event(), records))
    pushed = json.loads(records.read_text())
    assert sorted(tokens for _, tokens in pushed["finished"]) == list(range(1, 8))
    assert pushed["ran_out"] is True and pushed["failures"] == {} and pushed["ended"] is True


def test_a_batch_client_killed_from_outside_leaves_what_it_saw_and_says_it_did_not_end(tmp_path):
    tickets = tmp_path / "tickets.jsonl"
    bodies = [{"max_tokens": n} for n in range(1, 4)] + [{"hold": True}] * 2
    tickets.write_text("".join(json.dumps({"body": body}) + "\n" for body in bodies))
    records = tmp_path / "pushed.json"
    with serving(sse_app(), free_port()) as port:
        pusher = BatchPusher(f"http://127.0.0.1:{port}/v1/chat/completions", tickets, 2, records)
        wait_for(lambda: records.exists() and len(json.loads(records.read_text())["finished"]) == 3, timeout=60)
        pusher.process.kill()  # as the kernel's OOM killer would
        pushed = pusher.finish()
    assert sorted(tokens for _, tokens in pushed["finished"]) == [1, 2, 3]
    assert pushed["ended"] is False and pushed["exit_code"] == -9 and pushed["ran_out"] is False


def test_the_batch_client_runs_in_a_process_of_its_own_and_hands_back_what_it_saw(tmp_path):
    tickets = tmp_path / "tickets.jsonl"
    tickets.write_text("".join(json.dumps({"body": {"max_tokens": n}}) + "\n" for n in range(1, 6)))
    with serving(sse_app(), free_port()) as port:
        pusher = BatchPusher(f"http://127.0.0.1:{port}/v1/chat/completions", tickets, 2, tmp_path / "pushed.json")
        wait_for(lambda: not pusher.process.is_alive(), timeout=60)  # it ends by itself once the file has run out
        pushed = pusher.finish()
    assert sorted(tokens for _, tokens in pushed["finished"]) == [1, 2, 3, 4, 5] and pushed["ran_out"] is True
    assert pushed["ended"] is True and pushed["exit_code"] == 0
