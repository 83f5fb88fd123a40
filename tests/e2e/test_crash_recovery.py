"""Fault injection against the real service (CPU vLLM): `kill -9` of vbatch at every stage of a batch (a killed
engine, a poison line and SIGTERM are in tests/e2e/test_engine_death.py, so that the two long tests can run on two
workers). Each test starts its own servers on one data directory; the openai SDK is the client.

What must hold after any of them: the batch ends, every custom_id is in the output or error file exactly once,
lines a client saw in partial_output before a kill are in the final file exactly as first written (same ids, same
`created`: they were not run again), counts and usage add up, and nothing is left in the files directory that no
file object owns.
"""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Literal

import httpx
import pytest
from openai import OpenAI

from app.testing import VbatchServer, free_port
from tests.e2e.conftest import MODEL, engine_flags
from tests.helpers import holding

STARTUP_SECONDS = 900
ENV = {"VBATCH_MAX_IN_FLIGHT": "8", "VBATCH_PROGRESS_LOG_SECONDS": "2"}


class Lineage:
    """Servers started one after another on the same data directory."""

    def __init__(self, base: Path, model_path: Path) -> None:
        self.base = base
        self.data_dir = base / "data"
        self.flags = engine_flags(model_path)
        self.starts = 0
        self.server: VbatchServer | None = None
        self.data_dir.mkdir(parents=True, exist_ok=True)

    def start(
        self,
        failpoint: str | None = None,
        *,
        wait: Literal["engine", "api", "none"] = "engine",
        role: Literal["serve", "api"] = "serve",
        env: dict[str, str] | None = None,
    ) -> VbatchServer:
        """`wait`: until the engine is ready, until the API answers (what needs no engine goes on while it starts),
        or not at all. `role` "api": `vbatch api` on the same files, the same HTTP code with no engine to start (a
        stage that needs the API alone spends no engine start)."""
        self.starts += 1
        env = {**ENV, **(env or {}), **({"VBATCH_FAILPOINT": failpoint} if failpoint else {})}
        log = self.base / f"serve-{self.starts}.log"
        flags = self.flags if role == "serve" else []
        self.server = VbatchServer(self.data_dir, free_port(), flags, log, env=env, role=role)
        if wait != "none":
            self.server.wait_ready(timeout=STARTUP_SECONDS, engine=wait == "engine")
        return self.server

    def client(self) -> OpenAI:
        assert self.server is not None
        return OpenAI(base_url=f"{self.server.base_url}/v1", api_key="e2e", max_retries=0, timeout=60)

    def partial(self, batch_id: str, kind: str = "output") -> list[dict]:
        assert self.server is not None
        url = f"{self.server.base_url}/v1/batches/{batch_id}/partial_output"
        response = httpx.get(url, params={"kind": kind}, timeout=30)
        assert response.status_code == 200, response.text
        return [json.loads(line) for line in response.content.splitlines()]

    def wait_partial(self, batch_id: str, at_least: int, timeout: float = 300) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = self.partial(batch_id)
            if len(lines) >= at_least:
                return lines
            time.sleep(0.2)
        raise AssertionError(f"partial output of {batch_id} never reached {at_least} lines")

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def request_lines(count: int, *, poison: int | None = None, model: str = MODEL) -> bytes:
    lines = []
    for i in range(count):
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"Write one sentence about the number {i}."}],
            "max_tokens": 12,
        }
        if i == poison:
            body["user"] = "vbatch-poison"
        lines.append({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def create(client: OpenAI, content: bytes) -> str:
    source = client.files.create(file=("in.jsonl", content), purpose="batch")
    return client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h").id


def wait_done(client: OpenAI, batch_id: str, timeout: float = 600):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.5)
    raise AssertionError(f"{batch_id} did not end in {timeout} s")


def results(client: OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).content.splitlines()]


def check_exactly_once(client: OpenAI, batch, count: int, seen_before_kills: list[dict]) -> list[dict]:
    outputs = results(client, batch.output_file_id)
    errors = results(client, batch.error_file_id)
    ids = Counter(line["custom_id"] for line in outputs + errors)
    assert ids == Counter(f"req-{i}" for i in range(count))
    assert batch.request_counts.total == count
    assert batch.request_counts.completed == len(outputs) and batch.request_counts.failed == len(errors)
    by_custom_id = {line["custom_id"]: line for line in outputs}
    for line in seen_before_kills:
        assert by_custom_id[line["custom_id"]] == line  # same id, request_id, created, text: not run again
    usage = [line["response"]["body"]["usage"] for line in outputs]
    assert batch.usage.input_tokens == sum(u["prompt_tokens"] for u in usage)
    assert batch.usage.output_tokens == sum(u["completion_tokens"] for u in usage)
    return outputs


def owned_files(client: OpenAI) -> set[str]:
    return {f.id for f in client.files.list()}


def test_kill_9_at_every_stage_loses_and_repeats_nothing(lineage):
    count = 24
    # Stages 1 and 2 need the API alone: the first is `vbatch api` on the same files, with no engine to start; the
    # second a `vbatch serve` killed while its engine still starts (its start sweeps the first's debris).
    # 1. Killed while an upload's bytes are on disk but its row is not: no file object, no debris after restart.
    server = lineage.start(failpoint="upload_saved", wait="api", role="api")
    with pytest.raises(httpx.HTTPError):
        httpx.post(
            f"{server.base_url}/v1/files",
            files={"file": ("torn.jsonl", request_lines(count))},
            data={"purpose": "batch"},
            timeout=60,
        )
    server.wait_exit(timeout=60)
    assert len(list((lineage.data_dir / "files").iterdir())) == 1  # the torn upload's bytes

    # 2. Killed right after the batch is created, while it is validating.
    lineage.start(wait="api")
    client = lineage.client()
    assert owned_files(client) == set()
    assert list((lineage.data_dir / "files").iterdir()) == []
    batch_id = create(client, request_lines(count))
    lineage.server.kill()

    # 3. Killed in the middle of the run; lines seen in partial_output must survive as they are. Held, each start
    # sends at most 8 new lines, so it cannot reach the end of the 24 however fast it runs.
    with holding(lineage.data_dir):
        lineage.start(failpoint="hold_after:8")
        seen = lineage.wait_partial(batch_id, at_least=2)
        lineage.server.kill()
        # 4. The restart resumes from the checkpoint, and once let go finishes the run and is killed while
        # finalizing: result files linked, the batch row not yet final. (A resumed run's own checkpoint resumed
        # again: tests/integration/test_restart.py, on the fake engine.)
        server = lineage.start(failpoint="hold_after:8,results_linked")
        seen = lineage.wait_partial(batch_id, at_least=len(seen) + 8)
        assert len(seen) < count
    assert server.wait_exit(timeout=STARTUP_SECONDS) == -signal.SIGKILL
    assert "failpoint results_linked" in server.log_path.read_text()

    lineage.start()
    client = lineage.client()
    batch = wait_done(client, batch_id)
    assert batch.status == "completed"
    check_exactly_once(client, batch, count, seen)
    owned = owned_files(client)
    on_disk = {p.name for p in (lineage.data_dir / "files").iterdir()}
    assert on_disk == owned == {batch.input_file_id, batch.output_file_id}
