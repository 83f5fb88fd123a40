"""Two more GPU workloads (bench/gpu.py runs them with the ticket comparison in one device call):

1. The seed's `vllm bench throughput` shape (1,000 random prompts, 1,024 tokens in, 256 out, ignore_eos) through the
   warm vbatch service as a /v1/completions batch of token-id prompts, against `vllm bench throughput` itself.
2. Shared prefixes: 2,000 lines, 8 tasks, each line a ~2,000-token instruction block of its task and a short row,
   in shuffled order, through vbatch (which regroups them) and through `vllm run-batch`.
"""

from __future__ import annotations

import json
import random
import re
import sys
import time
from pathlib import Path

from bench.common import run_batch_through_sdk, run_batch_usage, run_logged

SERVED = "bench-model"
TASKS = 8


def random_token_batch(path: Path, count: int, input_len: int, output_len: int, vocab: int) -> None:
    rng = random.Random(0)
    with path.open("w") as out:
        for i in range(count):
            prompt = [rng.randrange(1000, vocab - 1000) for _ in range(input_len)]
            body = {"model": SERVED, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
                    "temperature": 1.0, "top_p": 1.0}  # fmt: skip
            out.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}))
            out.write("\n")


def instructions(task: int, rules_count: int = 110) -> str:
    words = ["invoice", "refund", "outage", "password", "export", "quota", "latency", "upgrade", "region", "token"]
    labels = ["billing", "access", "reliability", "data", "capacity"]
    rules = [f"Task {task} labelling guide. Read every rule before you answer."]
    for i in range(rules_count):
        word, label = words[(i * 7 + task) % len(words)], labels[(i + task) % len(labels)]
        rules.append(f"Rule {task}.{i}: if the ticket mentions '{word}' together with case {i * 13 % 97}, label it "
                     f"'{label}' unless a later rule says otherwise.")  # fmt: skip
    rules.append("Examples: 'my invoice doubled' -> billing; 'cannot log in' -> access; 'API down' -> reliability.")
    return "\n".join(rules)


def chat_line(custom_id: str, content: str, max_tokens: int) -> dict:
    """One user message, thinking off: the line every shared-prefix workload is made of."""
    body = {"model": SERVED, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def write_jsonl(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def shared_prefix_batch(path: Path, rows: int, max_tokens: int) -> None:
    blocks = [instructions(t) for t in range(TASKS)]
    lines = []
    for i in range(rows):
        task = i % TASKS
        content = f"{blocks[task]}\n\nTicket {i}: customer writes about issue number {i * 31 % 1000}. Label:"
        lines.append(chat_line(f"p{i}", content, max_tokens))
    random.Random(1).shuffle(lines)
    write_jsonl(path, lines)


def vbatch_sides(base_url: str, random_file: Path, prefix_file: Path) -> dict[str, dict]:
    return {
        "vbatch_random_1024_256": run_batch_through_sdk(base_url, random_file, "/v1/completions").summary(),
        "vbatch_shared_prefix": run_batch_through_sdk(base_url, prefix_file).summary(),
    }


def bench_throughput_side(model: str, max_model_len: int, out: Path) -> dict:
    command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "throughput", "--model", model,
               "--max-model-len", str(max_model_len), "--load-format", "dummy", "--dataset-name", "random",
               "--random-input-len", "1024", "--random-output-len", "256", "--num-prompts", "1000"]  # fmt: skip
    started = time.monotonic()
    stdout = run_logged(command, out / "bench-throughput.log", timeout=300)
    text = stdout + (out / "bench-throughput.log").read_text()
    found = re.search(r"Throughput: ([\d.]+) requests/s, ([\d.]+) total tokens/s, ([\d.]+) output tokens/s", text)
    return {
        "whole_s": round(time.monotonic() - started, 2),
        "requests_per_s": float(found.group(1)) if found else None,
        "total_tokens_per_s": float(found.group(2)) if found else None,
        "output_tokens_per_s": float(found.group(3)) if found else None,
    }


def run_batch_prefix_side(prefix_file: Path, flags: list[str], out: Path, timeout: float = 300) -> dict:
    output = out / f"run-batch-{prefix_file.stem}.jsonl"
    command = [sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(prefix_file), "-o", str(output),
               "--enable-prompt-tokens-details", *flags]  # fmt: skip
    started = time.monotonic()
    log = out / f"run-batch-{prefix_file.stem}.log"
    run_logged(command, log, timeout=timeout)
    whole = time.monotonic() - started
    return {
        "whole_s": round(whole, 2),
        "progress_bar_s": progress_bar_seconds(log.read_text(errors="replace")),
        **run_batch_usage(output),
    }


def progress_bar_seconds(log: str) -> int | None:
    """run-batch's own clock for its requests: the elapsed time on the last tqdm bar it drew (whole seconds)."""
    bars = re.findall(r"(\d+)/(\d+) \[(?:(\d+):)?(\d+):(\d+)<", log)
    if not bars:
        return None
    _, _, hours, minutes, seconds = bars[-1]
    return int(hours or 0) * 3600 + int(minutes) * 60 + int(seconds)
