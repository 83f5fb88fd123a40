"""A fake engine for API-layer unit tests: the real loop, runner, storage and SQLite, with an executor that
answers like a tiny chat model. Never the only proof that a feature works (see tests/e2e)."""

from __future__ import annotations

import asyncio

from app.engine.execution import EngineDead
from app.engine.service import EngineService

MODEL = "fake-model"


class FakeExecutor:
    def __init__(self) -> None:
        self.calls = 0
        self.bodies: list[dict] = []
        # Calls after the first `answer_first` wait until the test sets `gate` (forever if it never does).
        self.answer_first: int | None = None
        self.gate = asyncio.Event()

    async def execute(self, endpoint: str, body: dict) -> tuple[int, dict]:
        self.calls += 1
        self.bodies.append(body)
        if self.answer_first is not None and self.calls > self.answer_first:
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                # As vLLM's handlers do: an aborted request comes back as an error body, not an exception.
                return 400, {
                    "error": {"message": "Client disconnected", "type": "BadRequestError", "param": None, "code": 400}
                }
        if body.get("seed") == 1:  # as a seeded request kills the CPU engine (FACTS)
            raise EngineDead("engine core died")
        if body.get("max_tokens", 1) < 0:
            return 400, {
                "error": {
                    "message": "max_tokens must be positive",
                    "type": "BadRequestError",
                    "param": "max_tokens",
                    "code": 400,
                }
            }
        text = "ok"
        return 200, {
            "id": f"chatcmpl-{self.calls}",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", MODEL),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {
                "prompt_tokens": 5,
                "completion_tokens": 1,
                "total_tokens": 6,
                "prompt_tokens_details": {"cached_tokens": 2},
            },
        }


class FakeEngineService(EngineService):
    def __init__(self) -> None:
        super().__init__(None, MODEL)
        self.executor = FakeExecutor()
        self.starts = 0
        self.fail_restarts = False

    async def _start_engine(self):
        self.starts += 1
        if self.starts > 1 and self.fail_restarts:
            raise RuntimeError("engine start failed")
        self.served_models = [MODEL]
        self.serving = _FakeServing(self.executor)
        return self.serving

    async def _stop_engine(self) -> None:
        pass


class _FakeServing:
    max_num_seqs = 4

    def __init__(self, executor: FakeExecutor) -> None:
        self.executor = executor
        self.alive = True  # a test sets it False to stand for an engine that died while idle

    async def is_alive(self) -> bool:
        return self.alive

    async def execute(self, endpoint: str, body: dict) -> tuple[int, dict]:
        return await self.executor.execute(endpoint, body)
