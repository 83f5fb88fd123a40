"""Adapter-aware order (issue 30): the plan runs a file's lines adapter by adapter (the base model's a group of its
own), shared-prefix groups kept inside each; the feed lets lines of at most `--max-loras` adapters into the engine
at once, never holding a place while a line waits, so the batch window cannot deadlock with it; a file with no
more adapters than that keeps the plain path; shards keep an adapter's lines whole where they can. The real engine
runs a file over more adapters than its slots in tests/e2e/test_lora.py.

The logic alone here; the tests through the app, a socket or a process are in
tests/integration/test_adapter_order.py."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from itertools import groupby
from pathlib import Path

from app.domain.input_index import PREFIX_CHARS, InputIndex
from app.domain.validation import Limits, validate_file
from app.engine.batch.ordering import AdapterGate, adapter_gate, ordered_lines, plan
from app.engine.batch.shards import cut
from app.engine.sharing.execution import FixedSlots, run_lines
from app.engine.sharing.window import InFlightWindow
from app.testing import FAKE_MODEL
from tests.helpers import jsonl

BASE = FAKE_MODEL
INSTRUCTIONS = {task: f"Task {task}: " + "label the row carefully. " * (PREFIX_CHARS // 20) for task in "PQ"}


def line(custom_id: str, model: str | None, task: str | None = None) -> dict:
    """A chat line on `model` (None: it names none, the base model); `task`: a long shared instruction first."""
    content = f"{INSTRUCTIONS[task]}\nRow: {custom_id}" if task else f"Short question {custom_id}"
    body: dict = {"messages": [{"role": "user", "content": content}], "max_tokens": 5}
    if model is not None:
        body["model"] = model
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def indexed(tmp_path: Path, lines: list[dict], adapters: list[str]) -> InputIndex:
    limits = Limits(
        endpoint="/v1/chat/completions",
        served_models=frozenset({BASE, *adapters}),
        max_requests=10_000,
        max_line_bytes=1 << 20,
        parents={name: BASE for name in adapters},
    )
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(lines))
    report = validate_file(path, limits)
    assert report.ok, report.errors
    return report.index


def planned_ids(lines: list[dict], index: InputIndex) -> list[list[str]]:
    return [[lines[p]["custom_id"] for p in group.positions] for group in plan(index)]


def shuffled_adapters(count: int, per_adapter: int, seed: int = 30) -> tuple[list[str], list[dict]]:
    names = [f"lora{i:02}" for i in range(count)]
    lines = [line(f"{name}-{i}", name) for name in names for i in range(per_adapter)]
    random.Random(seed).shuffle(lines)
    return names, lines


# The plan.


def test_the_plan_runs_adapter_by_adapter_in_first_appearance_with_prefix_groups_inside_each(tmp_path):
    lines = [
        line("b-P0", "b", "P"),
        line("base0", None),
        line("a0", "a"),
        line("b0", "b"),
        line("a-P0", "a", "P"),
        line("b-P1", "b", "P"),
        line("base1", BASE),
        line("a1", "a"),
        line("a-P1", "a", "P"),
        line("b-Q0", "b", "Q"),
        line("b1", "b"),
    ]
    index = indexed(tmp_path, lines, ["a", "b"])
    groups = plan(index)
    assert [index.adapter_names[g.adapter] for g in groups] == ["b", "b", "", "a", "a", "a"]
    # Within an adapter as before: a shared-prefix group at its first line, the other lines in their order between;
    # the same instructions on two adapters are two groups (vLLM caches a prefix per LoRA), and a line naming no
    # model is the base model's like one that names it.
    assert planned_ids(lines, index) == [
        ["b-P0", "b-P1"], ["b0", "b-Q0", "b1"], ["base0", "base1"], ["a0"], ["a-P0", "a-P1"], ["a1"],
    ]  # fmt: skip
    assert [g.shared_prefix for g in groups] == [True, False, False, False, True, False]


def test_a_file_without_adapters_is_planned_as_before(tmp_path):
    lines = [line("P0", BASE, "P"), line("s0", BASE), line("P1", BASE, "P"), line("s1", None)]
    index = indexed(tmp_path, lines, ["a"])
    assert index.adapter_count == 0
    assert planned_ids(lines, index) == [["P0", "P1"], ["s0", "s1"]]
    assert {g.adapter for g in plan(index)} == {0}


def test_the_index_keeps_adapters_across_storage_and_reads_an_index_written_without_them(tmp_path):
    lines = [line("a0", "a"), line("base0", None), line("b0", "b"), line("a1", "a")]
    index = indexed(tmp_path, lines, ["a", "b"])
    again = InputIndex.from_bytes(index.to_bytes())
    assert again == index
    assert [again.adapter_names[n] for n in again.adapter_numbers] == ["a", "", "b", "a"]
    assert planned_ids(lines, again) == [["a0", "a1"], ["base0"], ["b0"]]

    without = indexed(tmp_path, [line("x", None), line("y", BASE)], ["a"])
    assert b"adapter" not in without.to_bytes()  # a file on the base model stores nothing more than before
    older = InputIndex.from_bytes(without.to_bytes())
    assert older == without and older.adapter_count == 0 and list(older.adapter_numbers) == [0, 0]


# Which batches are gated.


def test_a_batch_on_no_more_adapters_than_the_engine_runs_at_once_keeps_the_plain_feed(tmp_path):
    _, one = shuffled_adapters(1, 3)
    names, five = shuffled_adapters(5, 2)
    with_base = [*one, line("base", None)]
    assert adapter_gate(indexed(tmp_path, with_base, ["lora00"]), max_loras=1) is None
    assert adapter_gate(indexed(tmp_path, [line("x", None)], ["lora00"]), max_loras=1) is None
    assert adapter_gate(indexed(tmp_path, five, names), max_loras=5) is None
    assert adapter_gate(indexed(tmp_path, five, names), max_loras=None) is None  # an engine without LoRA slots
    assert isinstance(adapter_gate(indexed(tmp_path, five, names), max_loras=4), AdapterGate)


# The feed.


class Watching:
    """An engine that records the adapters in flight at every moment; each answer takes a few turns of the loop,
    so lines overlap as they do in an engine."""

    def __init__(self) -> None:
        self.in_flight: Counter[str] = Counter()
        self.most_adapters = 0
        self.entered: list[str] = []
        self.turns = random.Random(7)

    async def execute(self, endpoint: str, body: dict, rank: int | None = None) -> tuple[int, dict]:
        model = body.get("model", BASE)
        self.entered.append(model)
        self.in_flight[model] += 1
        self.most_adapters = max(self.most_adapters, len(self.in_flight.keys() - {BASE}))
        try:
            for _ in range(self.turns.randrange(1, 6)):
                await asyncio.sleep(0)  # other lines' turns: the engine working, not a wait for a condition
            return 200, {"model": model, "choices": []}
        finally:
            self.in_flight[model] -= 1
            if not self.in_flight[model]:
                del self.in_flight[model]


def test_forty_adapters_in_random_order_run_four_at_a_time_each_once_and_together(tmp_path):
    names, lines = shuffled_adapters(40, 3)  # a few lines each: more than four adapters' lines fit the slots
    lines += [line(f"base{i}", None) for i in range(20)]
    index = indexed(tmp_path, lines, names)
    engine = Watching()
    answered: Counter[str] = Counter()

    async def feed() -> None:
        await run_lines(
            ordered_lines(tmp_path / "in.jsonl", index, plan(index), skip=()),
            executor=engine,
            endpoint="/v1/chat/completions",
            slots=FixedSlots(16),
            workers=16,
            on_outcome=lambda position, outcome: answered.update([index.custom_ids[position]]),
            gate=adapter_gate(index, max_loras=4),
        )

    asyncio.run(asyncio.wait_for(feed(), timeout=60))
    assert engine.most_adapters == 4
    assert answered == Counter(x["custom_id"] for x in lines)
    # Each adapter entered the engine in one run of its lines, in the order the file first names them: no adapter
    # was loaded twice.
    runs = [model for model, _ in groupby(engine.entered)]
    assert runs == list(dict.fromkeys(x["body"].get("model", BASE) for x in lines))


def test_a_line_held_at_the_gate_holds_no_place_so_a_withdrawn_line_runs_again_and_the_batch_ends(tmp_path):
    asyncio.run(_held_at_the_gate(tmp_path))


class Held:
    """An engine whose requests wait until the test answers them, or until every one is answered at once."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, asyncio.Future]] = []
        self.answer_all = False
        self.entered = asyncio.Event()

    async def execute(self, endpoint: str, body: dict, rank: int | None = None) -> tuple[int, dict]:
        request = asyncio.get_running_loop().create_future()
        self.requests.append((body["model"], request))
        self.entered.set()
        if self.answer_all:
            request.set_result(None)
        await request
        return 200, {"model": body["model"], "choices": []}

    def waiting(self) -> list[asyncio.Future]:
        return [request for _, request in self.requests if not request.done()]


class CountingGate(AdapterGate):
    refused = 0

    def admit(self, position: int) -> bool:
        admitted = super().admit(position)
        self.refused += not admitted
        return admitted


async def until(condition, engine: Held) -> None:
    """Each time a request enters the engine, look again (a line takes its place and enters in one turn)."""
    while not condition():
        engine.entered.clear()
        await asyncio.wait_for(engine.entered.wait(), timeout=10)


async def _held_at_the_gate(tmp_path: Path) -> None:
    lines = [line(f"a{i}", "a") for i in range(3)] + [line(f"b{i}", "b") for i in range(3)]
    index = indexed(tmp_path, lines, ["a", "b"])
    window = InFlightWindow(max_size=4, wave=4, ttft_target_seconds=1.0)
    engine = Held()
    gate = CountingGate(index, max_loras=1)
    answered: Counter[str] = Counter()
    run = asyncio.create_task(
        run_lines(
            ordered_lines(tmp_path / "in.jsonl", index, plan(index), skip=()),
            executor=engine,
            endpoint="/v1/chat/completions",
            slots=window,
            workers=4,
            on_outcome=lambda position, outcome: answered.update([index.custom_ids[position]]),
            gate=gate,
        )
    )
    await until(lambda: len(engine.requests) == 3, engine)
    # The fourth place pulled b0, which waits at the gate for a's lines to end, without its place.
    assert gate.refused == 1 and window.held == 3
    window.online_arrived()
    window.online_arrived()  # two online requests: the youngest a line is withdrawn, the window shrinks to 1
    assert window.withdrawn == 1 and window.size == 1
    engine.answer_all = True
    for request in engine.waiting():
        request.set_result(None)
    await asyncio.wait_for(run, timeout=10)
    assert answered == Counter(x["custom_id"] for x in lines)
    models = [model for model, _ in engine.requests]
    assert models == ["a"] * 4 + ["b"] * 3  # the withdrawn a line ran again before any b line entered


# Shards.


def test_shards_keep_each_adapters_lines_whole_unless_they_outgrow_a_shard(tmp_path):
    lines = [line(f"{name}{i}", name) for i in range(3) for name in "abc"]  # interleaved: a0 b0 c0 a1 ...
    index = indexed(tmp_path, lines, ["a", "b", "c"])
    shards = [[lines[p]["custom_id"] for p in shard] for shard in cut(index, shard_lines=4)]
    # Shards of at least 4: a's three lines and b's, then c's; no adapter on two workers.
    assert shards == [["a0", "a1", "a2", "b0", "b1", "b2"], ["c0", "c1", "c2"]]

    big = [line(f"a{i}", "a") for i in range(7)] + [line(f"aP{i}", "a", "P") for i in range(5)]
    big += [line(f"b{i}", "b") for i in range(2)]
    index = indexed(tmp_path, big, ["a", "b"])
    shards = [[big[p]["custom_id"] for p in shard] for shard in cut(index, shard_lines=4)]
    # a's 12 lines cannot fit a shard of 4: its lines without a shared prefix are cut in fours, its shared-prefix
    # group kept whole; b's two stay together.
    assert shards == [
        ["a0", "a1", "a2", "a3"], ["a4", "a5", "a6", "aP0", "aP1", "aP2", "aP3", "aP4"], ["b0", "b1"],
    ]  # fmt: skip


def test_a_shards_index_keeps_its_lines_adapters(tmp_path):
    lines = [line("a0", "a"), line("base0", None), line("b0", "b")]
    index = indexed(tmp_path, lines, ["a", "b"])
    shard = InputIndex()
    shard.add_from(index, 2, offset=0)
    shard.add_from(index, 1, offset=100)
    assert shard.adapter_names == ["", "b"] and list(shard.adapter_numbers) == [1, 0]
    assert list(shard.offsets) == [0, 100] and shard.custom_ids == ["b0", "base0"]
