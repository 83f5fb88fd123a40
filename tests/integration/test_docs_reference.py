"""The docs' generated reference (app/reference) covers what the code defines: every setting with its description,
every command's own flags with their help, every engine flag, every series the app exports, every route of the
OpenAPI document and every error code raised; and each command's --help says its own options first."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from app import cluster
from app.core.config import Settings
from app.openapi import served_openapi
from app.reference import cli, errors, http, metrics, settings
from tests.helpers import app_on, request_line, wait_for

ROOT = Path(__file__).resolve().parents[2]


# Settings


def test_every_setting_has_a_description_and_a_row():
    documented = {setting.name: setting for setting in settings.documented()}
    assert set(documented) == set(Settings.model_fields)
    undescribed = [name for name, setting in documented.items() if len(setting.description.split()) < 3]
    assert not undescribed, f"settings with no comment above them in app/core/config.py: {undescribed}"
    page = settings.page()
    missing = [s.variable for s in documented.values() if f"| `{s.variable}`<br>" not in page]
    assert not missing, missing


def test_a_comment_describes_the_fields_right_below_it_and_no_other():
    source = """
class Settings:
    model_config = 1

    # Where the data lives.
    data_dir: Path = Path("data")
    # Bearer keys, inline or in a file.
    api_keys: str = ""
    api_keys_file: Path | None = None

    undescribed: int = 3
    # The last one.
    last: float = 1.0
"""
    found = settings._fields(source)
    assert found["data_dir"] == ("Path", "Where the data lives.")
    assert found["api_keys"][1] == found["api_keys_file"][1] == "Bearer keys, inline or in a file."
    assert found["undescribed"] == ("int", "")
    assert found["last"][1] == "The last one."


# Commands and flags


def test_every_command_flag_has_help_and_an_entry():
    from app.engine.inference.vllm_adapter import run_batch_parser

    engine = cli.engine_parser()
    vllm_flags = {
        flag for parser in (engine, run_batch_parser("x")) for a in parser._actions for flag in a.option_strings
    }
    page = cli.page()
    for command in cli.COMMANDS:
        assert f"## vbatch {command.name}\n" in page
        for action in cli.own_actions(command, engine):
            shown = cli.code(cli.flags(action))
            assert f"| {shown}" in page, f"vbatch {command.name}: {cli.flags(action)} has no entry"
            if not set(action.option_strings) & vllm_flags:  # vbatch's own, not vLLM's (whose help vLLM writes)
                assert action.help, f"vbatch {command.name}: {cli.flags(action)} has no help"


def test_the_engine_flags_page_lists_every_flag_of_vllm_serve():
    page = cli.engine_args_page()
    engine = cli.engine_parser()
    missing = [
        cli.flags(a) for a in engine._actions if not cli._is_help(a) and f"| {cli.code(cli.flags(a))}" not in page
    ]
    assert not missing, missing
    assert len(engine._actions) > 200  # vLLM's, not a handful


def test_cluster_help_says_its_own_options_and_not_the_workers(capsys):
    cluster.main(["--help"])
    shown = capsys.readouterr().out
    assert shown.startswith("usage: vbatch cluster")
    assert "usage: vbatch worker" not in shown
    for own in ("--replicas", "--pool", "--gpus-per-replica", "--cpus-per-replica", "--ray-address", "--data-dir"):
        assert own in shown
    assert "vbatch cluster scale N" in shown
    assert "--max-num-batched-tokens" not in shown  # an engine flag: `vbatch worker --help` lists those
    with pytest.raises(SystemExit) as done:
        cluster.main(["scale", "--help"])
    assert done.value.code == 0 and "The pool's new number of replicas." in capsys.readouterr().out


def test_serve_help_says_its_own_options_first():
    from app.launch import service_parser

    shown = service_parser("serve").format_help()
    own = shown.index("vbatch options:")
    assert shown.startswith("usage: vbatch serve [vbatch options] [vLLM engine args]")
    assert own < shown.index("--data-dir") < shown.index("Config Groups")
    assert "--insecure-no-auth" in shown[own : shown.index("Config Groups")]


# Metrics


def _families(text: str) -> dict[str, str]:
    return {family.name: family.type for family in text_string_to_metric_families(text)}


def test_every_series_the_app_exports_has_an_entry(settings):
    """The generator's registry is wired as the app's: a scrape of the real app (fake engine, a price set, an
    online request made) shows exactly the series the page lists."""
    settings.gpu_hour_price = 1.0
    with app_on(settings) as client:
        assert client.post("/v1/chat/completions", json=request_line("x")["body"]).status_code == 200
        # The engine's batch side (its window and pacing series) is wired once the engine is up, which an online
        # answer does not wait for: on a busy machine (tests on two workers) a first scrape can come before it.
        scraped = wait_for(
            lambda: (found := _families(client.get("/metrics").text)).get("vbatch_batch_window") and found
        )
    # `_created`: prometheus_client's creation times of counters and histograms, which the parser reads as gauges.
    exported = {
        name: kind for name, kind in scraped.items() if name.startswith("vbatch_") and not name.endswith("_created")
    }
    documented = {series.name: series.type for series in metrics.documented()}
    assert exported == documented
    page = metrics.page()
    for series in metrics.documented():
        assert series.help, f"{series.name} has no help text"
        assert all(f"`{name}`" in page for name in series.exposed)


# HTTP routes


def test_every_route_of_the_served_document_has_an_entry():
    document = yaml.safe_load((ROOT / "openapi.yaml").read_text())
    page = http.page(served_openapi())
    routes = [(method, path) for method, path, _ in http.operations(document)]
    assert len(routes) >= 20
    missing = [f"{method} {path}" for method, path in routes if f"{http.heading(method, path)}\n" not in page]
    assert not missing, missing
    for name in document["components"]["schemas"]:
        assert f"{{#{http.schema_anchor(name)}}}" in page, name


# Error codes


def test_every_code_a_test_or_the_corpus_expects_has_an_entry():
    """Codes the tests assert on, found by a scan of their own: the reference's scan must find each of them."""
    expected = set()
    for path in (ROOT / "tests").rglob("*.py"):
        expected |= set(re.findall(r'(?:\["code"\]|\bcode) == "([a-z_0-9]+)"', path.read_text()))
    for path in (ROOT / "tests" / "data" / "malformed").glob("*.json"):
        expected |= {case["code"] for case in json.loads(path.read_text()).values() if isinstance(case, dict)}
    found = errors.documented()
    patterns = [re.compile("^" + re.sub(r"<[^>]*>", "[a-z_]+", code) + "$") for code in found]
    missing = sorted(code for code in expected if not any(pattern.match(code) for pattern in patterns))
    assert len(expected) > 30 and not missing, missing
    page = errors.page()
    assert all(f"| `{code}` |" in page for code in found)


def test_the_error_scan_finds_each_shape_a_code_is_written_in(tmp_path):
    package = tmp_path / "app"
    package.mkdir()
    (package / "module.py").write_text(
        """
MESSAGE = "A message kept in a constant."
ENGINE_CODE = "engine_fell_over"

def f(report):
    report.add("empty_thing", "The thing is empty.")
    raise APIError(418, "I am a teapot.", code="teapot_refused")

def g():
    return "bad_line", f"Line {n} is bad.", None

def g2(message):
    return "odd_line", message, "body"

def h():
    code, message = "batch_gone", MESSAGE
    Counter("vbatch_things", "Things that happened, by kind.")
    REQUEST_FIELDS = ("custom_id", "method")
"""
    )
    found = errors.documented(package)
    assert set(found) == {"engine_fell_over", "empty_thing", "teapot_refused", "bad_line", "odd_line", "batch_gone"}
    assert found["teapot_refused"][0].status == 418
    assert found["bad_line"][0].message == "Line {n} is bad."
    assert found["batch_gone"][0].message == "A message kept in a constant."
