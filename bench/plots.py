"""The benchmark plots of docs/benchmarks.md, drawn from the raw results in bench/results/ (`make plots`).

Each plot names the files and commits its bars come from; the numbers are those docs/benchmarks.md discusses.

    python -m bench.plots docs/img/benchmarks
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

RESULTS = Path(__file__).resolve().parent / "results"
VBATCH, OTHER, BASE = "#1565c0", "#ef6c00", "#90a4ae"


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _bars(
    labels: list[str], values: list[float], colours: list[str], *, title: str, unit: str, source: str, log: bool = False
) -> plt.Figure:
    figure, axes = plt.subplots(figsize=(9, 0.65 * len(labels) + 1.7))
    rows = list(range(len(labels)))[::-1]
    axes.barh(rows, values, color=colours)
    axes.set_yticks(rows, labels)
    axes.set_xlabel(unit)
    if log:
        axes.set_xscale("log")
    for row, value in zip(rows, values, strict=True):
        axes.text(value, row, f" {value:,.3g}" if value < 100 else f" {value:,.0f}", va="center", fontsize=9)
    figure.suptitle(title, fontsize=11, x=0.01, ha="left")
    axes.spines[["top", "right"]].set_visible(False)
    axes.margins(x=0.15)
    figure.text(0.01, 0.01, source, fontsize=7, color="#546e7a")
    figure.tight_layout(rect=(0, 0.04, 1, 1))
    return figure


def online_ttft() -> plt.Figure:
    """Online requests' time to first token (p99) beside a running batch, on one H100 (issue 29)."""
    before, after, serve = (
        load("h100-online-c00ac8d.json"),
        load("h100-online-e7f0651.json"),
        load("h100-online-serve-94aff36.json"),
    )
    bars = [
        ("online alone", after["sides"]["alone"], BASE),
        ("vbatch + a batch, window before room at once (c00ac8d)", before["sides"]["vbatch"], BASE),
        ("vbatch + a batch (e7f0651)", after["sides"]["vbatch"], VBATCH),
        ("vllm serve + a batch client, fcfs (94aff36)", serve["sides"]["vllm_serve"], OTHER),
    ]
    return _bars(
        [label for label, _, _ in bars],
        [side["online"]["ttft_p99_ms"] / 1000 for _, side, _ in bars],
        [colour for _, _, colour in bars],
        title="Online requests beside a batch: time to first token, p99 (one H100)",
        unit="seconds (log scale)",
        source="bench/results/h100-online-{c00ac8d,e7f0651,serve-94aff36}.json",
        log=True,
    )


def tickets() -> plt.Figure:
    """The seed's 2,000 support tickets on one H200: seconds from the batch's start to its results (47b9e1b)."""
    sides = load("h200.json")["sides"]
    bars = [
        ("vbatch, warm service (created → completed)", sides["vbatch_tickets"]["turnaround_s"], VBATCH),
        ("LLM.chat, generating only", sides["llm_chat_tickets"]["generating_s"], BASE),
        ("LLM.chat, with its engine start", sides["llm_chat_tickets"]["whole_s"], BASE),
        ("vllm run-batch, whole run", sides["run_batch_tickets"]["whole_s"], OTHER),
    ]
    return _bars(
        [label for label, _, _ in bars],
        [value for _, value, _ in bars],
        [colour for _, _, colour in bars],
        title="2,000 support tickets (Qwen3-8B shape, max 256 tokens) on one H200",
        unit="seconds",
        source="bench/results/h200.json (commit 47b9e1b, vLLM 0.26.0)",
    )


def shared_prefixes() -> plt.Figure:
    """Shared prefixes that outgrow the KV cache: 3,000 shuffled lines over 1,000 instruction blocks, one H200."""
    results = load("h200-prefix-scale.json")
    before, after = results["run_110a53f"]["sides"], results["run_966cba7"]["sides"]
    bars = [
        ("vbatch, warm service (966cba7)", after["vbatch_shuffled"]["generating_s"], VBATCH),
        ("vllm run-batch, lines pre-sorted by hand", before["run_batch_grouped"]["progress_bar_s"], BASE),
        ("vllm run-batch, shuffled", before["run_batch_shuffled"]["progress_bar_s"], OTHER),
    ]
    return _bars(
        [label for label, _, _ in bars],
        [value for _, value, _ in bars],
        [colour for _, _, colour in bars],
        title="Shared prefixes that outgrow the KV cache: engine seconds, 3,000 shuffled lines (one H200)",
        unit="seconds of engine time",
        source="bench/results/h200-prefix-scale.json (commits 110a53f, 966cba7; vLLM 0.26.0)",
    )


def memory() -> plt.Figure:
    """Service memory follows what is in flight, not the file: peak RSS for 2,000 and 200,000 lines."""
    runs = load("h200-memory.json")["runs"]
    return _bars(
        [f"{run['lines']:,} lines ({run['input_mb']} MB)" for run in runs],
        [run["service_peak_rss_mb"] for run in runs],
        [VBATCH for _ in runs],
        title="vbatch service peak RSS by batch size (one H200)",
        unit="MB",
        source="bench/results/h200-memory.json (commit 27f143c)",
    )


PLOTS: dict[str, Callable[[], plt.Figure]] = {
    "online-ttft.png": online_ttft,
    "tickets.png": tickets,
    "shared-prefixes.png": shared_prefixes,
    "memory.png": memory,
}


def main(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, draw in PLOTS.items():
        figure = draw()
        # No timestamp in the file: the same results draw the same bytes.
        figure.savefig(folder / name, dpi=110, metadata={"Software": None})
        plt.close(figure)
        print(folder / name)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/img/benchmarks"))
