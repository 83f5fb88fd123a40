"""Keys and tenants on the real server through the SDK, and what its log must never hold: keys and prompt text."""

from __future__ import annotations

import secrets

import openai
import pytest

from tests.e2e.conftest import KEYS
from tests.e2e.helpers import chat_line, lines_of, submit, wait_terminal


def test_tenants_are_apart_and_the_log_holds_no_key_or_prompt(server, openai_client, other_tenant):
    marker = f"zebra{secrets.token_hex(6)}"
    lines = [chat_line(f"p{i}", f"Repeat after me: {marker}") for i in range(2)]
    done = wait_terminal(openai_client, submit(openai_client, lines).id)
    assert done.status == "completed" and len(lines_of(openai_client, done.output_file_id)) == 2

    with pytest.raises(openai.NotFoundError):
        other_tenant.batches.retrieve(done.id)
    with pytest.raises(openai.NotFoundError):
        other_tenant.files.content(done.output_file_id)
    with pytest.raises(openai.NotFoundError):
        other_tenant.batches.cancel(done.id)
    assert done.id not in {b.id for b in other_tenant.batches.list()}
    assert done.input_file_id not in {f.id for f in other_tenant.files.list()}
    stranger = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="sk-not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.batches.list()

    log = server.log_path.read_text(errors="replace")
    assert done.id in log  # the right log, and it says what happened
    for secret in (*KEYS, "sk-not-a-key", marker):
        assert secret not in log
