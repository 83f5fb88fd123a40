"""The two loads of the online benchmark (bench/online.py) and how they are timed: an open-loop client that streams
chat requests on a Poisson schedule and times each answer's server-sent events as they arrive, and a batch client
that keeps a fixed number of non-streamed requests in flight (what a `vllm serve` user does with a batch today).

Every time here is `time.monotonic()`: one clock (CLOCK_MONOTONIC) for the bench and the batch client's process.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

AUTH = {"Authorization": "Bearer bench"}
# Support-ticket words (the seed's tickets are about these) and plain English: about one token each.
WORD_TEXT = (
    "customer billing login latency export permissions invoice account password region cluster node gpu queue "
    "job error timeout retry quota limit storage bucket upload download network firewall token key dashboard "
    "report usage charge refund plan upgrade downgrade support ticket engineer outage incident restart deploy "
    "model batch request response server client browser session cookie email phone team admin role access "
    "the a of to and in is it that for on was with as at by from this be have not are but or an they which you "
    "were all we when there can more if no out so said what up its about into than them only other new some "
    "could time these two may then do first any my now such like our over man me even most made after also"
)
WORDS = WORD_TEXT.split()


def online_prompt(rng: random.Random, number: int, words: int) -> str:
    """About `words` + 12 tokens. The request's number comes first, so its first cache block is its own: no request
    is helped by another's prefix in the cache."""
    notes = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"Request {number}. Summarise these support notes in three sentences: {notes}"


def online_bodies(model: str, count: int, *, words: int, max_tokens: int, sampling: dict, seed: int) -> list[dict]:
    """`count` streamed chat bodies, the same for every side given the same seed."""
    rng = random.Random(seed)
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    return [
        {"model": model, "messages": [{"role": "user", "content": online_prompt(rng, seed * 1_000_000 + n, words)}],
         **sampling, "max_tokens": max_tokens, **stream}
        for n in range(count)
    ]  # fmt: skip


def poisson_schedule(rate: float, seconds: float, seed: int) -> list[float]:
    """Send times (seconds from the start, under `seconds`) of a Poisson process of `rate` a second: independent
    exponential gaps, drawn from `seed`."""
    rng = random.Random(seed)
    times: list[float] = []
    now = rng.expovariate(rate)
    while now < seconds:
        times.append(now)
        now += rng.expovariate(rate)
    return times


def percentile(values: Iterable[float], q: float) -> float | None:
    """The `q` quantile (0 to 1), linear between the two nearest ranks (numpy's default); None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = q * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def series_total(text: str, name: str) -> float | None:
    """The sum of a Prometheus series' samples over its labels (`name` as written, e.g. with `_total`); None when
    the text has none."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith("#") or not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        after = line[line.rindex("}") + 1 :] if "{" in line else line[len(name) :]
        total, seen = total + float(after.split()[0]), True
    return total if seen else None


@dataclass
class StreamTimes:
    """When each part of one streamed answer arrived."""

    content_at: list[float] = field(default_factory=list)
    done_at: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None


class SseTimer:
    """Reads server-sent events as their bytes arrive, cut anywhere; an event is timed by the arrival of the bytes
    that end it, the moment a client could show it. An event carrying text (a delta with content) is a token."""

    def __init__(self) -> None:
        self.times = StreamTimes()
        self._pending = b""

    def feed(self, at: float, chunk: bytes) -> None:
        # A "\r\n" cut between two chunks is joined before the line ends are made one.
        self._pending = (self._pending + chunk).replace(b"\r\n", b"\n")
        *events, self._pending = self._pending.split(b"\n\n")
        for event in events:
            self._event(at, event)

    def _event(self, at: float, event: bytes) -> None:
        lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
        if not lines:
            return  # a comment or a keep-alive
        data = b"\n".join(lines)
        if data.strip() == b"[DONE]":
            self.times.done_at = at
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            self.times.error = f"not JSON: {data[:80]!r}"
            return
        if not isinstance(chunk, dict) or "error" in chunk or chunk.get("object") == "error":
            self.times.error = f"error event: {str(chunk)[:160]}"
            return
        if any(_carries_text(choice) for choice in chunk.get("choices") or []):
            self.times.content_at.append(at)
        if chunk.get("usage"):
            self.times.prompt_tokens = chunk["usage"].get("prompt_tokens")
            self.times.completion_tokens = chunk["usage"].get("completion_tokens")


def _carries_text(choice: Any) -> bool:
    delta = choice.get("delta") if isinstance(choice, dict) else None
    return isinstance(delta, dict) and any(delta.get(key) for key in ("content", "reasoning_content", "reasoning"))


@dataclass
class Answer:
    """One online request: when it was due (seconds into its window), when it went out, and what came back."""

    due: float
    sent_at: float
    lag: float
    times: StreamTimes
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.times.error is None and self.times.done_at is not None

    def ttft(self) -> float | None:
        return self.times.content_at[0] - self.sent_at if self.ok and self.times.content_at else None

    def itls(self) -> list[float]:
        at = self.times.content_at
        return [b - a for a, b in itertools.pairwise(at)] if self.ok else []

    def e2e(self) -> float | None:
        return self.times.done_at - self.sent_at if self.ok and self.times.done_at is not None else None

    def reason(self) -> str | None:
        if self.ok:
            return None
        return self.error or self.times.error or "the stream ended without [DONE]"


def summarize(answers: Sequence[Answer]) -> dict:
    """Latencies of the answered requests (TTFT and ITL in ms, end to end in s) and why the others failed."""
    done = [a for a in answers if a.ok]
    ttft = [t for a in done if (t := a.ttft()) is not None]
    itl = [gap for a in done for gap in a.itls()]
    e2e = [t for a in done if (t := a.e2e()) is not None]
    prompts = [a.times.prompt_tokens for a in done if a.times.prompt_tokens]

    def ms(values: list, q: float) -> float | None:
        value = percentile(values, q)
        return None if value is None else round(value * 1000, 1)

    return {
        "sent": len(answers),
        "done": len(done),
        "failed": len(answers) - len(done),
        "errors": dict(Counter(a.reason() for a in answers if not a.ok).most_common(5)),
        "ttft_p50_ms": ms(ttft, 0.5),
        "ttft_p99_ms": ms(ttft, 0.99),
        "itl_p50_ms": ms(itl, 0.5),
        "itl_p99_ms": ms(itl, 0.99),
        "e2e_p50_s": None if not e2e else round(percentile(e2e, 0.5) or 0, 3),
        "e2e_p99_s": None if not e2e else round(percentile(e2e, 0.99) or 0, 3),
        "prompt_tokens_mean": round(sum(prompts) / len(prompts), 1) if prompts else None,
        "output_tokens": sum(a.times.completion_tokens or 0 for a in done),
        "send_lag_max_ms": round(max((a.lag for a in answers), default=0) * 1000, 1),
    }


def raw_rows(answers: Sequence[Answer]) -> list[list]:
    """One row per request, for the results file: [due s, ttft ms, e2e s, tokens, error]."""
    return [
        [round(a.due, 3), None if a.ttft() is None else round((a.ttft() or 0) * 1000, 1),
         None if a.e2e() is None else round(a.e2e() or 0, 3), len(a.times.content_at), a.reason()]
        for a in answers
    ]  # fmt: skip


def tokens_between(answers: Sequence[Answer], start: float, end: float) -> int:
    """Online tokens that arrived in [start, end], each text event one token (vLLM streams one a step)."""
    return sum(start <= at <= end for a in answers for at in a.times.content_at)


async def stream_one(http: httpx.AsyncClient, url: str, body: dict, due: float, start: float, end_by: float) -> Answer:
    """One streamed request, timed; a stream still open at `end_by` is cut and counted as failed."""
    sent_at = time.monotonic()
    timer = SseTimer()
    error = None
    try:
        async with asyncio.timeout_at(end_by), http.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                error = f"HTTP {response.status_code}: {(await response.aread())[:120]!r}"
            else:
                async for chunk in response.aiter_bytes():
                    timer.feed(time.monotonic(), chunk)
    except TimeoutError:
        error = "still open at the end of the tail"
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {str(exc)[:120]}"
    return Answer(due=due, sent_at=sent_at, lag=sent_at - (start + due), times=timer.times, error=error)


async def open_loop(url: str, bodies: Sequence[dict], schedule: Sequence[float], start: float, end_by: float) -> list:
    """Sends body i at `start` + schedule[i] whether or not the earlier ones have been answered (an open loop: a
    slow server gets more requests in flight, not fewer)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600, connect=30), headers=AUTH) as http:
        tasks = []
        for body, due in zip(bodies, schedule, strict=False):
            await asyncio.sleep(max(0.0, start + due - time.monotonic()))  # the schedule itself
            tasks.append(asyncio.create_task(stream_one(http, url, body, due, start, end_by)))
        return list(await asyncio.gather(*tasks))


def push_batch(url: str, tickets: str, concurrency: int, stop: Any, records: str) -> None:
    """In a process of its own, so that its work never delays the online client: keeps `concurrency`
    non-streamed requests in flight, each line of the tickets file once, until `stop` (an Event) is set; writes
    [finished_at, completion_tokens] of every answer, the failures, whether the file ran out and its own peak memory
    to `records`, every second as well as at the end, so a process killed from outside still leaves what it saw."""
    import resource

    _, most = resource.getrlimit(resource.RLIMIT_NOFILE)  # a socket per request in flight: 2,048 by default
    resource.setrlimit(resource.RLIMIT_NOFILE, (most, most))
    bodies = [json.loads(line)["body"] for line in Path(tickets).read_text().splitlines()]
    asyncio.run(_push(url, bodies, concurrency, stop, Path(records)))


async def _push(url: str, bodies: list[dict], concurrency: int, stop: Any, records: Path) -> None:
    import resource

    lines = iter(bodies)  # shared by the workers: each line is sent once
    seen: dict[str, Any] = {"finished": [], "failures": Counter(), "ran_out": False, "ended": False}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    def write() -> None:
        seen["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
        records.with_suffix(".tmp").write_text(json.dumps(seen))
        records.with_suffix(".tmp").replace(records)

    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(900, connect=120), headers=AUTH) as http:

        async def worker() -> None:
            for body in lines:
                try:
                    response = await http.post(url, json=body)
                except httpx.HTTPError as exc:
                    seen["failures"][type(exc).__name__] += 1
                    continue
                if response.status_code == 200:
                    seen["finished"].append([time.monotonic(), response.json()["usage"]["completion_tokens"]])
                else:
                    seen["failures"][f"HTTP {response.status_code}"] += 1

        workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
        ticks = 0
        while not stop.is_set() and not all(w.done() for w in workers):
            await asyncio.sleep(0.2)  # `stop` is another process's Event: nothing to await on
            ticks += 1
            if ticks % 5 == 0:
                write()
        seen["ran_out"] = all(w.done() for w in workers)
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    seen["ended"] = True
    write()
