"""What the engine loop needs of an engine, and how it gets one: a `Serving` from an `EngineFactory`.

The real factory starts vLLM (`app.engine.inference.vllm_adapter.engine_factory`); tests pass a fake one
(`app.testing.FakeEngine`); failpoints wrap either (`poisoned`). The loop never knows which it has.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import NamedTuple, Protocol

from app.domain.adapters import Adapter
from app.domain.estimates import PromptCount
from app.domain.results import Body

log = logging.getLogger("vbatch.engine")


# Server-sent events as `vllm serve` writes them: each `data: {...}\n\n`, the last `data: [DONE]\n\n`.
Stream = AsyncIterator[str]


class EngineDead(Exception):
    """The engine process is gone; every request in flight failed with it."""


class EngineStep(NamedTuple):
    """One step of the engine as vLLM reports it (its iteration details): what the step computed and how long its
    model run took. Picklable: front-end processes send them to the pool."""

    seconds: float
    prefill_tokens: int  # prompt tokens computed (cached ones cost nothing and are not counted)
    decode_tokens: int
    kv_usage: float | None = None  # the share of the KV cache in use after the step
    kv_tokens: int | None = None  # the KV cache's size in tokens (None: unknown)


StepListener = Callable[[EngineStep], None]


class Serving(Protocol):
    """One live engine behind vLLM's OpenAI serving layer."""

    @property
    def max_num_seqs(self) -> int:
        """Per data-parallel rank."""
        ...

    @property
    def data_parallel_size(self) -> int: ...

    @property
    def served_models(self) -> list[str]:
        """The names a request's `model` may take: the base models first, then the LoRA adapters."""
        ...

    @property
    def adapters(self) -> list[Adapter]: ...

    @property
    def engine_config(self) -> dict[str, object]:
        """The engine settings an operator tunes (max_model_len, max_num_seqs, batched tokens, prefix caching,
        parallelism), by vLLM's names: what the console's engine page shows."""
        ...

    async def execute(self, endpoint: str, body: dict, rank: int | None = None) -> tuple[int, Body]:
        """(HTTP status, JSON body) as `vllm serve` would answer; raises EngineDead when the engine is gone.
        `rank`: the data-parallel rank to run it on (None: the engine's own balancing)."""
        ...

    async def respond(self, endpoint: str, body: dict) -> tuple[int, Body] | Stream:
        """An online request (`app.domain.online`), exactly as `vllm serve` answers it: (HTTP status, JSON body), or
        for a body that asks `stream` and is accepted, its server-sent events. Cancelling the call, or closing the
        stream before its end, aborts the request in the engine. Raises EngineDead when the engine is gone."""
        ...

    async def is_alive(self) -> bool: ...

    async def count_tokens(self, endpoint: str, bodies: list[dict]) -> list[PromptCount | None]:
        """Each body's prompt tokens as the serving layer would give them to the engine at `endpoint` (the served
        model's tokenizer, a chat's template applied); None for a body it cannot count. Off the engine's loop: in
        front-end processes, or a thread."""
        ...

    def generated_tokens(self) -> int | None:
        """Output tokens the engine has generated since it started, finished requests or not (None: unknown).
        Called from any thread."""
        ...

    def metrics_text(self) -> bytes:
        """The engine's own Prometheus series in text format, as `vllm serve`'s /metrics has them. Any thread."""
        ...

    def preemptions(self) -> int | None:
        """Running requests the engine has preempted since it started (vLLM's `vllm:num_preemptions`, summed over
        engines; None: unknown). Any thread."""
        ...

    def on_step(self, listener: StepListener) -> None:
        """`listener` hears of every engine step from now on, on the loop that runs the requests (the engine
        loop); an engine that reports no steps never calls it."""
        ...


# vLLM's `--scheduling-policy` under which request priorities order the engine's queue (vbatch's default).
PRIORITY_POLICY = "priority"


def schedules_by_priority(serving: Serving) -> bool:
    """Whether the engine orders requests by priority (an engine that does not say is taken to)."""
    return serving.engine_config.get("scheduling_policy", PRIORITY_POLICY) == PRIORITY_POLICY


def max_loras(serving: Serving) -> int | None:
    """LoRA adapters the engine runs at once (vLLM's `--max-loras`); None when it serves none."""
    value = serving.engine_config.get("max_loras")
    return int(value) if isinstance(value, int) and value > 0 else None


def engine_wave(serving: Serving) -> int:
    """Requests the engine runs at once: max_num_seqs on each data-parallel rank. The in-flight window is sized
    from it, so that extra ranks are fed as fully as the first."""
    return serving.max_num_seqs * max(1, serving.data_parallel_size)


def engine_devices(serving: Serving) -> int:
    return devices_of(serving.engine_config)


def devices_of(engine_config: dict[str, object]) -> int:
    """The GPUs one engine runs on: a model's copy on `tensor_parallel_size` of them, `data_parallel_size` copies
    (1 where its config does not say)."""
    devices = 1
    for name in ("tensor_parallel_size", "data_parallel_size"):
        size = engine_config.get(name)
        devices *= size if isinstance(size, int) and size > 0 else 1
    return devices


# Each call starts a new engine; leaving the context stops it.
EngineFactory = Callable[[], AbstractAsyncContextManager[Serving]]


def poisoned(factory: EngineFactory, poison_user: str) -> EngineFactory:
    """The poison failpoint: a request whose `user` is `poison_user` kills the engine core process before it runs,
    a real engine death, as an out-of-memory kill of the engine core would be."""

    @asynccontextmanager
    async def start() -> AsyncIterator[Serving]:
        async with factory() as serving:
            yield _Poisoned(serving, poison_user)

    return start


class _Poisoned:
    def __init__(self, serving: Serving, poison_user: str) -> None:
        self._serving = serving
        self._poison_user = poison_user

    @property
    def max_num_seqs(self) -> int:
        return self._serving.max_num_seqs

    @property
    def data_parallel_size(self) -> int:
        return self._serving.data_parallel_size

    @property
    def served_models(self) -> list[str]:
        return self._serving.served_models

    @property
    def adapters(self) -> list[Adapter]:
        return self._serving.adapters

    @property
    def engine_config(self) -> dict[str, object]:
        return self._serving.engine_config

    async def is_alive(self) -> bool:
        return await self._serving.is_alive()

    async def count_tokens(self, endpoint: str, bodies: list[dict]) -> list[PromptCount | None]:
        return await self._serving.count_tokens(endpoint, bodies)

    def generated_tokens(self) -> int | None:
        return self._serving.generated_tokens()

    def metrics_text(self) -> bytes:
        return self._serving.metrics_text()

    def preemptions(self) -> int | None:
        return self._serving.preemptions()

    def on_step(self, listener: StepListener) -> None:
        self._serving.on_step(listener)

    async def execute(self, endpoint: str, body: dict, rank: int | None = None) -> tuple[int, Body]:
        if body.get("user") == self._poison_user:
            _kill_engine_core()
        return await self._serving.execute(endpoint, body, rank)

    async def respond(self, endpoint: str, body: dict) -> tuple[int, Body] | Stream:
        if body.get("user") == self._poison_user:
            _kill_engine_core()
        return await self._serving.respond(endpoint, body)


def _kill_engine_core() -> None:
    import psutil

    for child in psutil.Process().children(recursive=True):
        if "EngineCore" in child.name():
            log.warning("failpoint poison: killing engine core pid %d", child.pid)
            child.kill()
