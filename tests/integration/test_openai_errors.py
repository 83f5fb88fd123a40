"""Engine refusals in OpenAI's words (`app.domain.openai_errors`), from what vLLM 0.32's serving layer answered the
issue's examples with (taken from the real CPU engine); the arguments the serving layer takes
(`app.engine.inference.arguments`) read from vLLM's own request models; and `vbatch api` answering what its worker's
engine answered (fake engines). The same refusals over HTTP with the real engine and the openai SDK are in
tests/e2e/test_openai_errors.py.

Through the app, a socket or a process here; the logic alone is in tests/unit/test_openai_errors.py."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from openai import OpenAI

from app.testing import FAKE_MODEL, VbatchServer, free_port

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


def vllm(message: str, param: str | None = None, kind: str = "BadRequestError", code: int = 400) -> dict:
    return {"message": message, "type": kind, "param": param, "code": code}


def test_the_arguments_taken_are_vllms_request_models_and_openais_own():
    pytest.importorskip("vllm")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    from app.engine.inference.arguments import known_arguments

    known = known_arguments(CHAT, ChatCompletionRequest)
    assert known is not None
    # vLLM's documented extras, OpenAI's arguments vLLM ignores, and the priority vbatch adds.
    taken = {"top_k", "repetition_penalty", "structured_outputs", "min_p", "chat_template_kwargs", "priority"}
    assert taken | {"store", "metadata", "service_tier", "model", "messages", "temperature"} <= known
    assert "foo" not in known


def test_vbatch_api_answers_a_refusal_as_the_worker_it_forwarded_to_does(tmp_path: Path):
    """The engine refuses (an unknown argument, a value it cannot take) and maps its refusal; a replica passes the
    worker's answer on: both answer the same, and the SDK raises the same error."""
    servers: dict[str, VbatchServer] = {}
    env = {"VBATCH_FAKE_ARGUMENTS": "openai"}
    try:
        for role in ("worker", "api"):  # the worker migrates the database
            log = tmp_path / f"{role}.log"
            servers[role] = VbatchServer(tmp_path / "data", free_port(), [], log, env, fake_engine=True, role=role)
            servers[role].wait_ready(timeout=120)
        answers = {}
        for role, server in servers.items():
            client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=30)
            for case, extra in (("unknown", {"foo": 1}), ("negative", {"max_tokens": -1})):
                with pytest.raises(openai.BadRequestError) as refused:
                    client.chat.completions.create(model=FAKE_MODEL, messages=HI, extra_body=extra)
                answers[role, case] = (refused.value.code, refused.value.param, refused.value.body)
    finally:
        for server in servers.values():
            server.stop()
    assert answers["api", "unknown"] == answers["worker", "unknown"]
    assert answers["api", "unknown"][:2] == ("unknown_parameter", "foo")
    assert answers["api", "negative"] == answers["worker", "negative"]
    assert answers["api", "negative"][:2] == ("invalid_value", "max_tokens")
