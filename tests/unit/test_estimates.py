"""`POST /v1/batches/estimate` (issue 31): the arithmetic of `app.domain.estimates`, and the route over the fake
engine, whose tokenizer counts words (`app.testing.fake_token_count`). The real engine's counts are checked against
a batch's real usage in tests/e2e/test_estimate.py.

The logic alone here; the tests through the app, a socket or a process are in
tests/integration/test_estimates.py."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

import pytest

from app.domain import estimates
from app.domain.batches import Progress
from app.domain.results import Outcome, add_usage, encode_body, http_outcome, stopped_at_cap
from app.engine.batch.parts import ResultSink

CHAT = "/v1/chat/completions"

# The arithmetic.


def test_max_output_tokens_takes_the_line_limit_vllm_reads():
    assert estimates.max_output_tokens(CHAT, {"max_completion_tokens": 7, "max_tokens": 50}, 10, 2048) == 7
    assert estimates.max_output_tokens(CHAT, {"max_tokens": 50, "n": 3}, 10, 2048) == 150
    # No limit: the context left after the prompt; a limit past it is cut to it.
    assert estimates.max_output_tokens(CHAT, {}, 48, 2048) == 2000
    assert estimates.max_output_tokens(CHAT, {"max_tokens": 5000}, 48, 2048) == 2000
    assert estimates.max_output_tokens("/v1/completions", {}, 10, 2048) == 16  # vLLM's default for completions
    assert estimates.max_output_tokens("/v1/embeddings", {"max_tokens": 9}, 10, 2048) == 0


def test_a_prompt_expects_cached_the_whole_blocks_an_earlier_prompt_began_with():
    system = list(range(40))  # two whole blocks of 16, and 8 tokens more
    first, second = [*system, 100, 101], [*system, 200]
    # The first finds nothing; the second the two blocks both begin with (not the third: it differs there).
    assert estimates.cached_prefix_tokens([(None, first), (None, second)], 16) == [0, 32]
    # A prompt seen whole keeps its last token to compute: 48 tokens in 3 blocks find 2 of them.
    whole = list(range(48))
    assert estimates.cached_prefix_tokens([(None, whole), (None, whole)], 16) == [0, 32]
    # Blocks are known by every token before them: the same block after a different start is not found.
    assert estimates.cached_prefix_tokens([(None, [1] * 16 + [2] * 20), (None, [3] * 16 + [2] * 20)], 16) == [0, 0]


def test_prompts_of_two_adapters_or_salts_share_no_block():
    prompt = list(range(40))
    prompts = [("adapter-a", prompt), ("adapter-b", prompt), ("adapter-a", prompt), None]
    assert estimates.cached_prefix_tokens(prompts, 16) == [0, 0, 32, 0]


def test_the_estimate_sums_the_lines_cached_tokens_and_their_share():
    lines = [estimates.line_of(CHAT, {}, estimates.PromptCount(40, cached), 2048) for cached in (0, 32, 32)]
    found = estimates.estimate(
        estimates.Asked("f", CHAT, "m"), 3, lines, estimates.history_of([]), estimates.Pricing(1, None)
    )
    assert (found.expected_cached_tokens, found.expected_cached_share) == (64, round(64 / 120, 4))


def test_without_history_the_rate_is_unknown_and_nothing_is_priced():
    lines = [estimates.line_of(CHAT, {"max_tokens": 10}, estimates.PromptCount(20), 2048)] * 4
    history = estimates.history_of([])
    found = estimates.estimate(
        estimates.Asked("file-1", CHAT, "m"), 4, lines, history, estimates.Pricing(gpus=1, gpu_hour_price=2.0)
    )
    assert (found.prompt_tokens, found.max_output_tokens) == (80, 40)
    assert found.expected_output_tokens is None and found.eta_seconds is None and found.cost_usd is None
    assert found.basis.rate == "unknown" and found.basis.history_batch_ids == []


def test_with_history_output_and_eta_follow_it_and_the_price_gives_a_cost():
    history = estimates.History(["b1", "b2"], lines=10, input_tokens=500, output_tokens=300, run_seconds=6.0)
    lines = [estimates.line_of(CHAT, {}, estimates.PromptCount(20), 2048)] * 20
    pricing = estimates.Pricing(gpus=2, gpu_hour_price=3.6)
    found = estimates.estimate(estimates.Asked("file-1", CHAT, "m"), 20, lines, history, pricing)
    assert found.expected_output_tokens == 600  # 30 a line
    assert found.basis.tokens_per_second == 50.0 and found.basis.rate_unit == "output_tokens"
    assert found.eta_seconds == pytest.approx(12.0)
    assert found.gpu_seconds == pytest.approx(24.0)  # two GPUs
    assert found.cost_usd == pytest.approx(24.0 / 3600 * 3.6)
    unpriced = estimates.estimate(estimates.Asked("file-1", CHAT, "m"), 20, lines, history, estimates.Pricing(1, None))
    assert unpriced.cost_usd is None and unpriced.gpu_seconds == pytest.approx(12.0)


def test_the_rate_comes_from_batches_that_filled_the_engine_as_the_file_will():
    warm_up, full = SimpleNamespace(id="warm-up", completed=8), SimpleNamespace(id="full", completed=2000)
    rows = [warm_up, full]

    def chosen(lines: int, wave: int | None) -> list[str]:
        return [row.id for row in estimates.comparable(rows, lines=lines, wave=wave)]

    assert chosen(20_000, 1024) == ["full"]  # a wave of lines, as the file will run
    assert chosen(100, 1024) == ["full"]  # as many as the file has
    assert chosen(5, 1024) == ["warm-up", "full"]
    assert chosen(20_000, None) == ["warm-up", "full"]  # the engine's wave unknown
    assert [row.id for row in estimates.comparable([warm_up], lines=20_000, wave=1024)] == ["warm-up"]  # none full


def test_embeddings_are_timed_by_their_input_tokens():
    history = estimates.History(["b1"], lines=10, input_tokens=1000, output_tokens=0, run_seconds=2.0)
    lines = [estimates.line_of("/v1/embeddings", {"input": "a b"}, estimates.PromptCount(50), 2048)] * 10
    found = estimates.estimate(
        estimates.Asked("f", "/v1/embeddings", "m"), 10, lines, history, estimates.Pricing(1, None)
    )
    assert found.expected_output_tokens == 0 and found.basis.rate_unit == "input_tokens"
    assert found.eta_seconds == pytest.approx(1.0)


# Each line's own cap against the history's (issue 38): answers cut at a lower cap are a floor, not a figure.


def _capped(cap: int, lines: int) -> list[estimates.Line]:
    return [estimates.line_of(CHAT, {"max_tokens": cap}, estimates.PromptCount(20), 2048)] * lines


# 60 lines run at max_tokens 16: 55 stopped at it, 5 ended on their own with 50 tokens (the longest 14); 9.3 s.
CUT_AT_16 = estimates.History(
    ["b3", "b2", "b1"],
    lines=60,
    input_tokens=1200,
    output_tokens=930,
    run_seconds=9.3,
    cut_lines=55,
    cut_output_tokens=880,
    shortest_cut_output=16,
    longest_uncut_output=14,
)


def test_answers_cut_below_the_files_cap_give_a_range_from_what_they_did_to_the_cap():
    """The issue's shape: a file asking 64 after batches at 16. Each cut answer gives 16 to 64, each other its own
    tokens: per line 930/60 = 15.5 to (50 + 55 x 64)/60 = 59.5; the expected is the middle."""
    found = estimates.estimate(
        estimates.Asked("f", CHAT, "m"), 200, _capped(64, 200), CUT_AT_16, estimates.Pricing(1, None)
    )
    assert (found.expected_output_tokens_low, found.expected_output_tokens, found.expected_output_tokens_high) == (
        3100,
        7500,
        11900,
    )
    assert found.basis.tokens_per_second == 100.0  # 930 tokens in 9.3 s
    assert (found.eta_seconds_low, found.eta_seconds, found.eta_seconds_high) == (31.0, 75.0, 119.0)
    assert found.gpu_seconds == 75.0
    basis = found.basis
    assert (basis.output, basis.history_lines, basis.history_cut_lines) == ("range", 60, 55)
    assert basis.output_reason is not None
    assert "55 of the 60 answers" in basis.output_reason and "as few as 16" in basis.output_reason
    assert "up to 64" in basis.output_reason


def test_a_file_at_the_cap_the_history_was_cut_at_is_told_to_the_token():
    found = estimates.estimate(
        estimates.Asked("f", CHAT, "m"), 200, _capped(16, 200), CUT_AT_16, estimates.Pricing(1, None)
    )
    assert (found.expected_output_tokens_low, found.expected_output_tokens, found.expected_output_tokens_high) == (
        3100,
        3100,
        3100,
    )
    assert (found.eta_seconds_low, found.eta_seconds, found.eta_seconds_high) == (31.0, 31.0, 31.0)
    assert (found.basis.output, found.basis.output_reason) == ("measured", None)


def test_a_cap_below_answers_that_ended_on_their_own_cuts_them_by_an_amount_unknown():
    """10 lines at max_tokens 64: 2 cut (128 tokens), 8 ended on their own with 200 tokens, the longest 40. At 16
    the cut ones give 16 each; the others at least 200 x 16/40 = 80 (none is longer than 40), at most 8 x 16."""
    history = estimates.History(
        ["b"],
        lines=10,
        input_tokens=100,
        output_tokens=328,
        run_seconds=1.0,
        cut_lines=2,
        cut_output_tokens=128,
        shortest_cut_output=64,
        longest_uncut_output=40,
    )
    assert history.output_range(16) == ((80 + 32) / 10, (128 + 32) / 10)
    assert history.output_range(40) == ((200 + 80) / 10, (200 + 80) / 10)  # none cut: the cut ones give 40 each
    found = estimates.estimate(
        estimates.Asked("f", CHAT, "m"), 10, _capped(16, 10), history, estimates.Pricing(1, None)
    )
    assert (found.expected_output_tokens_low, found.expected_output_tokens, found.expected_output_tokens_high) == (
        112,
        136,
        160,
    )
    assert found.basis.output == "range" and "ran to 40" in (found.basis.output_reason or "")
    assert "as low as 16" in (found.basis.output_reason or "")


def test_lines_of_several_caps_each_take_their_own():
    lines = _capped(16, 100) + _capped(64, 100)
    found = estimates.estimate(estimates.Asked("f", CHAT, "m"), 200, lines, CUT_AT_16, estimates.Pricing(1, None))
    assert (found.expected_output_tokens_low, found.expected_output_tokens_high) == (3100, 1550 + 5950)
    assert found.max_output_tokens == 100 * 16 + 100 * 64


def _row(name: str, **fields) -> SimpleNamespace:
    ended = {"cut_lines": 0, "cut_output_tokens": 0, "shortest_cut_output": 0, "longest_uncut_output": 0}
    return SimpleNamespace(id=name, completed=20, input_tokens=0, output_tokens=0, timeline_json=None, **ended | fields)


def test_the_history_is_the_batches_that_tell_the_files_caps_where_any_does():
    at_16 = _row("at-16", cut_lines=19, cut_output_tokens=304, shortest_cut_output=16, longest_uncut_output=10)
    at_64 = _row("at-64", cut_lines=3, cut_output_tokens=192, shortest_cut_output=64, longest_uncut_output=60)
    before = _row("before-migration")  # nothing recorded: its answers are taken as they were, as before

    def chosen(*caps: int) -> list[str]:
        return [row.id for row in estimates.telling([at_16, at_64, before], caps)]

    assert chosen(64) == ["at-64", "before-migration"]  # the 16s were cut below 64
    assert chosen(16) == ["at-16", "before-migration"]  # the 64s' answers ran past 16
    assert chosen(60, 64) == ["at-64", "before-migration"]
    assert chosen() == ["at-16", "at-64", "before-migration"]
    assert [row.id for row in estimates.telling([at_16, at_64], [32])] == ["at-16", "at-64"]  # none tells: all


def test_the_history_sums_how_its_batches_answers_ended():
    at_16 = _row("at-16", cut_lines=19, cut_output_tokens=304, shortest_cut_output=16, longest_uncut_output=10)
    at_64 = _row("at-64", cut_lines=3, cut_output_tokens=192, shortest_cut_output=64, longest_uncut_output=60)
    uncut = _row("uncut", longest_uncut_output=70)
    history = estimates.history_of([at_16, at_64, uncut])
    assert (history.cut_lines, history.cut_output_tokens) == (22, 496)
    assert (history.shortest_cut_output, history.longest_uncut_output) == (16, 70)
    assert estimates.history_of([uncut]).shortest_cut_output == 0


def test_an_answer_stopped_at_its_cap_is_told_from_its_finish_reason():
    def chat(*reasons: str) -> dict:
        return {"choices": [{"index": i, "finish_reason": r} for i, r in enumerate(reasons)], "usage": {}}

    assert stopped_at_cap(chat("length")) and stopped_at_cap(chat("stop", "length"))
    assert not stopped_at_cap(chat("stop")) and not stopped_at_cap(chat("tool_calls"))
    assert stopped_at_cap({"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}})
    assert not stopped_at_cap({"status": "incomplete", "incomplete_details": {"reason": "content_filter"}})
    assert not stopped_at_cap({"object": "list", "data": []}) and not stopped_at_cap([1])
    assert encode_body(chat("length")).cut and not encode_body(chat("stop")).cut


def test_progress_keeps_how_answers_ended_and_a_parent_sums_its_shards():
    first, second = Progress(), Progress()
    for tokens, cut, progress in ((16, True, first), (9, False, first), (12, True, first), (30, False, second)):
        add_usage(progress, {"prompt_tokens": 5, "completion_tokens": tokens}, cut=cut)
    assert (first.cut_lines, first.cut_output_tokens, first.shortest_cut_output, first.longest_uncut_output) == (
        2,
        28,
        12,
        9,
    )
    both = first.plus(second)
    # `second` cut nothing: its 0 is no shortest cut answer.
    assert (both.cut_lines, both.cut_output_tokens, both.shortest_cut_output, both.longest_uncut_output) == (
        2,
        28,
        12,
        30,
    )
    assert (both.output_tokens, both.input_tokens) == (67, 20)


def test_a_sink_restored_from_its_files_knows_how_their_answers_ended(tmp_path):
    """A run that resumes takes its counts from the part files: how their answers ended with them."""

    def answer(custom_id: str, tokens: int, reason: str) -> Outcome:
        body = {"choices": [{"finish_reason": reason}], "usage": {"prompt_tokens": 3, "completion_tokens": tokens}}
        return http_outcome(custom_id, 200, body)

    async def run() -> tuple[Progress, Progress]:
        sink = ResultSink(tmp_path / "out", tmp_path / "err")
        await sink.open(output_bytes=0, error_bytes=0, position_of=dict)
        for position, (tokens, reason) in enumerate(((16, "length"), (7, "stop"), (16, "length"))):
            sink.record(position, answer(f"r{position}", tokens, reason))
        await sink.checkpoint()
        await sink.close()
        again = ResultSink(tmp_path / "out", tmp_path / "err")
        await again.open(output_bytes=None, error_bytes=None, position_of=lambda: {f"r{i}": i for i in range(3)})
        await again.close()
        return sink.progress, again.progress

    recorded, restored = asyncio.run(run())
    assert recorded == restored
    assert (restored.cut_lines, restored.cut_output_tokens, restored.shortest_cut_output) == (2, 32, 16)
    assert restored.longest_uncut_output == 7


# The route, over the fake engine.


def test_a_worker_view_says_token_counts_are_unknown():
    from app.engine.online.view import WorkersView

    with contextlib.closing(asyncio.new_event_loop()) as loop:
        assert loop.run_until_complete(WorkersView().count_tokens(CHAT, [{"prompt": "a"}])) is None


@pytest.mark.parametrize(
    ("endpoint", "body", "texts"),
    [
        ("/v1/score", {"text_1": "q", "text_2": ["a", "b"]}, ["q", "a", "q", "b"]),
        ("/v1/score", {"queries": "q", "documents": "a"}, ["q", "a"]),
        ("/v1/score", {"queries": ["q", "r"], "items": ["a", "b"]}, ["q", "a", "r", "b"]),
        ("/v1/score", {"data_1": ["q", "r"], "data_2": ["a", "b", "c"]}, None),  # N to M: the handler refuses it
        ("/v1/score", {"text_1": "q", "text_2": [{"type": "image_url"}]}, None),  # not text
        ("/v1/score", {"text_1": "q"}, None),
        ("/v1/rerank", {"query": "q", "documents": ["a", "b"]}, ["q", "a", "q", "b"]),
        ("/v1/rerank", {"query": "q", "documents": []}, None),
    ],
)
def test_a_scoring_line_puts_each_pairs_two_texts_before_the_model(endpoint, body, texts):
    assert estimates.scored_texts(endpoint, body) == texts


def test_scoring_expects_no_output_and_is_timed_by_its_input_tokens():
    for endpoint in estimates.SCORING:
        assert estimates.max_output_tokens(endpoint, {"max_tokens": 5}, 10, 100) == 0
        history = estimates.History(["batch_s"], lines=10, input_tokens=400, output_tokens=0, run_seconds=4.0)
        lines = [estimates.line_of(endpoint, {}, estimates.PromptCount(40), 100)] * 10
        answer = estimates.estimate(
            estimates.Asked("file-1", endpoint, "m"), 10, lines, history, estimates.Pricing(1, None)
        )
        assert (answer.expected_output_tokens, answer.eta_seconds, answer.basis.rate_unit) == (0, 4.0, "input_tokens")
