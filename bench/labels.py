"""Short requests (issue 17) in one device call: a warm `vbatch serve` runs the labels file, the labels file with a
shared block of rules, and the seed's tickets; then one `LLM` process runs the same three with `LLM.chat` (warm) and
the two label shapes again with `LLM.generate` on pre-tokenized prompts (the engine alone). Every timed side runs
prompts its engine has not seen: the sides are separate engines, and `LLM.generate` gets items of its own.

  . .gpu/bin/env.sh && PYTHONPATH=$PWD:$PYTHONPATH python3 -m bench.labels --model $BENCH_MODEL --out /tmp/l \\
      --results $OUT/labels.json [--api-server-count N]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx

from bench import compare
from bench.common import SideResults, VbatchServer, run_batch_through_sdk, run_logged, warm_up, write_ticket_batch

SERVED = compare.SERVED
LINES = 20_000
QUESTION = "Label item {n}: is it a fruit or a tool? Answer with one word."
LABEL_BODY = {"max_completion_tokens": 1, "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}}


def rules() -> str:
    """About 350 tokens of labelling rules, the same on every line of the shared file."""
    kinds = ["apple", "hammer", "pear", "wrench", "plum", "saw", "grape", "drill", "lemon", "chisel"]
    lines = ["You label household items. Follow every rule below and answer with one lowercase word."]
    for i, kind in enumerate(kinds * 2):
        label = "fruit" if kinds.index(kind) % 2 == 0 else "tool"
        lines.append(f"Rule {i + 1}: anything that resembles a {kind} or is sold beside one is a {label}.")
    lines.append("If an item could be both, prefer the label of its most common use in a kitchen or a workshop.")
    return "\n".join(lines)


def label_messages(n: int, shared: bool) -> list[dict]:
    user = {"role": "user", "content": QUESTION.format(n=n)}
    return [{"role": "system", "content": rules()}, user] if shared else [user]


def write_labels(path: Path, *, shared: bool, first: int, count: int = LINES) -> Path:
    with path.open("w") as out:
        for n in range(first, first + count):
            body = {"model": SERVED, "messages": label_messages(n, shared), **LABEL_BODY}
            line = {"custom_id": f"item-{n}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            out.write(json.dumps(line) + "\n")
    return path


def vbatch_sides(args, files: dict[str, Path], side) -> None:
    server = VbatchServer(
        args.out / "vbatch-data", 8127, compare.device_vbatch_flags(args), args.out / "vbatch-serve.log"
    )
    try:
        side("vbatch_engine_start", lambda: {"s": round(server.wait_ready(timeout=400), 2)})
        warm_up(server.base_url, args.out, SERVED, compare.SAMPLING)
        for name, path in files.items():
            side(
                f"vbatch_{name}",
                lambda path=path: _rates(server, run_batch_through_sdk(server.base_url, path, hammer=False)),
            )
    finally:
        server.stop()


def _rates(server: VbatchServer, run) -> dict:
    """The run's rates over its turnaround, and the stages the service timed (`created` is validation and wait)."""
    summary = run.summary()
    summary["timeline_s"] = httpx.get(f"{server.base_url}/v1/batches/{run.batch_id}/progress", timeout=30).json()[
        "timeline"
    ]
    summary["requests_per_s"] = round(run.completed / run.turnaround_s, 1)
    summary["output_tokens_per_s_turnaround"] = round(run.output_tokens / run.turnaround_s, 1)
    return summary


def engine_sides(args, files: dict[str, Path], side) -> None:
    command = [sys.executable, "-m", "bench.labels", "--engine-side", "--model", args.model, "--out", str(args.out),
               "--results", str(args.results), "--max-model-len", str(args.max_model_len)]  # fmt: skip
    stdout = run_logged(command, args.out / "llm.log", timeout=420)
    for line in stdout.splitlines():
        if line.startswith("{"):
            for name, value in json.loads(line).items():
                side(name, lambda value=value: value)


def run_engine_side(args) -> None:
    """In its own process: one LLM, warm, then each timed call; prints one JSON line per side."""
    import time

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, max_model_len=args.max_model_len, load_format="dummy")
    llm.chat(
        [[{"role": "user", "content": f"Warm-up {i}: say hello."}] for i in range(64)], SamplingParams(max_tokens=16)
    )
    label = SamplingParams(max_tokens=1, temperature=0)
    kwargs = {"enable_thinking": False}

    def timed(name: str, call, count: int) -> None:
        started = time.perf_counter()
        outputs = call()
        seconds = time.perf_counter() - started
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        rates = {"prompts": count, "seconds": round(seconds, 2), "requests_per_s": round(count / seconds, 1)}
        rates |= {"output_tokens": tokens, "output_tokens_per_s": round(tokens / seconds, 1)}
        print(json.dumps({name: rates}), flush=True)

    for name, shared in (("labels", False), ("labels_shared", True)):
        conversations = [label_messages(n, shared) for n in range(LINES)]
        timed(
            f"llm_chat_{name}",
            lambda c=conversations: llm.chat(c, label, chat_template_kwargs=kwargs, use_tqdm=False),
            LINES,
        )
    tickets = [json.loads(line)["body"] for line in (args.out / "tickets.jsonl").read_text().splitlines()]
    sampling = compare.SAMPLING
    params = SamplingParams(max_tokens=sampling["max_tokens"], temperature=sampling["temperature"],
                            top_p=sampling["top_p"], top_k=sampling["top_k"])  # fmt: skip
    timed(
        "llm_chat_tickets",
        lambda: llm.chat([t["messages"] for t in tickets], params, chat_template_kwargs=kwargs, use_tqdm=False),
        len(tickets),
    )
    tokenizer = llm.get_tokenizer()
    for name, shared in (("labels", False), ("labels_shared", True)):
        started = time.perf_counter()
        texts = [tokenizer.apply_chat_template(label_messages(n, shared), tokenize=False, add_generation_prompt=True,
                                               enable_thinking=False) for n in range(LINES, 2 * LINES)]  # fmt: skip
        prompts = [TokensPrompt(prompt_token_ids=tokenizer.encode(t, add_special_tokens=False)) for t in texts]
        print(json.dumps({f"tokenize_{name}": {"seconds": round(time.perf_counter() - started, 2)}}), flush=True)
        timed(f"llm_generate_{name}", lambda p=prompts: llm.generate(p, label, use_tqdm=False), LINES)


def main() -> None:
    parser = compare.device_parser()
    parser.add_argument("--engine-side", action="store_true")
    parser.add_argument("--vbatch-only", action="store_true", help="leave out the LLM sides")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.engine_side:
        run_engine_side(args)
        return
    # The vbatch side's items are numbered past both sets the engine side uses: no side sees another's prompts.
    files = {
        "labels": write_labels(args.out / "labels.jsonl", shared=False, first=2 * LINES),
        "labels_shared": write_labels(args.out / "labels-shared.jsonl", shared=True, first=2 * LINES),
        "tickets": args.out / "tickets.jsonl",
    }
    write_ticket_batch(files["tickets"], 2000, model=SERVED, sampling=compare.SAMPLING)
    meta = {**json.loads(args.meta), "lines": LINES, "api_server_count": args.api_server_count}
    side = SideResults(args.results, meta).side
    vbatch_sides(args, files, side)
    if args.vbatch_only:
        return
    engine_sides(args, files, side)
    data = json.loads(args.results.read_text())["sides"]
    for name in ("labels", "labels_shared", "tickets"):
        v, c = data.get(f"vbatch_{name}", {}), data.get(f"llm_chat_{name}", {})
        key = "output_tokens_per_s" if name == "tickets" else "requests_per_s"
        vbatch_rate = v.get("output_tokens_per_s_turnaround" if name == "tickets" else key)
        if vbatch_rate and c.get(key):
            print(f"{name}: vbatch {vbatch_rate} / LLM.chat {c[key]} = {vbatch_rate / c[key]:.2f}x")
        g = data.get(f"llm_generate_{name}", {})
        if vbatch_rate and g.get(key):
            print(f"{name}: vbatch / LLM.generate pre-tokenized {g[key]} = {vbatch_rate / g[key]:.2f}x")


if __name__ == "__main__":
    main()
