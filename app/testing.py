"""What tests, the demo and the benchmarks share: a fake engine for fast tests of everything around the engine, and
a harness that runs a real `vbatch serve` in a process of its own (as procrastinate ships `procrastinate.testing`).

The fake engine is never the only proof that a feature works: the end-to-end tests run the real one.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx

from app.domain.adapters import Adapter
from app.domain.estimates import SCORING, PromptCount, cached_prefix_tokens, scored_texts
from app.domain.openai_errors import openai_error, unknown_argument
from app.engine.inference import frontends
from app.engine.inference.arguments import openai_arguments
from app.engine.inference.serving import EngineDead, EngineStep, StepListener, Stream

FAKE_MODEL = "fake-model"


class FakeExecutor:
    """Answers like a tiny chat model. `seed: 1` kills it, as a seeded request kills the CPU engine (FACTS.md);
    `stall: true` is never answered, as under an engine core that died without a word. An online request that asks
    `stream` gets vLLM's chunks (`stream`); with `stream_hold: true` its stream stops after the first chunk, for
    ever, and with `stream_dies: true` the engine dies there."""

    def __init__(self) -> None:
        self.calls = 0
        self.generated = 0  # completion tokens answered so far
        self.preemptions = 0  # what the engine's preemption counter says: the fake preempts nothing unless told
        self.bodies: list[dict] = []
        self.ranks: list[int | None] = []  # the data-parallel rank each call was pinned to
        # Calls after the first `answer_first` wait until the test sets `gate` (forever if it never does).
        self.answer_first: int | None = None
        self.gate = asyncio.Event()
        # Called with each body just before its answer is returned, on a thread (it may use the database), awaited.
        self.before_answer: Callable[[dict], None] | None = None
        # Each answer takes this long (a process of its own has no other way to be slow).
        self.seconds_per_answer = float(os.environ.get("VBATCH_FAKE_SECONDS_PER_ANSWER", "0"))
        # While `hold_streams` is set, a stream stops after its first chunk until the test sets `stream_gate`.
        self.hold_streams = False
        self.stream_gate = asyncio.Event()
        # The bodies of requests cancelled, or streams closed, before their end: what vLLM would have aborted.
        self.aborted: list[dict] = []
        self.streamed_chunks = 0  # chunks the streams have yielded so far
        # Each answer is reported as an engine step of its prompt and output (`FakeServing.step`), as vLLM's iteration
        # details report the steps of the real engine.
        self.report_steps = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def open_gate(self, gate: asyncio.Event | None = None) -> None:
        """Set `gate` (the answers' gate unless named) from any thread: the fake's loop is woken, not just flagged."""
        event = self.gate if gate is None else gate
        loop = self._loop
        if loop is None or loop.is_closed():
            event.set()
        else:
            loop.call_soon_threadsafe(event.set)

    async def respond(self, endpoint: str, body: dict) -> tuple[int, dict] | Stream:
        self._loop = asyncio.get_running_loop()
        if not body.get("stream") or endpoint not in _STREAMED:
            return await self.execute(endpoint, body)
        self.calls += 1
        self.bodies.append(body)
        if body.get("seed") == 1:
            raise EngineDead("engine core died")
        if _negative_max_tokens(body):  # as vLLM: a streamed body it refuses is answered as JSON
            return 400, _error_body("max_tokens must be positive", "BadRequestError", "max_tokens")
        return self.stream(endpoint, body)

    async def stream(self, endpoint: str, body: dict) -> Stream:
        """The server-sent events `vllm serve` streams for "ok": the first chunk, then (unless held) the rest."""
        ended = False
        try:
            chunks = _stream_chunks(endpoint, body)
            self.streamed_chunks += 1
            yield _event(next(chunks))
            await self._hold(body)
            for chunk in chunks:
                self.streamed_chunks += 1
                yield _event(chunk)
            self.generated += 1
            yield "data: [DONE]\n\n"
            ended = True
        finally:
            if not ended:
                self.aborted.append(body)
                if isinstance(body.get("abort_marker"), str):  # seen from another process (front ends)
                    Path(body["abort_marker"]).touch()

    async def _hold(self, body: dict) -> None:
        if body.get("stream_hold") is True:
            await asyncio.Event().wait()
        if body.get("stream_dies") is True:
            raise EngineDead("engine core died mid-stream")
        if self.hold_streams:
            await self.stream_gate.wait()

    async def execute(self, endpoint: str, body: dict, rank: int | None = None) -> tuple[int, dict]:
        self.calls += 1
        self.bodies.append(body)
        self.ranks.append(rank)
        if self.answer_first is not None and self.calls > self.answer_first:
            self._loop = asyncio.get_running_loop()
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                self.aborted.append(body)
                # As vLLM's handlers do: an aborted request comes back as an error body, not an exception.
                return 400, _error_body("Client disconnected", "BadRequestError", None)
        if body.get("seed") == 1:
            raise EngineDead("engine core died")
        if body.get("stall") is True:
            await asyncio.Event().wait()
        if _negative_max_tokens(body):
            return 400, _error_body("max_tokens must be positive", "BadRequestError", "max_tokens")
        if body.get("server_error") is True:  # what vLLM answers when its handler raises
            return 500, _error_body("the handler failed", "InternalServerError", None, code=500)
        if self.seconds_per_answer:
            await asyncio.sleep(self.seconds_per_answer)
        if self.before_answer is not None:
            await asyncio.to_thread(self.before_answer, body)
        if endpoint in SCORING:
            return 200, _scores(endpoint, body)
        self.generated += 1
        return 200, {
            "id": f"chatcmpl-{zlib.crc32(json.dumps(body, sort_keys=True).encode())}",  # the same in any process
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", FAKE_MODEL),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "usage": {
                "prompt_tokens": 5,
                "completion_tokens": 1,
                "total_tokens": 6,
                "prompt_tokens_details": {"cached_tokens": 2},
            },
        }


# What the fake answers as a chat model does (it answers each with a chat completion), and as a scoring model.
GENERATIVE_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")

FAKE_PAIR_TOKENS = 5  # the prompt tokens of each (query, document) pair a fake score counts


def _scores(endpoint: str, body: dict) -> dict:
    """vLLM's score or rerank answer: a score for each document (`text_2`, `documents`, ...) against the query, from
    its text, so the same pair always scores the same; usage counts prompt tokens only, as vLLM's does."""
    documents: object = next((body[key] for key in ("text_2", "documents", "items", "data_2") if key in body), [])
    documents = documents if isinstance(documents, list) else [documents]
    scores = [zlib.crc32(json.dumps(document).encode()) / 2**32 for document in documents]
    tokens = FAKE_PAIR_TOKENS * len(documents)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    request_id = zlib.crc32(json.dumps(body, sort_keys=True).encode())
    head = {"id": f"score-{request_id}", "model": body.get("model", FAKE_MODEL)}
    if endpoint == "/v1/score":
        data = [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)]
        return {**head, "object": "list", "created": 0, "data": data, "usage": usage | {"completion_tokens": 0}}
    ranked = sorted(range(len(documents)), key=lambda i: -scores[i])[: body.get("top_n") or None]
    results = [{"index": i, "document": {"text": documents[i]}, "relevance_score": scores[i]} for i in ranked]
    return {**head, "usage": usage, "results": results}


def _error_body(message: str, kind: str, param: str | None, code: int = 400) -> dict:
    """vLLM's refusal (its exception's class as `kind`, the HTTP status as `code`) as the real serving layer passes it
    on: in OpenAI's words (`app.vllm_adapter.ServingLayer`)."""
    return {"error": openai_error(code, {"message": message, "type": kind, "param": param, "code": code})}


_STREAMED = ("/v1/chat/completions", "/v1/completions")
FAKE_TEXT = "ok"


def _stream_chunks(endpoint: str, body: dict) -> Iterator[dict]:
    """vLLM's chunks for the text "ok" (or `max_tokens` characters of "okok..."), a token a chunk: chat's begin
    with the role; the last names the finish reason, followed by the usage when `stream_options.include_usage`
    asks."""
    chat = endpoint == "/v1/chat/completions"
    limit = body.get("max_tokens")
    text = FAKE_TEXT if not isinstance(limit, int) else (FAKE_TEXT * limit)[:limit]
    head = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{zlib.crc32(json.dumps(body, sort_keys=True).encode())}",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": 0,
        "model": body.get("model", FAKE_MODEL),
    }

    def choice(text: str | None, finish_reason: str | None) -> dict:
        if not chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        delta = {} if text is None else {"content": text}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    if chat:
        yield {**head, "choices": [{**choice("", None), "delta": {"role": "assistant", "content": ""}}]}
    for token in text:
        yield {**head, "choices": [choice(token, None)]}
    yield {**head, "choices": [choice(None, "stop" if text == FAKE_TEXT else "length")]}
    if (body.get("stream_options") or {}).get("include_usage"):
        usage = {"prompt_tokens": 5, "completion_tokens": len(text), "total_tokens": 5 + len(text)}
        yield {**head, "choices": [], "usage": usage}


def _event(chunk: dict) -> str:
    return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"


def _negative_max_tokens(body: dict) -> bool:
    """What the fake refuses of `max_tokens`; another type (a string of digits, null) passes, as vLLM's lax request
    model takes it."""
    limit = body.get("max_tokens")
    return isinstance(limit, int) and not isinstance(limit, bool) and limit < 0


def fake_tokens(body: dict, endpoint: str = "/v1/chat/completions") -> list[str] | None:
    """The fake's tokenizer: a prompt's whitespace-separated words (each message's, for a chat; each scored text's,
    for a scoring line); None for a body without a text prompt, as the real one cannot count a body its handler
    refuses."""
    if endpoint in SCORING:
        texts = scored_texts(endpoint, body)
        return None if texts is None else [word for text in texts for word in text.split()]
    messages = body.get("messages")
    if isinstance(messages, list):
        return [word for m in messages if isinstance(m, dict) for word in str(m.get("content", "")).split()]
    prompt = body.get("prompt", body.get("input"))
    return prompt.split() if isinstance(prompt, str) else None


def fake_token_count(body: dict, endpoint: str = "/v1/chat/completions") -> int | None:
    tokens = fake_tokens(body, endpoint)
    return None if tokens is None else len(tokens)


# The fake's prefix cache blocks, in words (vLLM's are 16 tokens).
FAKE_BLOCK_SIZE = 4


class FakeServing:
    max_num_seqs = 4
    data_parallel_size = 1

    def __init__(
        self,
        executor: FakeExecutor,
        scheduling_policy: str = "priority",
        adapters: Sequence[str] = (),
        model: str = FAKE_MODEL,
        max_lora_rank: int | None = None,
        max_loras: int | None = None,
        endpoints: Sequence[str] = GENERATIVE_ENDPOINTS,
        arguments: Mapping[str, frozenset[str]] | None = None,
    ) -> None:
        self.executor = executor
        self.endpoints = tuple(endpoints)
        self.arguments = arguments
        self.adapters = [Adapter(name=name, parent=model, root=f"/adapters/{name}") for name in adapters]
        self.served_models = [model, *adapters]
        self.engine_config: dict[str, object] = {
            "max_model_len": 2048,
            "max_num_seqs": self.max_num_seqs,
            "enable_prefix_caching": True,
            "data_parallel_size": self.data_parallel_size,
            "scheduling_policy": scheduling_policy,
        }
        if max_lora_rank is not None:  # as vLLM's with --enable-lora (`vllm_adapter._engine_config`)
            self.engine_config.update(enable_lora=True, max_lora_rank=max_lora_rank)
        if max_loras is not None:  # as vLLM's engine config has it only with LoRA on
            self.engine_config["max_loras"] = max_loras
        self.alive = True  # a test sets it False to stand for an engine that died while idle
        self._step_listener: StepListener | None = None

    async def is_alive(self) -> bool:
        return self.alive

    def generated_tokens(self) -> int | None:
        return self.executor.generated

    def metrics_text(self) -> bytes:
        return (
            b"# HELP fake_engine_requests Requests the fake engine answered.\n# TYPE fake_engine_requests counter\n"
            + (f"fake_engine_requests_total {self.executor.generated}\n".encode())
        )

    async def execute(self, endpoint: str, body: dict, rank: int | None = None) -> tuple[int, dict]:
        refused = self._refused(endpoint, body)
        if refused is not None:
            return refused
        answer = await self.executor.execute(endpoint, body, rank)
        if self.executor.report_steps:
            output = (answer[1].get("usage") or {}).get("completion_tokens") or 0
            self.step(EngineStep(0.001, fake_token_count(body, endpoint) or 0, output))
        return answer

    def _refused(self, endpoint: str, body: dict) -> tuple[int, dict] | None:
        """What the real serving layer refuses before its handler runs: an endpoint the model has no handler for,
        and (where the fake is given the arguments its endpoints take) an argument no one takes."""
        if endpoint not in self.endpoints:
            return self._cannot_answer(endpoint)
        if self.arguments is None:
            return None
        unknown = unknown_argument(body, self.arguments.get(endpoint))
        return None if unknown is None else (400, {"error": unknown})

    def _cannot_answer(self, endpoint: str) -> tuple[int, dict]:
        """As the real serving layer answers an endpoint its model has no handler for (`vllm_adapter.ServingLayer`)."""
        message = f"The served model cannot answer {endpoint}; this engine answers {', '.join(self.endpoints)}."
        return 400, _error_body(message, "BadRequestError", None)

    def preemptions(self) -> int | None:
        return self.executor.preemptions

    def on_step(self, listener: StepListener) -> None:
        self._step_listener = listener

    def step(self, step: EngineStep) -> None:
        """The fake engine reports a step (a test stands for vLLM's iteration details)."""
        if self._step_listener is not None:
            self._step_listener(step)

    async def count_tokens(self, endpoint: str, bodies: list[dict]) -> list[PromptCount | None]:
        """As the real one counts: a scoring line's words, and no cache for them; the others' cached blocks of words."""
        tokens = [fake_tokens(body, endpoint) for body in bodies]
        prompts = [
            None if words is None or endpoint in SCORING else (body.get("model"), words)
            for body, words in zip(bodies, tokens, strict=True)
        ]
        cached = cached_prefix_tokens(prompts, FAKE_BLOCK_SIZE)
        return [
            None if words is None else PromptCount(len(words), hit) for words, hit in zip(tokens, cached, strict=True)
        ]

    async def respond(self, endpoint: str, body: dict) -> tuple[int, dict] | Stream:
        refused = self._refused(endpoint, body)
        if refused is not None:
            return refused
        return await self.executor.respond(endpoint, body)


# vLLM's own arguments the fake stands for: those vbatch itself adds to bodies, and two of vLLM's sampling extras.
FAKE_ENGINE_ARGUMENTS = frozenset({"priority", "cache_salt", "top_k", "repetition_penalty"})


def fake_arguments() -> dict[str, frozenset[str]]:
    """What the fake takes at each endpoint, as the real serving layer would: OpenAI's arguments and vLLM's."""
    found = {endpoint: openai_arguments(endpoint) for endpoint in GENERATIVE_ENDPOINTS}
    return {endpoint: (taken or frozenset()) | FAKE_ENGINE_ARGUMENTS for endpoint, taken in found.items()}


class FakeEngine:
    """An engine factory (`app.engine.inference.serving.EngineFactory`): every start serves from one shared executor, so
    a test sees all calls across restarts. It serves `model` and, `adapters`, names of LoRA adapters of it, at most
    `max_loras` at once (vLLM's `--max-loras`; the fake runs any number, a test watches what it is sent);
    `max_lora_rank`: the `--max-lora-rank` of LoRA enabled (None: its engine config does not say); `endpoints`: what
    its model answers (a scoring model's: `SCORING`), others get the real serving layer's 400; `arguments`: the
    top-level arguments each endpoint takes (`app.engine.inference.arguments`), others refused as the real serving layer
    refuses them (None: any taken, the fake's own switches such as `stall` included; `VBATCH_FAKE_ARGUMENTS=openai`
    in its process: `fake_arguments()`)."""

    def __init__(
        self,
        *,
        data_parallel_size: int = 1,
        scheduling_policy: str = "priority",
        adapters: Sequence[str] = (),
        model: str = FAKE_MODEL,
        max_lora_rank: int | None = None,
        max_loras: int | None = None,
        endpoints: Sequence[str] = GENERATIVE_ENDPOINTS,
        arguments: Mapping[str, frozenset[str]] | None = None,
    ) -> None:
        self.executor = FakeExecutor()
        self.endpoints = tuple(endpoints)
        if arguments is None and os.environ.get("VBATCH_FAKE_ARGUMENTS") == "openai":
            arguments = fake_arguments()
        self.arguments = arguments
        self.model = model
        self.adapters = list(adapters)
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self.data_parallel_size = data_parallel_size
        self.scheduling_policy = scheduling_policy  # vLLM's `--scheduling-policy` it stands for
        self.starts = 0
        self.fail_restarts = False
        self.serving: FakeServing | None = None

    @asynccontextmanager
    async def __call__(self) -> AsyncIterator[FakeServing]:
        self.starts += 1
        if self.starts > 1 and self.fail_restarts:
            raise RuntimeError("engine start failed")
        self.serving = FakeServing(
            self.executor,
            self.scheduling_policy,
            self.adapters,
            model=self.model,
            max_lora_rank=self.max_lora_rank,
            max_loras=self.max_loras,
            endpoints=self.endpoints,
            arguments=self.arguments,
        )
        self.serving.data_parallel_size = self.data_parallel_size
        yield self.serving


@asynccontextmanager
async def fake_frontends(
    count: int, adapters: Sequence[str] = (), report_steps: bool = False
) -> AsyncIterator[frontends.FrontendPool]:
    """An engine factory (`app.engine.inference.serving.EngineFactory`, with `functools.partial`): the fake engine's
    serving (with these LoRA adapters) in `count` front-end processes behind a `FrontendPool`, as `vbatch serve
    --api-server-count` runs vLLM's, and a process that stands for the engine core (kill it to kill the engine).
    `report_steps`: each front end reports an engine step per answer (`FakeExecutor.report_steps`)."""
    spawn = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="vbatch-fake-fe-") as folder:
        address = f"ipc://{folder}/pool"
        processes = [
            spawn.Process(target=_fake_frontend, args=(address, i, list(adapters), report_steps), daemon=True)
            for i in range(count)
        ]
        core = spawn.Process(target=_fake_engine_core, name="EngineCore", daemon=True)
        pool = frontends.FrontendPool(
            address=address,
            processes=processes,
            engine_processes=[core],
            max_num_seqs=FakeServing.max_num_seqs,
            data_parallel_size=1,
            generated_tokens=lambda: None,
            metrics_text=lambda: b"",
        )
        for process in [core, *processes]:
            process.start()
        try:
            await pool.open(timeout=120)
            yield pool
        finally:
            await pool.close()
            for process in [core, *processes]:
                process.kill()
                process.join()


def _fake_engine_core() -> None:
    signal.pause()


def _fake_frontend(address: str, index: int, adapters: list[str], report_steps: bool = False) -> None:
    executor = FakeExecutor()
    executor.report_steps = report_steps
    asyncio.run(frontends.serve(FakeServing(executor, adapters=adapters), address, index))


class VbatchServer:
    """`vbatch serve` in its own process group, so that stopping it stops the engine too."""

    def __init__(
        self,
        data_dir: Path,
        port: int,
        engine_args: list[str],
        log_path: Path,
        env: dict | None = None,
        *,
        fake_engine: bool = False,
        role: str = "serve",
        cwd: Path | None = None,
    ):
        """`fake_engine`: the same app and server options over `FakeEngine` (`python -m app.testing`); `role`:
        `serve`, `api` or `worker` (`app.main.Role`); `cwd`: the source tree whose `app` runs (`python -m` looks there
        first), for a bench that sets an earlier commit against this one."""
        self.base_url = f"http://127.0.0.1:{port}"
        self.data_dir = data_dir
        self.log_path = log_path
        self.log = log_path.open("wb")
        entry = ["app.testing", "--role", role] if fake_engine else ["app", role]
        command = [sys.executable, "-m", *entry, "--data-dir", str(data_dir), "--port", str(port)]
        self.started = time.monotonic()
        self.health_seen: set[str] = set()
        self.process = subprocess.Popen(
            command + engine_args,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
            cwd=cwd,
        )

    def wait_ready(self, timeout: float, *, engine: bool = True) -> float:
        """Seconds until /health says ok (`engine=False`: until it answers at all, the API up while the engine
        starts); every status it answered on the way is kept in `health_seen`."""
        deadline = self.started + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vbatch serve exited with {self.process.returncode}; see {self.log_path}")
            try:
                response = httpx.get(f"{self.base_url}/health", timeout=2)
                self.health_seen.add(response.json()["status"])
                if response.status_code == 200 or not engine:
                    return time.monotonic() - self.started
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vbatch serve was not ready in {timeout} s; see {self.log_path}")

    def kill(self) -> None:
        """`kill -9` of the service and its engine, as an out-of-memory killer or a lost machine would do."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.log.close()

    def wait_exit(self, timeout: float) -> int:
        code = self.process.wait(timeout=timeout)
        self.log.close()
        return code

    def engine_core_pids(self) -> list[int]:
        import psutil

        children = psutil.Process(self.process.pid).children(recursive=True)
        return [child.pid for child in children if "EngineCore" in child.name()]

    def frontend_pids(self) -> list[int]:
        """Front-end processes (`--api-server-count`): vLLM names them by the title vbatch gives them."""
        import psutil

        children = psutil.Process(self.process.pid).children(recursive=True)
        # The name is cut at 15 characters: "VLLM::VbatchFro".
        return [child.pid for child in children if "VbatchFro" in child.name()]

    def stop(self) -> None:
        if self.log.closed:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


def add_running_batches(db, count: int, prefix: str = "batch_test") -> list[str]:
    """`count` in-progress batch rows (no input behind them) straight into the database: claim tests and benches."""
    from app.core.db import session_scope
    from app.domain.lifecycle import BatchStatus
    from app.domain.models import BatchRow

    ids = [f"{prefix}{n:06d}" for n in range(count)]
    now = time.time_ns()
    with session_scope(db) as session:
        for n, batch_id in enumerate(ids):
            session.add(
                BatchRow(
                    id=batch_id,
                    created_ns=now + n,
                    endpoint="/v1/chat/completions",
                    input_file_id="file-none",
                    completion_window="24h",
                    status=BatchStatus.IN_PROGRESS,
                    created_at=now // 10**9,
                )
            )
        session.commit()
    return ids


class LocalPostgres:
    """A PostgreSQL server from PyPI (`pgserver`, a dev dependency) in `folder`, on a Unix socket: tests and
    benches get a fresh database from it in milliseconds."""

    def __init__(self, folder: Path) -> None:
        import pgserver

        self.folder = folder
        self.server = pgserver.get_server(folder, cleanup_mode="stop")
        self._count = 0
        self._migrated: str | None = None

    def new_database(self, *, migrated: bool = False) -> str:
        """The SQLAlchemy URL of a new database: empty, or `migrated` to the head revision (a copy of one migrated
        once, as Postgres copies a template: a test's app then starts without running every migration again)."""
        self._count += 1
        name = f"vbatch_{os.getpid()}_{self._count}"
        template = f" TEMPLATE {self._migrated_template()}" if migrated else ""
        self.server.psql(f"CREATE DATABASE {name}{template};")
        return self._url(name)

    def _migrated_template(self) -> str:
        if self._migrated is None:
            from app.core.migrate import upgrade_to_head

            name = f"vbatch_{os.getpid()}_head"
            self.server.psql(f"CREATE DATABASE {name};")
            upgrade_to_head(self._url(name))  # its engine disposed: a template must have no session open
            self._migrated = name
        return self._migrated

    def _url(self, name: str) -> str:
        return f"postgresql+psycopg://postgres@/{name}?host={self.folder}"

    def stop(self) -> None:
        self.server.cleanup()


class LocalPgBouncer:
    """Debian's PgBouncer (`make pgbouncer` installs it) in transaction mode in front of a `LocalPostgres`, on a free
    port of 127.0.0.1: how a fleet larger than Postgres's connections reaches it (`VBATCH_DATABASE_POOLER=
    transaction`). It holds at most `server_connections` connections to Postgres for any number of clients."""

    def __init__(self, folder: Path, postgres: LocalPostgres, server_connections: int = 20) -> None:
        binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        if not Path(binary).exists():
            raise RuntimeError("PgBouncer is missing: run `make pgbouncer` (Debian's package, installed as root)")
        self.port = free_port()
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o777)  # it runs as pgserver's user when we are root (it refuses to run as root)
        users = folder / "users.txt"
        users.write_text('"postgres" ""\n')
        config = folder / "pgbouncer.ini"
        config.write_text(
            f"[databases]\n* = host={postgres.folder} port=5432\n\n[pgbouncer]\nlisten_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\nunix_socket_dir =\nauth_type = trust\nauth_file = {users}\n"
            f"pool_mode = transaction\ndefault_pool_size = {server_connections}\nmax_client_conn = 5000\n"
            "ignore_startup_parameters = extra_float_digits,options\nlog_connections = 0\nlog_disconnections = 0\n"
            f"logfile = {folder / 'pgbouncer.log'}\npidfile = {folder / 'pgbouncer.pid'}\n"
        )
        for path in (users, config):
            path.chmod(0o644)
        user = ["-u", "pgserver"] if os.geteuid() == 0 else []
        self.process = subprocess.Popen(
            [binary, *user, str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + 30
        while not _accepts(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"PgBouncer did not start; see {folder / 'pgbouncer.log'}")
            time.sleep(0.05)

    def url(self, database_url: str) -> str:
        """`database_url` (one of its server's databases) reached through the pooler."""
        from sqlalchemy.engine import make_url

        direct = make_url(database_url)
        return direct.set(host="127.0.0.1", port=self.port, query={}).render_as_string(hide_password=False)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


def _accepts(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


class LocalS3:
    """An S3 server from PyPI (moto's server mode, a dev dependency) on a free port: tests and benches get a new
    `s3://` prefix of its bucket from it; `environ` holds the AWS_* variables that reach it (obstore reads them)."""

    BUCKET = "vbatch-test"

    def __init__(self, log_path: Path, timeout: float = 60.0) -> None:
        port = free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        self.log = log_path.open("wb")
        command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.environ = {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
            "AWS_ACCESS_KEY_ID": "vbatch",
            "AWS_SECRET_ACCESS_KEY": "vbatch-secret",
            "AWS_REGION": "us-east-1",
        }
        self._count = 0
        deadline = time.monotonic() + timeout
        while True:  # the bucket is made as soon as the server answers
            if self.process.poll() is not None:
                raise RuntimeError(f"moto's S3 server exited with {self.process.returncode}; see {log_path}")
            try:
                httpx.put(f"{self.endpoint}/{self.BUCKET}", timeout=2).raise_for_status()
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"moto's S3 server did not answer in {timeout} s; see {log_path}") from None
                time.sleep(0.1)

    def new_url(self) -> str:
        """A storage URL no one has used."""
        self._count += 1
        return f"s3://{self.BUCKET}/run-{os.getpid()}-{self._count}"

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=30)
        self.log.close()


def write_lora_adapter(folder: Path, base_model: Path, *, seed: int, rank: int, base_name: str | None = None) -> Path:
    """A PEFT LoRA adapter of `rank` on every layer's q_proj and v_proj, shaped from the base model's config.json,
    with small random weights: what vLLM loads by `--lora-modules` or at first use (answers need not make sense,
    only come from the adapter, and its speed does not depend on the weights). Shared by the LoRA tests and
    `bench/lora.py`."""
    import numpy
    from safetensors.numpy import save_file

    shape = json.loads((base_model / "config.json").read_text())
    hidden, layers = shape["hidden_size"], shape["num_hidden_layers"]
    head = shape.get("head_dim") or hidden // shape["num_attention_heads"]
    outs = {"q_proj": shape["num_attention_heads"] * head, "v_proj": shape.get("num_key_value_heads", 1) * head}
    folder.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": list(outs), "bias": "none",
              "base_model_name_or_path": base_name or str(base_model), "task_type": "CAUSAL_LM"}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config))
    random = numpy.random.default_rng(seed)
    tensors = {}
    for layer in range(layers):
        for name, out in outs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{prefix}.lora_A.weight"] = (random.standard_normal((rank, hidden)) * 0.01).astype(numpy.float32)
            tensors[f"{prefix}.lora_B.weight"] = (random.standard_normal((out, rank)) * 0.01).astype(numpy.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


# The seed's support-ticket workload, as the benchmarks (bench.compare, bench.gpu) and the estimate's end-to-end test
# run it: one system prompt, a one-line question a ticket, and the bench's sampling.
TICKET_SYSTEM = "You are a support analyst for a GPU cloud. Answer in at most three sentences."
TICKET_TOPICS = ("billing", "login", "latency", "data export", "permissions")
TICKET_SAMPLING = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "max_tokens": 256,
                   "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip


def ticket_prompts(count: int, first: int = 0) -> list[str]:
    return [
        f"A customer reports a problem with {TICKET_TOPICS[i % len(TICKET_TOPICS)]}. What is the most likely cause? "
        f"(ticket {i})"
        for i in range(first, first + count)
    ]


def write_ticket_batch(path: Path, count: int, *, model: str, sampling: dict, first: int = 0) -> None:
    """A batch input file of `count` tickets; `first`: the number of the first ticket, so that files of one run share
    no prompt."""
    with path.open("w") as out:
        for i, prompt in enumerate(ticket_prompts(count, first), start=first):
            messages = [{"role": "system", "content": TICKET_SYSTEM}, {"role": "user", "content": prompt}]
            body = {"model": model, "messages": messages, **sampling}
            out.write(json.dumps({"custom_id": f"ticket-{i}", "method": "POST", "url": "/v1/chat/completions",
                                  "body": body}) + "\n")  # fmt: skip


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fake_worker_app(argv: list[str]) -> tuple[Any, Any]:
    """`vbatch worker`'s app over the fake engine, settings from `VBATCH_*` (`argv` unused): what a Ray replica
    (`app.cluster.Replica`) runs in tests."""
    from app.core.config import Settings
    from app.engine.service import EngineService
    from app.main import Role, create_app

    settings = Settings()
    return create_app(settings, EngineService(FakeEngine()), Role.WORKER), settings


def serve_fake_engine(argv: list[str] | None = None) -> None:
    """`python -m app.testing --data-dir D --port P [--role R]`: `vbatch serve`'s (or `api`'s, or `worker`'s) app and
    server options over the fake engine, settings from `VBATCH_*` as usual: tests of everything but the engine, in
    processes of their own."""
    import argparse

    import uvicorn

    from app.core import logs
    from app.core.config import Settings
    from app.engine.online.view import EngineView, WorkersView
    from app.engine.service import EngineService
    from app.launch import check_fleet, server_options
    from app.main import Role, create_app

    parser = argparse.ArgumentParser(prog="python -m app.testing")
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--role", type=Role, default=Role.SERVE)
    args = parser.parse_args(argv)
    settings = Settings(data_dir=args.data_dir, port=args.port)
    logs.configure(settings.log_format)
    check_fleet(settings, args.role)
    engine: EngineView = WorkersView() if args.role == Role.API else EngineService(FakeEngine())
    uvicorn.run(create_app(settings, engine, args.role), **server_options(settings))


if __name__ == "__main__":
    serve_fake_engine()
