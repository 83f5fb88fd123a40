"""vbatch's Prometheus series, beside the engine's own `vllm:` ones.

Each app has its own registry (a process may hold several apps, as the tests do); what happens is counted where
it happens (the engine thread, the webhook sender), and what is true now (batches by status, lines waiting, each
running batch's rates) is read from the database and the live runs at scrape time. It sits in the engine layer
because the engine thread counts into it; the API and the webhook sender, above it, read and count too.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from app.domain.cost import SECONDS_AN_HOUR, apportion, weights
from app.domain.results import Outcome

# The label of every series about one batch: a tenant sees its own batches' series, and no other's id.
BATCH_LABEL = "batch_id"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    # The batch window's series, once an engine serves here (`watch_window`).
    _window: _InFlightWindow | None = None
    # The engine's steps (`app.engine.telemetry.steps`) and the batch's pacing, once an engine serves here
    # (`watch_steps`).
    _steps: Collector | None = None
    _pacing: _Pacing | None = None
    # The engine's time by key and model (`EngineTime`), once an engine serves here: online requests
    # tell it their tokens.
    engine_time: EngineTime | None = None

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.online = OnlineMetrics(self.registry)
        self.requests = Counter(
            "vbatch_requests", "Batch lines that reached a result, by outcome.", ["outcome"], registry=self.registry
        )
        self.tokens = Counter(
            "vbatch_tokens",
            "Tokens of finished batch lines, by kind (prompt, cached, output).",
            ["kind"],
            registry=self.registry,
        )
        self.validation_failures = Counter(
            "vbatch_validation_failures",
            "Input-file problems that failed a batch, by code.",
            ["code"],
            registry=self.registry,
        )
        self.checkpoint_seconds = Histogram(
            "vbatch_checkpoint_seconds",
            "Time to fsync a batch's results and commit its counts.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.publish_seconds = Histogram(
            "vbatch_publish_seconds",
            "Time to turn a batch's results into files and end it.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.webhook_deliveries = Counter(
            "vbatch_webhook_deliveries",
            "Webhook delivery attempts, by outcome (delivered, failed, given_up).",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in ("completed", "failed"):
            self.requests.labels(outcome)
        for kind in ("prompt", "cached", "output"):
            self.tokens.labels(kind)
        for outcome in ("delivered", "failed", "given_up"):
            self.webhook_deliveries.labels(outcome)

    def result(self, outcome: Outcome) -> None:
        self.requests.labels("completed" if outcome.succeeded else "failed").inc()
        usage = outcome.usage
        self.tokens.labels("prompt").inc(usage.get("prompt_tokens") or 0)
        self.tokens.labels("cached").inc((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        self.tokens.labels("output").inc(usage.get("completion_tokens") or 0)

    def watch(self, state: Callable[[], State]) -> None:
        """What is true now, read at every scrape from `state`."""
        self.registry.register(_Now(state))

    def watch_window(
        self,
        numbers: Callable[[], tuple[int, int] | None],
        preemptions: Callable[[], int | None],
        withdrawn: Callable[[], int],
    ) -> None:
        """The batch window's (size, most), the engine's preemptions and the lines the window withdrew, read at every
        scrape; called again (a new context), the new readers replace the old."""
        if self._window is None:
            self._window = _InFlightWindow()
            self.registry.register(self._window)
        self._window.numbers = numbers
        self._window.preemptions = preemptions
        self._window.withdrawn = withdrawn

    def watch_steps(self, steps: Collector, pacing: Callable[[], tuple[bool, int, int, int]]) -> None:
        """The engine's step series (`app.engine.telemetry.steps.EngineSteps`) and the pacing's (active, budget, tokens
        let in, waits: `app.engine.sharing.pacing.PaceNumbers`), read at every scrape; called again, the new ones
        replace the old."""
        if self._steps is not steps:
            if self._steps is not None:
                self.registry.unregister(self._steps)
            self._steps = steps
            self.registry.register(steps)
        if self._pacing is None:
            self._pacing = _Pacing()
            self.registry.register(self._pacing)
        self._pacing.numbers = pacing

    def count_engine_time(self, engine_time: EngineTime) -> None:
        """The `vbatch_*_gpu_seconds` and `vbatch_*_cost_usd` series, from the engine service's `engine_time`."""
        if self.engine_time is not engine_time:
            if self.engine_time is not None:
                self.registry.unregister(self.engine_time)
            self.engine_time = engine_time
            self.registry.register(engine_time)

    def exposition(self, engine_text: bytes, *, shown: Callable[[set[str]], set[str]], key: str | None = None) -> bytes:
        """The engine's series, then vbatch's; of those about one batch (a `batch_id` label) only the ones whose id
        `shown` keeps (given every such id, it returns those the caller may see), and of those about one key (a
        `key` label) only `key`'s (None: every key's)."""
        scoped = CollectorRegistry(auto_describe=False)
        scoped.register(_Scoped(self.registry, shown, key))
        return engine_text + generate_latest(scoped)


class _Scoped(Collector):
    """`registry`'s series, less those about a batch that `shown` does not keep."""

    def __init__(self, registry: CollectorRegistry, shown: Callable[[set[str]], set[str]], key: str | None) -> None:
        self.registry = registry
        self.shown = shown
        self.key = key

    def collect(self) -> Iterator[Metric]:
        families = list(self.registry.collect())
        ids = {sample.labels[BATCH_LABEL] for family in families for sample in family.samples if _about_a_batch(sample)}
        kept = self.shown(ids) if ids else set()
        for family in families:
            scoped = Metric(family.name, family.documentation, family.type, family.unit)
            scoped.samples = [
                s
                for s in family.samples
                if (not _about_a_batch(s) or s.labels[BATCH_LABEL] in kept)
                and (self.key is None or s.labels.get(KEY_LABEL, self.key) == self.key)
            ]
            yield scoped


def _about_a_batch(sample: Sample) -> bool:
    return BATCH_LABEL in sample.labels


class State:
    """What a scrape reads: filled in by the app from the database and the engine service."""

    def __init__(
        self,
        *,
        batches_by_status: dict[str, int],
        lines_waiting: int,
        running: dict[str, tuple[float, float]],
        engine_deaths: int,
        engine_up: bool,
        disk_free_bytes: int | None = None,
        disk_reserve_held: bool | None = None,
    ) -> None:
        self.batches_by_status = batches_by_status
        self.lines_waiting = lines_waiting
        self.running = running  # batch id -> (requests/s, output tokens/s)
        self.engine_deaths = engine_deaths
        self.engine_up = engine_up
        self.disk_free_bytes = disk_free_bytes  # of the data directory's file system (None: not known here)
        self.disk_reserve_held = disk_reserve_held


class _Now(Collector):
    def __init__(self, state: Callable[[], State]) -> None:
        self.state = state

    def describe(self) -> list:
        return []  # described at collection only: a scrape, not registration, reads the database

    def collect(self) -> Iterator[Any]:
        now = self.state()
        batches = GaugeMetricFamily("vbatch_batches", "Batches by status.", labels=["status"])
        for status, count in sorted(now.batches_by_status.items()):
            batches.add_metric([status], count)
        yield batches
        yield GaugeMetricFamily(
            "vbatch_lines_waiting", "Lines of active batches without a result yet.", value=now.lines_waiting
        )
        rates = GaugeMetricFamily(
            "vbatch_batch_requests_per_second", "Each running batch's requests a second.", labels=[BATCH_LABEL]
        )
        tokens = GaugeMetricFamily(
            "vbatch_batch_output_tokens_per_second",
            "Each running batch's output tokens a second.",
            labels=[BATCH_LABEL],
        )
        for batch_id, (requests_per_second, tokens_per_second) in sorted(now.running.items()):
            rates.add_metric([batch_id], requests_per_second)
            tokens.add_metric([batch_id], tokens_per_second)
        yield rates
        yield tokens
        yield CounterMetricFamily(
            "vbatch_engine_restarts", "Engine deaths after which a new engine was started.", value=now.engine_deaths
        )
        yield GaugeMetricFamily("vbatch_engine_up", "1 while the engine serves.", value=1 if now.engine_up else 0)
        yield from _disk(now)


def _disk(now: State) -> Iterator[Any]:
    """Room on the data directory's disk (`app.core.disk`): what an alert watches before it fills."""
    if now.disk_free_bytes is not None:
        yield GaugeMetricFamily(
            "vbatch_disk_free_bytes", "Free bytes on the data directory's file system.", value=now.disk_free_bytes
        )
    if now.disk_reserve_held is not None:
        yield GaugeMetricFamily(
            "vbatch_disk_reserve_held",
            "1 while the disk reserve is held; 0 once the disk filled and it was released (uploads get 507, running "
            "batches end, /health says unavailable) until there is room again.",
            value=1 if now.disk_reserve_held else 0,
        )


# The batch window (`app.engine.sharing.window`) and the engine's preemptions, read at scrape time from the process that
# runs the engine (an API replica, with none, shows neither).


class _InFlightWindow(Collector):
    def __init__(self) -> None:
        self.numbers: Callable[[], tuple[int, int] | None] = lambda: None
        self.preemptions: Callable[[], int | None] = lambda: None
        self.withdrawn: Callable[[], int] = lambda: 0

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Metric]:
        numbers = self.numbers()
        if numbers is not None:
            size, max_size = numbers
            yield GaugeMetricFamily(
                "vbatch_batch_window",
                "Batch lines the engine may have in flight now: below vbatch_batch_window_max while online requests "
                "are over their time-to-first-token target.",
                value=size,
            )
            yield GaugeMetricFamily(
                "vbatch_batch_window_max",
                "The most batch lines in flight at once (VBATCH_MAX_IN_FLIGHT).",
                value=max_size,
            )
            yield CounterMetricFamily(
                "vbatch_batch_lines_withdrawn",
                "Batch lines withdrawn from the engine to seat an online request at once (since the engine started): "
                "their requests aborted, each runs again later and still ends once.",
                value=self.withdrawn(),
            )
        preemptions = self.preemptions()
        if preemptions is not None:
            yield CounterMetricFamily(
                "vbatch_batch_preemptions",
                "Requests the engine preempted (vllm:num_preemptions, since the engine started). The engine counts "
                "every preemption; it preempts the running request of the worst priority first and online requests "
                "run at a better one than batch lines, so in practice these are batch lines preempted for online ones.",
                value=preemptions,
            )


class _Pacing(Collector):
    """The batch's pacing while live requests are about (`app.engine.sharing.pacing`)."""

    def __init__(self) -> None:
        self.numbers: Callable[[], tuple[bool, int, int, int]] = lambda: (False, 0, 0, 0)

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Metric]:
        active, budget, handed, waited = self.numbers()
        yield GaugeMetricFamily(
            "vbatch_batch_paced",
            "1 while live requests are about and batch lines enter the engine paced.",
            value=int(active),
        )
        yield GaugeMetricFamily(
            "vbatch_batch_prefill_budget_tokens",
            "Batch prompt tokens that may enter each engine step while paced (VBATCH_LIVE_PREFILL_TOKENS, or derived "
            "from VBATCH_LIVE_TTFT_TARGET_MS and the engine's step times).",
            value=budget,
        )
        yield CounterMetricFamily(
            "vbatch_batch_paced_prompt_tokens",
            "Batch prompt tokens let into the engine while paced (estimated from characters), since the engine "
            "started.",
            value=handed,
        )
        yield CounterMetricFamily(
            "vbatch_batch_pace_waits", "Times a batch line waited for the next engine step to enter.", value=waited
        )


# Online requests (issue 29): measured by the API's online routes as each answer passes through them.

# The label of every series about one key: its owner id (`app.core.auth.owner_of`), never the key; a tenant sees
# its own key's series only, as it sees only its own batches'.
KEY_LABEL = "key"
ANONYMOUS_KEY = "anonymous"  # requests made while no keys are configured
# From a short prompt on an idle engine to a long answer behind a busy one.
ONLINE_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
# The console's online rates are over the answers that ended in this many seconds.
ONLINE_RATE_SECONDS = 10.0


def key_label(owner: str) -> str:
    return owner or ANONYMOUS_KEY


class OnlineMetrics:
    """The `vbatch_live_*` series (by key and model), and this process's recent online rates."""

    def __init__(self, registry: CollectorRegistry) -> None:
        by_key_and_model = [KEY_LABEL, "model"]
        self.time_to_first_token = Histogram(
            "vbatch_live_time_to_first_token_seconds",
            "Online streams: from the request's arrival to its first event that carries output.",
            by_key_and_model,
            buckets=ONLINE_LATENCY_BUCKETS,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            "vbatch_live_inter_token_latency_seconds",
            "Online streams: between two events that carry output (an event is a token as vLLM streams by default).",
            by_key_and_model,
            buckets=INTER_TOKEN_BUCKETS,
            registry=registry,
        )
        self.request_seconds = Histogram(
            "vbatch_live_request_seconds",
            "Online requests the engine answered: from their arrival to their answer's last byte.",
            by_key_and_model,
            buckets=ONLINE_LATENCY_BUCKETS,
            registry=registry,
        )
        self.requests = Counter(
            "vbatch_live_requests",
            "Online requests answered, by key, model, endpoint and HTTP status (refusals included).",
            [KEY_LABEL, "model", "endpoint", "status"],
            registry=registry,
        )
        self.rates = OnlineRates()

    def answered(self, *, key: str, model: str, endpoint: str, status: int) -> None:
        self.requests.labels(key, model, endpoint, str(status)).inc()

    def ended(self, *, key: str, model: str, seconds: float, output_tokens: int) -> None:
        """An answer from the engine ended (its last byte sent, or its client gone)."""
        self.request_seconds.labels(key, model).observe(seconds)
        self.rates.record(output_tokens)


class OnlineRates:
    """This process's online answers of the last `ONLINE_RATE_SECONDS`: requests and output tokens a second, for the
    console. Any thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._ended: deque[tuple[float, int]] = deque()

    def record(self, output_tokens: int) -> None:
        with self._lock:
            self._ended.append((self._clock(), output_tokens))
            self._forget()

    def rates(self) -> tuple[float, float]:
        """(requests/s, output tokens/s)."""
        with self._lock:
            self._forget()
            tokens = sum(output for _, output in self._ended)
            return len(self._ended) / ONLINE_RATE_SECONDS, tokens / ONLINE_RATE_SECONDS

    def _forget(self) -> None:
        since = self._clock() - ONLINE_RATE_SECONDS
        while self._ended and self._ended[0][0] < since:
            self._ended.popleft()


# Who used the engine's time (`app.domain.cost`): the live engine says when requests enter and leave it, batch runs
# and online requests say the tokens each finished request used, and whoever reads (a batch's checkpoint, a scrape)
# settles the time since the last settling between those tokens.
#
# Busy time is charged when tokens come to pay it: a request's tokens are known only when it finishes, so the time
# of requests still in flight waits for them (and time spent on requests that end with no tokens, aborted or
# withdrawn, goes to the next that finish). Time with nothing in flight is never counted. On a CPU build there is no
# GPU: the engine counts as its device count all the same, so `gpu_seconds` are then engine-seconds.

BATCH = "batch"
LIVE = "live"  # online requests, as the `vbatch_live_*` series name them


@dataclass(frozen=True)
class Payer:
    """Whose tokens: a batch (`batch_id`) or online requests (`LIVE`), of one key (its label) and model."""

    kind: str
    key: str
    model: str
    batch_id: str | None = None


class EngineTime(Collector):
    """Any thread. `devices`: the engine's GPUs (tensor x data parallel); `price`: USD per GPU-hour, or None."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.devices = 1
        self.price: float | None = None
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight = 0
        self._busy_since: float | None = None  # while something is in flight: since when, or the last settling
        self._unpaid = 0.0  # busy seconds no tokens have paid for yet
        self._tokens: dict[Payer, int] = {}  # of requests finished since the last settling
        self._answered_seconds = 0.0  # in flight, of requests answered since the last settling
        self._unanswered: dict[Payer, float] = {}  # in flight, of requests that left unanswered since, by payer
        self._owed: dict[str, float] = {}  # each batch's GPU-seconds its run has not taken yet
        self._totals: dict[tuple[str, str, str], float] = {}  # (kind, key, model): GPU-seconds since start

    def started(self) -> None:
        """A request entered the engine."""
        with self._lock:
            if self._in_flight == 0:
                self._busy_since = self._clock()
            self._in_flight += 1

    def ended(self) -> None:
        """A request left the engine (answered, failed or aborted)."""
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0 and self._busy_since is not None:
                self._unpaid += self._clock() - self._busy_since
                self._busy_since = None

    def used(self, payer: Payer, tokens: int) -> None:
        """A finished request's tokens (`app.domain.cost.weighed_tokens`)."""
        if tokens > 0:
            with self._lock:
                self._tokens[payer] = self._tokens.get(payer, 0) + tokens

    def timed(self, payer: Payer, seconds: float, *, answered: bool) -> None:
        """A request's seconds in flight, once it has left the engine: answered (its tokens come to `used`), or not
        (withdrawn, cancelled, its engine dead), when its seconds weigh for it (`app.domain.cost.weights`)."""
        with self._lock:
            if answered:
                self._answered_seconds += seconds
            else:
                self._unanswered[payer] = self._unanswered.get(payer, 0.0) + seconds

    def take(self, batch_id: str) -> float:
        """The batch's GPU-seconds since its last take, settled up to now."""
        with self._lock:
            self._apportion_unpaid()
            return self._owed.pop(batch_id, 0.0)

    def totals(self) -> dict[tuple[str, str, str], float]:
        """GPU-seconds by (kind, key, model) since this service started, settled up to now."""
        with self._lock:
            self._apportion_unpaid()
            return dict(self._totals)

    def _apportion_unpaid(self) -> None:
        if self._busy_since is not None:
            now = self._clock()
            self._unpaid += now - self._busy_since
            self._busy_since = now
        shares = apportion(self._unpaid * self.devices, weights(self._tokens, self._answered_seconds, self._unanswered))
        if not shares:
            return
        self._unpaid, self._tokens, self._answered_seconds, self._unanswered = 0.0, {}, 0.0, {}
        for payer, seconds in shares.items():
            label = (payer.kind, payer.key, payer.model)
            self._totals[label] = self._totals.get(label, 0.0) + seconds
            if payer.batch_id is not None:
                self._owed[payer.batch_id] = self._owed.get(payer.batch_id, 0.0) + seconds

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[CounterMetricFamily]:
        totals = self.totals()
        price = self.price
        for kind, whose in ((BATCH, "batch lines"), (LIVE, "online requests")):
            seconds = CounterMetricFamily(
                f"vbatch_{kind}_gpu_seconds",
                f"Engine time {whose} used, in GPU-seconds (busy time x the engine's GPUs, shared by tokens; "
                "engine-seconds on a CPU build), by key and model.",
                labels=[KEY_LABEL, "model"],
            )
            cost = CounterMetricFamily(
                f"vbatch_{kind}_cost_usd",
                f"What {whose} cost at VBATCH_GPU_HOUR_PRICE, in USD, by key and model.",
                labels=[KEY_LABEL, "model"],
            )
            for (of, key, model), used in sorted(totals.items()):
                if of == kind:
                    seconds.add_metric([key, model], used)
                    if price is not None:
                        cost.add_metric([key, model], used / SECONDS_AN_HOUR * price)
            yield seconds
            if price is not None:
                yield cost
