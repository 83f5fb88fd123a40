"""Front-end processes (`app.engine.inference.frontends`): what several processes answer is byte for byte what one
process answers, and a front end's death reaches the loop as an engine death. The fake engine's serving runs in real
spawned processes behind a real `FrontendPool`; the end-to-end suite runs vLLM's behind two."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import multiprocessing.connection
import os
import re
import signal

import pytest

from app.domain.results import error_outcome, http_outcome, line_for, rendered_body
from app.engine.batch.offline import run_file
from app.engine.inference import frontends
from app.engine.inference.serving import EngineDead
from app.testing import FakeEngine, fake_frontends
from tests.helpers import jsonl, request_line

IDS = re.compile(rb'"(batch_req_|req_)[0-9a-f]+"')


def normalized(path) -> list[bytes]:
    """The file's lines in custom_id order, with the ids that are random per line replaced."""
    lines = [IDS.sub(rb'"\1*"', line) for line in path.read_bytes().splitlines()]
    return sorted(lines, key=lambda line: json.loads(line)["custom_id"])


def test_bodies_through_front_end_processes_are_those_of_one_process(tmp_path):
    lines = [request_line(f"r{i}", max_tokens=-1 if i % 7 == 3 else 1 + i % 5) for i in range(60)]
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl(lines))
    outputs = {}
    for name, factory in (("one", FakeEngine()), ("pool", functools.partial(fake_frontends, 2))):
        output, errors = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
        assert asyncio.run(run_file(factory, input_path=source, output=output, errors=errors)) == 0
        outputs[name] = (normalized(output), normalized(errors))
    one_output, one_errors = outputs["one"]
    assert len(one_output) == 51 and len(one_errors) == 9
    assert outputs["pool"] == outputs["one"]


def test_a_line_is_the_json_of_its_record():
    body = {"id": "chatcmpl-1", "choices": [{"message": {"content": 'naïve ✓ "quoted"'}}], "usage": {}}
    for outcome in (http_outcome("c-ü", 200, body), error_outcome("c-2", "batch_expired", "too late")):
        line = line_for(outcome)
        record = json.loads(line)
        assert line == json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
    assert json.loads(line_for(http_outcome("c", 200, body)))["response"]["body"] == body


def test_a_rendered_body_is_kept_as_sent_and_its_usage_read():
    body = {"object": "list", "data": [{"embedding": [0.1, -2e-05, 3.0], "index": 0}], "usage": {"prompt_tokens": 4}}
    for rendered in (json.dumps(body).encode(), json.dumps(body, separators=(",", ":")).encode()):
        encoded = rendered_body(rendered)
        assert encoded.json == rendered and encoded.usage == {"prompt_tokens": 4}
        assert json.loads(line_for(http_outcome("e", 200, encoded)))["response"]["body"] == body
    indented = rendered_body(json.dumps(body, indent=2).encode())  # not one line: encoded anew
    assert b"\n" not in indented.json and json.loads(indented.json) == body and indented.usage == {"prompt_tokens": 4}
    assert rendered_body(b'{"usage": null, "x": 1}').usage == {}


def test_an_engine_death_in_a_front_end_reaches_the_caller():
    async def scenario() -> None:
        async with fake_frontends(2) as pool:
            assert await pool.is_alive()
            answers = await asyncio.gather(*(pool.execute("/v1/chat/completions", {"n": i}) for i in range(20)))
            assert [status for status, _ in answers] == [200] * 20
            with pytest.raises(EngineDead):
                await pool.execute("/v1/chat/completions", {"seed": 1})

    asyncio.run(scenario())


def test_a_front_end_process_that_dies_is_an_engine_death():
    async def scenario() -> None:
        async with fake_frontends(2) as pool:
            victim = pool._frontends[0].process
            os.kill(victim.pid, signal.SIGKILL)
            await asyncio.to_thread(victim.join, 30)
            assert not await pool.is_alive()
            status, _ = await pool.execute("/v1/chat/completions", {"n": 1})  # the other one still answers
            assert status == 200

    asyncio.run(scenario())


def test_an_engine_core_that_exits_fails_what_is_in_flight():
    async def scenario() -> None:
        async with fake_frontends(2) as pool:
            stalled = asyncio.ensure_future(pool.execute("/v1/chat/completions", {"stall": True}))
            [core] = pool._engine_processes
            os.kill(core.pid, signal.SIGKILL)
            with pytest.raises(EngineDead):
                await asyncio.wait_for(stalled, 30)
            assert not await pool.is_alive()
            with pytest.raises(EngineDead):
                await pool.execute("/v1/chat/completions", {"n": 1})

    asyncio.run(scenario())


def test_a_stack_dump_names_the_innermost_await_through_context_managers():
    from contextlib import asynccontextmanager

    from app.engine.inference.frontends import await_chain

    async def deepest(release: asyncio.Event) -> None:
        await release.wait()

    @asynccontextmanager
    async def opening(release: asyncio.Event):
        await deepest(release)
        yield

    async def outer(release: asyncio.Event) -> None:
        async with opening(release):
            pass

    async def main() -> list[str]:
        release = asyncio.Event()
        task = asyncio.create_task(outer(release))
        await asyncio.sleep(0.01)
        chain = await_chain(task)
        release.set()
        await task
        return chain

    chain = asyncio.run(main())
    names = [place.rsplit(" in ", 1)[-1] for place in chain if " in " in place]
    assert names[0] == "outer" and "opening" in names and "deepest" in names and names[-1] == "wait"


@pytest.mark.parametrize(
    ("cores", "parallel", "expected"),
    [
        (2, (1, 1, 1), 1),  # the CI host: the serving layer stays in the service's process
        (16, (1, 1, 1), 14),  # the H200 host: 14 front ends, a core for the API and one for the engine
        (16, (4, 1, 1), 10),  # four GPU workers beside the engine core
        (16, (1, 1, 2), 13),  # two data-parallel engine cores
        (128, (1, 1, 1), 14),  # more front ends than this were never measured
    ],
)
def test_default_front_ends_leave_a_core_to_each_busy_process(cores, parallel, expected):
    tensor, pipeline, data = parallel
    busy = frontends.engine_processes(tensor_parallel=tensor, pipeline_parallel=pipeline, data_parallel=data)
    assert frontends.default_count(cores, engine_processes=busy) == expected


def test_an_exit_is_logged_with_its_code_a_group_stop_as_a_warning():
    async def scenario() -> list[tuple[int, str]]:
        async with fake_frontends(2) as pool:
            records = []
            for frontend, signum in zip(pool._frontends, (signal.SIGTERM, signal.SIGKILL), strict=True):
                os.kill(frontend.process.pid, signum)
                assert multiprocessing.connection.wait([frontend.process.sentinel], 30)  # what the pool watches
                records.append(frontends.exit_record(frontend.process, f"front end {frontend.index}"))
            return records

    assert asyncio.run(scenario()) == [
        (logging.WARNING, "front end 0 stopped by SIGTERM"),
        (logging.ERROR, "front end 1 stopped by SIGKILL"),
    ]


# Online requests (`FrontendPool.respond`): JSON answers and streams from front-end processes.

CHAT = "/v1/chat/completions"


def online_body(**fields) -> dict:
    return {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], **fields}


async def until(condition, timeout: float = 30.0) -> None:
    """Waits, letting the pool's loop run, for what a front-end process does to show."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


async def in_one_process(endpoint: str, body: dict):
    """What the fake serving answers in this process: the bodies the front ends must pass on unchanged."""
    async with FakeEngine()() as serving:
        answer = await serving.respond(endpoint, body)
        return answer if isinstance(answer, tuple) else [chunk async for chunk in answer]


def test_online_answers_through_front_end_processes_are_those_of_one_process():
    bodies = [
        (CHAT, online_body()),
        (CHAT, online_body(max_tokens=-1, stream=True)),  # refused before any stream: JSON
        (CHAT, online_body(stream=True, stream_options={"include_usage": True})),
        ("/v1/completions", {"model": "fake-model", "prompt": "hi", "stream": True, "max_tokens": 40}),
    ]

    async def scenario() -> None:
        async with fake_frontends(2) as pool:
            for endpoint, body in bodies:
                answer = await pool.respond(endpoint, body)
                got = answer if isinstance(answer, tuple) else [chunk async for chunk in answer]
                assert got == await in_one_process(endpoint, body)
            assert all(not f.streams and not f.pending for f in pool._frontends)

    asyncio.run(scenario())


def test_a_stream_closed_or_abandoned_by_its_reader_is_aborted_in_the_front_end(tmp_path):
    async def scenario() -> None:
        async with fake_frontends(2) as pool:
            closed, abandoned = tmp_path / "closed", tmp_path / "abandoned"
            stream = await pool.respond(CHAT, online_body(stream=True, stream_hold=True, abort_marker=str(closed)))
            assert (await anext(stream)).startswith("data: ")
            await stream.aclose()
            other = await pool.respond(CHAT, online_body(stream=True, stream_hold=True, abort_marker=str(abandoned)))
            await anext(other)
            waiting = asyncio.ensure_future(anext(other))  # waits for a chunk that the hold never sends
            await until(lambda: not waiting.done() and other._arrived._waiters)
            waiting.cancel()
            await until(lambda: closed.exists() and abandoned.exists())
            assert all(not f.streams for f in pool._frontends)

    asyncio.run(scenario())


def test_a_front_end_killed_mid_stream_ends_the_stream_with_an_engine_death():
    async def scenario() -> None:
        async with fake_frontends(2) as pool:
            stream = await pool.respond(CHAT, online_body(stream=True, stream_hold=True))
            await anext(stream)
            [serving] = [f for f in pool._frontends if f.streams]
            os.kill(serving.process.pid, signal.SIGKILL)
            with pytest.raises(EngineDead):
                await asyncio.wait_for(anext(stream), 30)
            answer = await pool.respond(CHAT, online_body())  # the other front end still answers
            assert answer[0] == 200

    asyncio.run(scenario())


def test_a_slow_reader_holds_a_stream_back_in_its_front_end():
    length = 4 * frontends.STREAM_ROOM

    async def scenario() -> list[str]:
        async with fake_frontends(1) as pool:
            stream = await pool.respond(CHAT, online_body(stream=True, max_tokens=length))
            first = await anext(stream)
            await until(lambda: len(stream._chunks) == frontends.STREAM_ROOM - 1)
            assert await pool.is_alive()  # a round trip to the front end, which sends nothing more meanwhile
            assert len(stream._chunks) == frontends.STREAM_ROOM - 1
            return [first, *[chunk async for chunk in stream]]

    chunks = asyncio.run(scenario())
    assert chunks == asyncio.run(in_one_process(CHAT, online_body(stream=True, max_tokens=length)))
