"""The operator's kit in monitoring/: the Grafana dashboard and the Prometheus alert rules name only series vbatch
exports (the registry of a real app, as the metrics reference reads it), show vbatch's beside vLLM's, and alert on
what an operator must hear about. The `vllm:` series are checked against the real engine in
tests/e2e/test_monitoring_kit_e2e.py."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from app.reference import metrics
from tests.helpers import app_on

KIT = Path(__file__).resolve().parents[2] / "monitoring"
DASHBOARD = KIT / "grafana" / "vbatch-dashboard.json"
ALERTS = KIT / "prometheus" / "vbatch-alerts.yml"
# A series name in PromQL: vbatch's and vLLM's (label names, functions and keywords are none of these).
SERIES = re.compile(r"\b(vbatch_[a-z0-9_]+|vllm:[a-z0-9_:]+)")


def dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel.get("targets", [])]


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def named(exprs: list[str]) -> set[str]:
    return {name for expr in exprs for name in SERIES.findall(expr)}


def vbatch_names() -> set[str]:
    return {name for series in metrics.documented() for name in series.exposed}


def test_every_vbatch_series_the_kit_names_is_exported():
    exported = vbatch_names()
    for source, exprs in (("dashboard", dashboard_exprs()), ("alerts", [rule["expr"] for rule in alert_rules()])):
        unknown = sorted(name for name in named(exprs) if name.startswith("vbatch_") and name not in exported)
        assert not unknown, f"the {source} names series vbatch does not export: {unknown}"


def test_the_dashboard_shows_vbatch_beside_vllm_on_what_operators_watch():
    exprs = dashboard_exprs()
    names = named(exprs)
    assert {name for name in names if name.startswith("vllm:")}, "no vLLM series beside vbatch's"
    wanted = {
        "batch progress": "vbatch_batch_requests_per_second",
        "queue": "vbatch_lines_waiting",
        "window": "vbatch_batch_window",
        "live TTFT": "vbatch_live_time_to_first_token_seconds_bucket",
        "live ITL": "vbatch_live_inter_token_latency_seconds_bucket",
        "step time": "vllm:inter_token_latency_seconds_bucket",
        "GPU-seconds": "vbatch_batch_gpu_seconds_total",
        "errors": "vbatch_validation_failures_total",
    }
    missing = [what for what, name in wanted.items() if name not in names]
    assert not missing, missing
    assert all(expr.count("(") == expr.count(")") for expr in exprs)


def test_the_alerts_cover_what_an_operator_must_hear_about():
    rules = {rule["alert"]: rule for rule in alert_rules()}
    wanted = {
        "VbatchBatchStuck": "vbatch_requests_total",
        "VbatchEngineRestarting": "vbatch_engine_restarts_total",
        "VbatchDiskLow": "vbatch_disk_free_bytes",
        "VbatchWebhookDeliveriesFailing": "vbatch_webhook_deliveries_total",
        "VbatchLiveTTFTOverTarget": "vbatch_live_time_to_first_token_seconds_bucket",
    }
    for alert, series in wanted.items():
        assert alert in rules and series in rules[alert]["expr"], alert
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
        assert rule["expr"].count("(") == rule["expr"].count(")"), name


def test_a_series_the_app_does_not_export_is_caught():
    """The check above means something: a misspelt series is not among the exported ones."""
    exported = vbatch_names()
    assert "vbatch_requests_total" in exported and "vbatch_live_time_to_first_token_seconds_bucket" in exported
    assert "vbatch_request_total" not in exported and "vbatch_requests" not in exported
    assert named(['sum(rate(vbatch_request_total{outcome="x"}[5m])) / vllm:num_requests_running']) == {
        "vbatch_request_total",
        "vllm:num_requests_running",
    }


def test_the_disk_the_alerts_watch_is_on_metrics(settings):
    """VbatchDiskLow and VbatchDiskFull read these: free bytes of the data directory's file system, and whether the
    disk reserve is held (it is, on a disk with room)."""
    with app_on(settings) as client:
        scraped = {
            sample.name: sample.value
            for family in text_string_to_metric_families(client.get("/metrics").text)
            for sample in family.samples
        }
    free = shutil.disk_usage(settings.data_dir).free
    assert scraped["vbatch_disk_reserve_held"] == 1
    assert abs(scraped["vbatch_disk_free_bytes"] - free) < 64 * 1024 * 1024  # the same disk, moments apart
