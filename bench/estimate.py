"""The estimate against the batch (issue 31) in one device call: on one warm `vbatch serve`, a first tickets batch
(`--history` lines) gives the engine its history; then `--tickets` new tickets are estimated, run, and the estimate
compared with what the batch did (prompt tokens exact; output tokens and run time within 30%); then a
`--big`-line file is estimated while nothing runs, timed from the request to the answer.

  . .gpu/bin/env.sh && PYTHONPATH=$PWD:$PYTHONPATH python3 -m bench.estimate --model $BENCH_MODEL --out /tmp/e \\
      --results $OUT/estimate.json

On the CPU (a smoke run): `--model data/models/SmolLM2-135M-Instruct --no-dummy --eager --history 16 --tickets 32
--big 2000 --max-tokens 16 --max-model-len 2048`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from openai import OpenAI

from bench import compare
from bench.common import SideResults, VbatchServer, run_batch_through_sdk, warm_up, write_ticket_batch

CHAT = "/v1/chat/completions"


def estimate(client: OpenAI, path: Path) -> tuple[dict, float]:
    """The estimate of a file just uploaded, and the seconds from the request to the answer."""
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    body = {"input_file_id": uploaded.id, "endpoint": CHAT, "completion_window": "24h"}
    started = time.perf_counter()
    found = client.post("/batches/estimate", body=body, cast_to=object)
    return found, round(time.perf_counter() - started, 3)  # type: ignore[return-value]


def compared(found: dict, server: VbatchServer, path: Path) -> dict:
    """The estimate beside the batch's usage and its run's seconds (the progress timeline's last result)."""
    run = run_batch_through_sdk(server.base_url, path, hammer=False)
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="bench", max_retries=0)
    progress = client.get(f"/batches/{run.batch_id}/progress", cast_to=object)
    actual = {"prompt_tokens": run.input_tokens, "output_tokens": run.output_tokens,
              "run_seconds": progress["timeline"]["last_result"], "cached_tokens": run.cached_tokens}  # type: ignore[index]  # fmt: skip
    guessed = {"prompt_tokens": found["prompt_tokens"], "output_tokens": found["expected_output_tokens"],
               "run_seconds": found["eta_seconds"], "cached_tokens": found["expected_cached_tokens"]}  # fmt: skip
    off = {key: None if not actual[key] or guessed[key] is None else round(guessed[key] / actual[key] - 1, 4)
           for key in actual}  # fmt: skip
    return {"estimate": guessed, "actual": actual, "relative_error": off, "basis": found["basis"]}


def goals(sides: dict) -> list[str]:
    side = sides.get("tickets") or {}
    if "relative_error" not in side:
        return ["the tickets estimate: not measured"]
    off = side["relative_error"]
    lines = [f"prompt tokens: estimate {side['estimate']['prompt_tokens']}, actual {side['actual']['prompt_tokens']} "
             f"(goal: exact): {'met' if off['prompt_tokens'] == 0 else 'NOT met'}"]  # fmt: skip
    for key in ("output_tokens", "run_seconds"):
        ok = off[key] is not None and abs(off[key]) <= 0.3
        lines.append(f"{key}: estimate {side['estimate'][key]}, actual {side['actual'][key]}, off {off[key]} "
                     f"(goal: within 30%): {'met' if ok else 'NOT met'}")  # fmt: skip
    cached = (side["estimate"]["cached_tokens"], side["actual"]["cached_tokens"], off["cached_tokens"])
    lines.append("cached tokens: estimate {}, actual {}, off {} (no goal)".format(*cached))
    big = sides.get("big_file") or {}
    if "seconds" in big:
        lines.append(f"estimate of {big['lines']} lines: {big['seconds']} s")
    return lines


def arguments() -> argparse.Namespace:
    parser = compare.device_parser()
    parser.add_argument("--history", type=int, default=2000, help="tickets of the first batch (the history)")
    parser.add_argument("--tickets", type=int, default=20_000)
    parser.add_argument("--big", type=int, default=50_000, help="lines of the file only estimated")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--dummy", action=argparse.BooleanOptionalAction, default=True, help="dummy weights")
    parser.add_argument("--eager", action="store_true", help="--enforce-eager (CPU: no compile)")
    return parser.parse_args()


def main() -> None:
    args = arguments()
    args.out.mkdir(parents=True, exist_ok=True)
    sampling = {**compare.SAMPLING, "max_tokens": args.max_tokens}
    files, first = {}, 0
    for name, count in (("history", args.history), ("tickets", args.tickets), ("big", args.big)):
        files[name] = args.out / f"{name}.jsonl"
        write_ticket_batch(files[name], count, model=compare.SERVED, sampling=sampling, first=first)
        first += count
    results = SideResults(args.results, {**json.loads(args.meta), **{k: str(v) for k, v in vars(args).items()}})
    server = VbatchServer(args.out / "vbatch-data", 8133, compare.engine_flags(args), args.out / "vbatch-serve.log")
    try:
        results.side("engine_start", lambda: {"s": round(server.wait_ready(timeout=600), 2)})
        warm_up(server.base_url, args.out, compare.SERVED, compare.SAMPLING)
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="bench", max_retries=0, timeout=600)
        history = files["history"]
        results.side("history", lambda: run_batch_through_sdk(server.base_url, history, hammer=False).summary())
        results.side("tickets", lambda: compared(estimate(client, files["tickets"])[0], server, files["tickets"]))
        found, seconds = estimate(client, files["big"])
        results.side("big_file", lambda: {"lines": found["lines"], "seconds": seconds,
                                          "prompt_tokens": found["prompt_tokens"]})  # fmt: skip
    finally:
        server.stop()
    results.data["goals"] = goals(results.data["sides"])
    results.path.write_text(json.dumps(results.data, indent=2))
    print("\n".join(results.data["goals"]), flush=True)


if __name__ == "__main__":
    main()
