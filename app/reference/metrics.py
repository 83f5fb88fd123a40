"""Every series vbatch adds to `/metrics`: its exposed name, type, labels and help, read from the registry of a real
app (`app.main.create_app`, over the fake engine of `app.testing`, a price set) once its engine serves: every
collector the app and its engine service attach is there, as a scrape would find them, with no second wiring here to
drift from theirs."""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from app.core.config import Settings
from app.engine.service import EngineService
from app.main import create_app
from app.reference.markdown import cell, code, generated, table
from app.testing import FakeEngine

# What the exposition adds to a family's name: counters are scraped as NAME_total, histograms as NAME_bucket,
# NAME_sum and NAME_count.
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
ENGINE_START_SECONDS = 30.0


@dataclass(frozen=True)
class Series:
    name: str  # the family's name, as prometheus_client keeps it
    type: str
    labels: tuple[str, ...]
    help: str

    @property
    def exposed(self) -> list[str]:
        """The sample names a scrape shows."""
        return [self.name + suffix for suffix in SUFFIXES.get(self.type, ("",))]


def _served_registry() -> list[Series]:
    """The series of an app whose (fake) engine serves, with a GPU-hour price (the cost series exist only then)."""
    with tempfile.TemporaryDirectory() as data:
        settings = Settings(data_dir=Path(data), gpu_hour_price=1.0, disk_reserve_bytes=0)
        engine = EngineService(FakeEngine())
        with TestClient(create_app(settings, engine)) as client:
            deadline = time.monotonic() + ENGINE_START_SECONDS
            while engine.batch_window is None:  # None until the engine serves, its series attached
                if time.monotonic() > deadline:
                    raise RuntimeError("the fake engine did not start: no registry to document")
                time.sleep(0.05)
            return _series(client.app.state.metrics.registry)  # type: ignore[attr-defined]


def documented() -> list[Series]:
    return _served_registry()


def _series(registry: CollectorRegistry) -> list[Series]:
    declared = _declared_labels(registry)
    found = []
    for family in registry.collect():
        labels = {name for sample in family.samples for name in sample.labels}
        labels |= set(getattr(family, "_labelnames", ()) or declared.get(family.name, ()))
        labels.discard("le")  # a histogram's buckets, not a label of its own
        found.append(Series(family.name, family.type, tuple(sorted(labels)), family.documentation))
    return sorted(found, key=lambda series: series.name)


def _declared_labels(registry: CollectorRegistry) -> dict[str, tuple[str, ...]]:
    """The labels of the registry's own metric objects, which show none until a child is made."""
    collectors = getattr(registry, "_collector_to_names", {})
    return {
        getattr(collector, "_name", ""): tuple(getattr(collector, "_labelnames", ()))
        for collector in collectors
        if getattr(collector, "_labelnames", None)
    }


def page() -> str:
    rows = [
        (
            "<br>".join(code(name) for name in series.exposed),
            series.type,
            ", ".join(code(label) for label in series.labels) or "",
            cell(series.help),
        )
        for series in documented()
    ]
    return (
        "# Metrics\n\n"
        + generated("app/engine/telemetry/metrics.py: the registry the app wires, with its help texts")
        + "`GET /metrics` answers in Prometheus' text format: first the engine's own `vllm:` series, exactly as "
        "`vllm serve` exposes them (from vLLM's registry; see [vLLM's metrics](https://docs.vllm.ai/en/latest/"
        "design/metrics.html)), then vbatch's, below. With keys configured it needs one, and a key sees the "
        "service-wide series, the per-batch series (`batch_id`) of its own batches only and the per-key series "
        "(`key`, the key's owner id, never the key) of its own key only. An API replica (`vbatch api`) has no "
        "engine: the engine's series, the batch window's and the per-batch rates are on each worker's `/metrics`.\n\n"
        "The cost series (`*_cost_usd_total`) exist only with `VBATCH_GPU_HOUR_PRICE` set; the batch window's only "
        "where an engine runs. How to scrape, the Grafana dashboard and the alert rules: "
        "[Monitoring](../how-to/monitoring.md).\n\n" + table(("series", "type", "labels", "what it counts"), rows)
    )
