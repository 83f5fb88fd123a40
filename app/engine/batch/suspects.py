"""The lines an engine death took with it, re-run before any other: a group at a time with nothing else in flight;
a group that kills the engine again is split, down to single lines, and a line that kills it alone
`engine_deaths_per_line` times goes to the error file (`engine_crashed`) rather than run again."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable

from app.domain.input_index import InputIndex
from app.domain.results import error_outcome
from app.engine.batch.context import Context
from app.engine.batch.parts import ResultSink
from app.engine.inference.serving import EngineDead
from app.engine.sharing.execution import Executor

log = logging.getLogger("vbatch.runner")

ENGINE_CRASH_CODE = "engine_crashed"
# Lines in flight at an engine death are re-run in this many groups, one group at a time.
SUSPECT_FANOUT = 8

# Runs these lines of the batch (by position) through this executor, the engine's alone.
RunAlone = Callable[[list[int], Executor], Awaitable[None]]


class Suspects:
    def __init__(self, ctx: Context, batch_id: str, index: InputIndex, sink: ResultSink, run_alone: RunAlone) -> None:
        self.engine = ctx.engine
        self.deaths_per_line = ctx.settings.engine_deaths_per_line
        self.batch_id = batch_id
        self.index = index
        self.sink = sink
        self.run_alone = run_alone
        self.deaths_alone: dict[int, int] = {}

    async def rerun(self, suspects: list[int]) -> None:
        """Re-run `suspects` (positions), each group isolated, until each has its result."""
        queue = deque(_split(suspects))
        while queue:
            group = [n for n in queue.popleft() if n not in self.sink.done]
            if not group:
                continue
            generation = self.engine.generation
            try:
                async with self.engine.isolated() as executor:
                    await self.run_alone(group, executor)
            except EngineDead:
                await self.engine.recover(generation)
                unfinished = [n for n in group if n not in self.sink.done]
                if len(unfinished) == 1:
                    self._blame(unfinished[0], queue)
                else:
                    queue.extendleft(reversed(_split(unfinished)))

    def _blame(self, position: int, queue: deque[list[int]]) -> None:
        deaths = self.deaths_alone.get(position, 0) + 1
        self.deaths_alone[position] = deaths
        if deaths < self.deaths_per_line:
            queue.appendleft([position])
            return
        log.error(
            "batch %s: line %d killed the engine %d times on its own; it goes to the error file",
            self.batch_id,
            self.index.numbers[position],
            deaths,
        )
        message = f"The engine died {deaths} times while running this request alone; it was not retried."
        self.sink.record(position, error_outcome(self.index.custom_ids[position], ENGINE_CRASH_CODE, message))


def _split(numbers: list[int]) -> list[list[int]]:
    size = -(-len(numbers) // SUSPECT_FANOUT)
    return [numbers[i : i + size] for i in range(0, len(numbers), size)]
