"""The core's shape, checked: the input is read once, progress tells the truth, `vbatch run` resumes."""

from __future__ import annotations

import asyncio
import io
import json
import pathlib
import time
from collections import Counter

import pytest

from app.domain.batches import Progress
from app.engine.batch import meter as meter_module
from app.engine.batch.meter import MAX_SAMPLES, RunMeter
from app.engine.batch.offline import run_file
from app.testing import FakeEngine
from tests.helpers import create_batch, jsonl, read_jsonl, request_line, upload, wait_for, wait_status

pytestmark = pytest.mark.both_backends


class ReadCounter:
    """Counts how often a batch's input is opened (by any of its names: the file object's, or the batch's own
    link to the same bytes) and how many of its bytes are read."""

    def __init__(self, monkeypatch, files_dir: pathlib.Path, file_id: str) -> None:
        self.opens = 0
        self.bytes_read = 0
        real_open = pathlib.Path.open
        counter = self

        class Counted(io.BufferedReader):
            def read(self, size=-1, /):
                data = super().read(size)
                counter.bytes_read += len(data)
                return data

            def readline(self, size=-1, /):
                data = super().readline(size)
                counter.bytes_read += len(data)
                return data

            def __iter__(self):
                return iter(self.readline, b"")

        def counting_open(self, mode="r", *args, **kwargs):
            if self.parent == files_dir and (self.name == file_id or self.suffix == ".input") and "r" in mode:
                counter.opens += 1
                return Counted(io.FileIO(self, "rb"))
            return real_open(self, mode, *args, **kwargs)

        monkeypatch.setattr(pathlib.Path, "open", counting_open)


def test_a_batch_reads_its_input_in_one_pass_then_each_line_once(client, settings, fake_engine, monkeypatch):
    lines = [request_line(f"r{i}", max_tokens=1 + i % 3) for i in range(40)]
    content = jsonl(lines)
    source = upload(client, content)
    counter = ReadCounter(monkeypatch, settings.files_dir, source["id"])
    done = wait_status(client, create_batch(client, source["id"])["id"], {"completed"})
    assert done["request_counts"]["completed"] == 40
    newlines = content.count(b"\n")
    # Validation's pass reads every byte; the feed reads each request by its offset, without its newline.
    assert counter.opens == 2
    assert counter.bytes_read == len(content) + (len(content) - newlines)
    assert fake_engine.executor.calls == 40


def test_cancel_fills_the_unrun_lines_without_reading_the_input(client, settings, fake_engine, monkeypatch):
    fake_engine.executor.answer_first = 2
    source = upload(client, jsonl([request_line(f"r{i}") for i in range(12)]))
    batch = create_batch(client, source["id"])
    wait_for(lambda: client.get(f"/v1/batches/{batch['id']}").json()["request_counts"]["completed"] == 2)
    counter = ReadCounter(monkeypatch, settings.files_dir, source["id"])
    client.post(f"/v1/batches/{batch['id']}/cancel")
    done = wait_status(client, batch["id"], {"cancelled"})
    assert done["request_counts"] == {"total": 12, "completed": 2, "failed": 10}
    assert counter.opens == 0
    outputs, errors = read_jsonl(client, done["output_file_id"]), read_jsonl(client, done["error_file_id"])
    assert len(errors) == 10 and {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert Counter(o["custom_id"] for o in outputs + errors) == Counter(f"r{i}" for i in range(12))


def test_progress_is_live_while_running_and_keeps_the_timeline_after(client, fake_engine):
    fake_engine.executor.answer_first = 3
    source = upload(client, jsonl([request_line(f"r{i}") for i in range(20)]))
    batch = create_batch(client, source["id"])

    def live() -> dict | None:
        progress = client.get(f"/v1/batches/{batch['id']}/progress").json()
        return progress if progress["request_counts"]["completed"] == 3 and progress["timeline"] else None

    running = wait_for(live)
    assert running["object"] == "batch.progress" and running["status"] == "in_progress"
    # Three answers out of a wave of four (the fake engine's max_num_seqs): the rate cannot tell the rest yet.
    assert running["eta_seconds"] is None
    assert running["output_tokens_per_second"] > 0 and running["requests_per_second"] > 0
    assert {"planned", "first_result"} <= set(running["timeline"])
    assert all(len(point) == 3 for point in running["series"])
    fake_engine.executor.gate.set()
    wait_status(client, batch["id"], {"completed"})
    ended = client.get(f"/v1/batches/{batch['id']}/progress").json()
    assert ended["status"] == "completed" and ended["request_counts"]["completed"] == 20
    assert ended["requests_per_second"] is None and ended["eta_seconds"] is None
    # The run's rate history is kept with it; the last point is the run's end, however short the run.
    assert ended["series"] and all(len(point) == 3 for point in ended["series"])
    stages = ended["timeline"]
    assert set(stages) == {"created", "planned", "first_result", "all_sent", "last_result", "published"}
    assert (
        stages["created"]
        <= 0
        <= stages["planned"]
        <= stages["first_result"]
        <= stages["last_result"]
        <= stages["published"]
    )
    assert ended["series"][-1][0] >= stages["last_result"]
    assert client.get("/v1/batches/batch_nope/progress").status_code == 404


def test_meter_gives_no_eta_before_a_wave_has_finished():
    tokens = [0]
    meter = RunMeter(total=100, wave=10, generated_tokens=lambda: tokens[0])
    assert meter.stats(Progress()) is None  # not begun
    meter.begin(done_before=0, created_ns=time.time_ns())
    tokens[0] = 500  # the engine is generating a first wave: nothing has finished yet
    first = meter.stats(Progress())
    assert (
        first is not None
        and first.eta_seconds is None
        and first.output_tokens_per_second > 0
        and first.requests_per_second == 0
    )
    assert getattr(meter.stats(Progress(completed=9)), "eta_seconds", 0) is None
    assert getattr(meter.stats(Progress(completed=10)), "eta_seconds", None) is not None


def test_meter_series_gives_each_steps_rates_and_stays_bounded(monkeypatch):
    now, tokens = [100.0], [0]
    monkeypatch.setattr(meter_module.time, "monotonic", lambda: now[0])
    meter = RunMeter(total=10_000, wave=10, generated_tokens=lambda: tokens[0])
    meter.begin(done_before=4, created_ns=time.time_ns())  # a resumed run: 4 lines were done before it
    for (
        at,
        done,
        generated,
    ) in [(0.5, 8, 40), (1.0, 14, 100), (3.0, 34, 500)]:
        now[0], tokens[0] = 100.0 + at, generated
        meter.sample(Progress(completed=done))
    # The point at 0.5 s came too soon after the start and is not kept.
    assert meter.series() == [[1.0, 10.0, 100.0], [3.0, 10.0, 200.0]]
    for step in range(4, 2000):
        now[0] = 100.0 + step
        meter.sample(Progress(completed=34 + step))
    series = meter.series()
    # Coarser steps, the same run: from its start to its last point, at the rate each step had.
    assert len(series) <= MAX_SAMPLES and meter.samples[0].elapsed == 0.0 and series[-1][0] == 1999.0
    assert all(requests_per_second == 1.0 for _, requests_per_second, _ in series[1:])


def test_vbatch_run_resumes_from_its_own_output(tmp_path):
    input_path = tmp_path / "in.jsonl"
    input_path.write_bytes(jsonl([request_line(f"r{i}") for i in range(10)]))
    output, errors = tmp_path / "out.jsonl", tmp_path / "out.errors.jsonl"
    interrupted = FakeEngine()
    interrupted.executor.answer_first = 4

    async def cut_short() -> None:
        run = asyncio.create_task(run_file(interrupted, input_path=input_path, output=output, errors=errors))
        while interrupted.executor.calls < 5:  # four answered, the rest waiting on the gate
            await asyncio.sleep(0.01)
        run.cancel()  # as Ctrl-C does
        await asyncio.gather(run, return_exceptions=True)

    asyncio.run(cut_short())
    assert len(output.read_bytes().splitlines()) == 4
    resumed = FakeEngine()
    assert asyncio.run(run_file(resumed, input_path=input_path, output=output, errors=errors)) == 0
    assert resumed.executor.calls == 6
    ids = Counter(json.loads(line)["custom_id"] for line in output.read_bytes().splitlines())
    assert ids == Counter(f"r{i}" for i in range(10))


def test_vbatch_run_refuses_an_output_file_of_another_input(tmp_path, capsys):
    input_path = tmp_path / "in.jsonl"
    input_path.write_bytes(jsonl([request_line("a")]))
    output = tmp_path / "out.jsonl"
    output.write_text(json.dumps({"id": "x", "custom_id": "someone-else", "response": None, "error": None}) + "\n")
    code = asyncio.run(run_file(FakeEngine(), input_path=input_path, output=output, errors=tmp_path / "e.jsonl"))
    assert code == 2 and "someone-else" in capsys.readouterr().err


def test_the_in_flight_window_covers_every_data_parallel_rank(settings):
    from fastapi.testclient import TestClient

    from app.engine.service import EngineService
    from app.main import create_app
    from app.testing import FakeEngine

    engine = FakeEngine(data_parallel_size=2)
    engine.executor.answer_first = 0  # every request waits: the window fills and stays full
    service = EngineService(engine)
    with TestClient(create_app(settings, service)) as client:
        batch = create_batch(client, upload(client, jsonl([request_line(f"r{i}") for i in range(40)]))["id"])
        # max_num_seqs (4) on each of 2 ranks, twice over: 16 in flight, where one rank's sizing gave 8.
        wait_for(lambda: engine.executor.calls == 16)
        assert service.live_stats(batch["id"]) is not None
        engine.executor.gate.set()
        wait_for(lambda: client.get(f"/v1/batches/{batch['id']}").json()["status"] == "completed")
