"""Per-key limits on online requests, without HTTP: the token buckets on a clock the test moves, the token estimate,
OpenAI's spelling of waits, and the keys file's `live_rpm=` / `live_tpm=` (bad ones refused at start)."""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path

import pytest

from app.core.auth import key_file_lines, key_settings, owner_of, read_keys
from app.core.config import Settings
from app.domain.ratelimits import (
    DEFAULT_OUTPUT_TOKENS,
    Limits,
    RateLimited,
    RateLimiter,
    duration,
    estimated_tokens,
    used_tokens,
)
from app.engine.service import EngineService
from app.launch import check_binding
from app.main import create_app
from app.outbox import endpoints_from

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_refills_at_its_limit_a_minute():
    clock = Clock()
    limiter = RateLimiter(Limits(requests_per_minute=60), {}, clock=clock)
    for _ in range(60):
        limiter.admit("a", tokens=10, model="m")
    with pytest.raises(RateLimited) as refused:
        limiter.admit("a", tokens=10, model="m")
    assert refused.value.kind == "requests" and refused.value.retry_after_seconds == pytest.approx(1.0)
    clock.now += 1.0
    admitted = limiter.admit("a", tokens=10, model="m")
    assert admitted.quota.requests is not None and admitted.quota.requests.remaining == 0
    assert admitted.quota.tokens is None  # no token limit, nothing charged
    clock.now += 600  # never more than full
    assert limiter.quota("a").requests.remaining == 60  # type: ignore[union-attr]


def test_a_refusal_charges_nothing_and_each_key_has_its_own_buckets():
    clock = Clock()
    limiter = RateLimiter(Limits(tokens_per_minute=100), {owner_of("sk-b"): Limits(tokens_per_minute=10)}, clock=clock)
    limiter.admit("a", tokens=90, model="m")
    with pytest.raises(RateLimited) as refused:
        limiter.admit("a", tokens=20, model="m")
    assert "Limit 100, Used 90, Requested 20. Please try again in 6s." in refused.value.message
    assert limiter.quota("a").tokens.remaining == 10  # type: ignore[union-attr]
    limiter.admit("c", tokens=100, model="m")  # another key on the service's limit
    with pytest.raises(RateLimited) as too_large:
        limiter.admit(owner_of("sk-b"), tokens=11, model="m")
    assert too_large.value.retry_after_seconds is None and too_large.value.message.startswith("Request too large")


def test_settling_gives_back_an_overestimate_and_takes_an_underestimate():
    clock = Clock()
    limiter = RateLimiter(Limits(tokens_per_minute=1000), {}, clock=clock)
    admission = limiter.admit("a", tokens=300, model="m")
    assert limiter.settle(admission, tokens_used=50).tokens.remaining == 950  # type: ignore[union-attr]
    assert limiter.settle(admission, tokens_used=10).tokens.remaining == 950  # type: ignore[union-attr]  # once
    admission = limiter.admit("a", tokens=100, model="m")
    quota = limiter.settle(admission, tokens_used=2000)
    assert quota.tokens.remaining == 0 and quota.tokens.reset_seconds == pytest.approx(123.0)  # type: ignore[union-attr]


def test_the_limiter_is_safe_from_many_threads():
    limiter = RateLimiter(Limits(requests_per_minute=1000), {}, clock=Clock())
    admitted = []

    def ask() -> None:
        for _ in range(300):
            with contextlib.suppress(RateLimited):
                admitted.append(limiter.admit("a", tokens=1, model="m"))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(admitted) == 1000


def test_waits_are_spelled_as_openai_spells_them():
    assert [duration(s) for s in (0, 0.0004, 0.12, 1, 8.64, 59.9994, 60, 86.4, 360, 3723.5)] == [
        "0ms", "1ms", "120ms", "1s", "8.64s", "1m0s", "1m0s", "1m26.4s", "6m0s", "1h2m3.5s",
    ]  # fmt: skip


def test_the_token_estimate_is_the_prompt_at_four_characters_a_token_and_the_most_generated():
    chat = {"messages": [{"role": "user", "content": "x" * 400}], "max_completion_tokens": 50, "n": 2}
    assert estimated_tokens("/v1/chat/completions", chat) == 101 + 100  # "user" and the content: 404 characters
    # Completions: vLLM's default of 16 when unset, for each prompt of a list.
    assert estimated_tokens("/v1/completions", {"prompt": [[1, 2, 3], [4]]}) == 4 + 2 * 16
    assert estimated_tokens("/v1/responses", {"input": "abcd", "max_output_tokens": 10}) == 11
    assert estimated_tokens("/v1/embeddings", {"input": ["abcd", "efgh"], "max_tokens": 99}) == 2
    assert estimated_tokens("/v1/chat/completions", {"messages": "abcd"}) == 1 + DEFAULT_OUTPUT_TOKENS
    odd = {"messages": [[[[{"a": None}]]]] * 3, "max_tokens": [1], "n": {"a": 1}, "prompt": 1.5}
    assert estimated_tokens("/v1/chat/completions", odd) == DEFAULT_OUTPUT_TOKENS
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert estimated_tokens("/v1/completions", {"prompt": deep, "max_tokens": 10**20}) == 10**9


@pytest.mark.parametrize(
    ("endpoint", "body", "charged"),
    [
        # Numbers as vLLM's request models take them (pydantic's lax mode): each was charged as unset.
        ("/v1/chat/completions", {"max_tokens": "700"}, 700),
        ("/v1/chat/completions", {"max_tokens": 700.0}, 700),
        ("/v1/chat/completions", {"max_completion_tokens": " 700 "}, 700),
        ("/v1/chat/completions", {"max_tokens": True}, 1),
        ("/v1/chat/completions", {"max_tokens": 100, "n": "4"}, 400),
        # The field each endpoint reads: chat's max_completion_tokens when set (null: its max_tokens).
        ("/v1/chat/completions", {"max_completion_tokens": 10, "max_tokens": 700}, 10),
        ("/v1/chat/completions", {"max_completion_tokens": None, "max_tokens": 700}, 700),
        # Completions read max_tokens alone (max_completion_tokens is no field of theirs), for every prompt.
        ("/v1/completions", {"max_completion_tokens": 0, "max_tokens": 700}, 700),
        ("/v1/completions", {"prompt": ["pppp"] * 20, "max_tokens": 10}, 20 + 200),  # 80 characters: 20 tokens
        ("/v1/completions", {"prompt": [[1, 2]] * 3, "max_tokens": 10, "n": 2}, 6 + 60),  # 6 token ids
        # Responses read max_output_tokens alone.
        ("/v1/responses", {"max_tokens": 0, "max_output_tokens": 700}, 700),
        ("/v1/responses", {"max_output_tokens": "700"}, 700),
    ],
)
def test_the_charge_reads_a_body_as_the_engine_will_run_it(endpoint, body, charged):
    assert estimated_tokens(endpoint, body) == charged


def test_usage_in_every_shape():
    assert used_tokens({"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}) == 7
    assert used_tokens({"input_tokens": 3, "output_tokens": 4}) == 7
    assert used_tokens(None) is None and used_tokens({"note": "x"}) is None


# The keys file.


def _keys(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "keys"
    path.write_text(text)
    return path


def test_a_keys_line_carries_its_settings_beside_its_webhook(tmp_path):
    path = _keys(
        tmp_path,
        f"# alice: her own endpoint and limits\nsk-alice https://hooks.example/x?a=b {SECRET} live_rpm=60 live_tpm=0\n"
        "sk-bob live_tpm=5000\nsk-carol\n",
    )
    assert read_keys(inline="", path=path) == ["sk-alice", "sk-bob", "sk-carol"]
    assert key_file_lines(path) == [["sk-alice", "https://hooks.example/x?a=b", SECRET], ["sk-bob"], ["sk-carol"]]
    assert key_settings(path) == {
        owner_of("sk-alice"): {"live_rpm": 60, "live_tpm": 0},
        owner_of("sk-bob"): {"live_tpm": 5000},
    }
    settings = Settings(api_keys_file=path, live_rpm=10, live_tpm=100)
    alices = endpoints_from(settings).for_owner(owner_of("sk-alice"))
    assert alices is not None and alices.url == "https://hooks.example/x?a=b"
    limiter = RateLimiter.from_settings(rpm=10, tpm=100, key_settings=key_settings(path))
    assert limiter.limits_of(owner_of("sk-alice")) == Limits(60, 0)  # 0: no token limit for alice
    assert limiter.limits_of(owner_of("sk-bob")) == Limits(10, 5000)
    assert limiter.limits_of(owner_of("sk-carol")) == Limits(10, 100)


def _refused_at_start(settings: Settings, caplog) -> str:
    """What the service logs as its start refuses `settings` (it exits with 2)."""
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as stopped:
        check_binding(settings, insecure_no_auth=False)
    assert stopped.value.code == 2
    return caplog.text


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("sk-secret-key live_rpm=-1", "live_rpm= takes a whole number a minute"),
        ("sk-secret-key live_rpm=ten", "not 'ten'"),
        ("sk-secret-key live_tpm=1.5", "live_tpm= takes a whole number"),
        ("sk-secret-key live_tpm=", "live_tpm= takes a whole number"),
        ("sk-secret-key live_rpm=1 live_rpm=2", "live_rpm= is given twice"),
        ("sk-secret-key live_rmp=5", "unknown setting live_rmp= (a key's line may set live_rpm=, live_tpm=)"),
        ("sk-secret-key live_rpm=99999999999999999999", "takes a whole number"),
    ],
)
def test_a_bad_setting_is_refused_at_start_naming_its_line_not_its_key(tmp_path, caplog, line, says):
    path = _keys(tmp_path, f"sk-fine\n\n{line}\n")
    with pytest.raises(ValueError) as refused:
        key_settings(path)
    assert says in str(refused.value) and "line 3" in str(refused.value) and "secret" not in str(refused.value)
    settings = Settings(data_dir=tmp_path / "data", api_keys_file=path)
    with pytest.raises(ValueError):
        create_app(settings, EngineService(None))
    assert says in _refused_at_start(settings, caplog)


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("sk-PRIVATE-b sk-PRIVATE-c sk-PRIVATE-d", "its webhook URL must be"),  # three keys on one line
        ("sk-PRIVATE-b   # b's key", "this one has 4 words before its settings (a # comment takes a line of its own)"),
        ("sk-PRIVATE-b http://hooks.example/x", "this one has 2 words"),
        ("sk-PRIVATE-b ftp://hooks.example/x whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "its webhook URL must be"),
        ("sk-PRIVATE-b https://hooks.example/x not-a-secret", "its secret whsec_"),
        ("sk-PRIVATE-\u00fcn", "a key must be printable ASCII"),
        ("sk-PRIVATE-a live_rpm=5", "its key is the key of line 1; give each key one line"),
    ],
)
def test_a_malformed_key_line_is_refused_at_start_naming_its_line_and_no_word_of_it(tmp_path, caplog, line, says):
    path = _keys(tmp_path, f"sk-PRIVATE-a live_rpm=1000\n\n{line}\n")
    logged = _refused_at_start(Settings(data_dir=tmp_path / "data", api_keys_file=path), caplog)
    assert says in logged and "line 3" in logged
    assert "PRIVATE" not in logged and "hooks.example" not in logged


def test_a_key_given_inline_must_be_printable_ascii(tmp_path):
    with pytest.raises(ValueError) as refused:
        Settings(data_dir=tmp_path / "data", api_keys="sk-fine,sk-PRIVATE-\u00fcn").read_api_keys()
    assert "VBATCH_API_KEYS, key 2: a key must be printable ASCII" in str(refused.value)
    assert "PRIVATE" not in str(refused.value)


def test_the_service_limits_are_never_negative():
    with pytest.raises(ValueError):
        Settings(live_rpm=-5)
