"""The result sink: a checkpoint cancelled in the middle of its write (the ticker that calls it is cancelled
whenever a batch's work ends) must not lose the lines it had taken from the buffers; a sink reopened after a
crash takes what its files hold as done, up to the checkpoint."""

from __future__ import annotations

import asyncio
import json

from app.domain.batches import Progress
from app.domain.results import http_outcome
from app.engine.batch.parts import Checkpoint, ResultSink


def test_a_cancelled_checkpoint_still_lands_its_lines(tmp_path):
    saved: list[Checkpoint] = []

    async def scenario() -> ResultSink:
        sink = ResultSink(tmp_path / "out.part", tmp_path / "err.part")
        await sink.open(output_bytes=0, error_bytes=0, position_of=dict)
        for position in range(6):
            sink.record(position, http_outcome(f"c{position}", 200, {"ok": position}))
        ticker = asyncio.create_task(sink.checkpoint(saved.append))
        await asyncio.sleep(0)  # the checkpoint has taken the buffers and is writing them
        ticker.cancel()
        await asyncio.gather(ticker, return_exceptions=True)
        await sink.checkpoint(saved.append)
        await sink.close()
        return sink

    sink = asyncio.run(scenario())
    written = [json.loads(line)["custom_id"] for line in sink.output.path.read_bytes().splitlines()]
    assert written == [f"c{n}" for n in range(6)]
    last = saved[-1]
    assert last.progress.completed == 6 and last.output_bytes == sink.output.path.stat().st_size


def test_a_reopened_sink_keeps_what_was_checkpointed_and_cuts_the_rest(tmp_path):
    positions = {f"c{n}": n for n in range(5)}
    saved: list[Checkpoint] = []

    async def first_run() -> None:
        sink = ResultSink(tmp_path / "out.part", tmp_path / "err.part")
        await sink.open(output_bytes=0, error_bytes=0, position_of=lambda: positions)
        sink.record(0, http_outcome("c0", 200, {"usage": {"completion_tokens": 3}}))
        sink.record(1, http_outcome("c1", 400, {"error": {}}))
        await sink.checkpoint(saved.append)
        sink.record(2, http_outcome("c2", 200, {}))
        await sink.output.flush()  # reached the file, but after the checkpoint: a crash now loses it
        await sink.close()

    async def second_run() -> ResultSink:
        sink = ResultSink(tmp_path / "out.part", tmp_path / "err.part")
        await sink.open(
            output_bytes=saved[-1].output_bytes, error_bytes=saved[-1].error_bytes, position_of=lambda: positions
        )
        await sink.close()
        return sink

    asyncio.run(first_run())
    resumed = asyncio.run(second_run())
    assert resumed.done == {0, 1}
    assert resumed.progress == Progress(completed=1, failed=1, output_tokens=3, longest_uncut_output=3)
