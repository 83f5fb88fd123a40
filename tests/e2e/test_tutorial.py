"""The docs' tutorial, run as written: every bash block of docs/tutorial.md in order in one shell, each python block
with a title written to its file first, against the shared real `vbatch serve` (CPU engine), the one way a reader
would run them (curl, python3, `.venv/bin/python`). Blocks a reader runs that a test cannot (`make setup`, starting
the server, pointing at it) are marked `<!-- not run: why -->` on the page; the test names which they may be."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.e2e.conftest import KEYS, MODEL, ROOT

PAGE = ROOT / "docs" / "tutorial.md"
BLOCK = re.compile(r"(?:<!-- not run: (?P<why>.*?) -->\n)?```(?P<lang>\w+)(?P<info>[^\n]*)\n(?P<body>.*?)\n```", re.S)
TITLE = re.compile(r'title="(?P<name>[^"]+)"')
# The commands a test cannot run as a reader does: it runs `make setup` before any test, and drives the server that
# tests/e2e share, started with its own keys, whose address and key it sets itself.
NOT_RUN = ("make setup", "VBATCH_API_KEYS=sk-tutorial .venv/bin/vbatch serve", "export VBATCH=")


@dataclass(frozen=True)
class Block:
    lang: str
    body: str
    file: str | None  # a python block's title: the file a reader saves it as
    not_run: str | None


def blocks(text: str) -> list[Block]:
    found = []
    for match in BLOCK.finditer(text):
        title = TITLE.search(match["info"])
        found.append(Block(match["lang"], match["body"], title["name"] if title else None, match["why"]))
    return found


def runnable(page: list[Block]) -> list[Block]:
    return [block for block in page if block.lang == "bash" and block.not_run is None]


def script(runs: list[Block]) -> str:
    """The bash blocks, in order in one shell (a block's variables are the next one's), each block's output kept in
    `.out-N` and each announced on stderr, so that a failure says which block it was."""
    parts = ["set -euo pipefail"]
    for number, block in enumerate(runs):
        parts += [
            f"echo {shlex.quote(f'=== block {number}: {block.body.splitlines()[0][:60]}')} >&2",
            f"{{\n{block.body}\n}} > .out-{number}",
        ]
    return "\n".join(parts) + "\n"


def output_of(folder: Path, runs: list[Block], command: str) -> str:
    """What the one block that holds `command` printed."""
    [number] = [number for number, block in enumerate(runs) if command in block.body]
    return (folder / f".out-{number}").read_text()


def test_the_page_runs_every_command_but_those_it_names(tmp_path):
    page = blocks(PAGE.read_text())
    skipped = [block.body for block in page if block.not_run is not None]
    assert len(skipped) == len(NOT_RUN) and all(
        body.startswith(command) for body, command in zip(skipped, NOT_RUN, strict=True)
    ), skipped
    assert all(block.not_run.strip() for block in page if block.not_run is not None)
    assert {block.lang for block in page} <= {"bash", "python"}, "a block this test would not run"
    assert [block.file for block in page if block.lang == "python"] == ["first_batch.py", "live.py"]


def test_the_tutorial_as_written_against_the_real_engine(server, openai_client, tmp_path):
    page = blocks(PAGE.read_text())
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")  # the page runs from the repository, where .venv is
    for block in page:
        if block.file:
            (tmp_path / block.file).write_text(block.body + "\n")
    env = {
        **os.environ,
        "VBATCH": server.base_url,
        "OPENAI_BASE_URL": f"{server.base_url}/v1",
        "OPENAI_API_KEY": KEYS[0],
    }
    runs = runnable(page)
    ran = subprocess.run(
        ["bash", "-c", script(runs)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert ran.returncode == 0, ran.stderr[-4000:]

    sent = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    ids = sorted(line["custom_id"] for line in sent)
    assert all(line["body"]["model"] == MODEL for line in sent)
    assert json.loads(output_of(tmp_path, runs, "/health"))["status"] == "ok"
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert sorted(result["custom_id"] for result in results) == ids
    assert all(result["response"]["status_code"] == 200 for result in results)
    assert all(result["response"]["body"]["choices"][0]["message"]["content"] for result in results)
    assert openai_client.batches.retrieve(json.loads((tmp_path / "batch.json").read_text())["id"]).status == "completed"

    sdk = output_of(tmp_path, runs, "first_batch.py")
    followed = re.search(r"follow it at (\S+)/console/batches/(batch_\w+)", sdk)
    assert followed and followed[1] == server.base_url, sdk
    assert sorted(line.split(" -> ")[0] for line in sdk.splitlines() if " -> " in line) == ids, sdk
    assert openai_client.batches.retrieve(followed[2]).status == "completed"
    _console_shows(server.base_url, followed[2])

    answer = json.loads(output_of(tmp_path, runs, "/v1/chat/completions -H"))
    assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"]
    assert output_of(tmp_path, runs, "live.py").strip(), "the streamed answer is empty"


def _console_shows(base_url: str, batch_id: str) -> None:
    """The console page the SDK script printed, after logging in with the key, as a reader would."""
    with httpx.Client(base_url=base_url, headers={"origin": base_url}, follow_redirects=True) as browser:
        assert browser.post("/console/login", data={"key": KEYS[0]}).status_code == 200
        page = browser.get(f"/console/batches/{batch_id}")
        assert page.status_code == 200 and batch_id in page.text and "completed" in page.text
