"""`make demo`: start vbatch with the default model, submit support tickets through the openai SDK, poll with
progress, print answers and throughput, and say where the results and the service log are."""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path

from tickets import ticket_lines  # beside this script

from app.testing import VbatchServer

MODEL = "SmolLM2-135M-Instruct"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--tickets", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()

    from openai import OpenAI

    data_dir = Path(args.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = (data_dir / "demo-serve.log").resolve()
    print(f"starting vbatch (log: {log_path}); the engine takes a minute or two to load ...")
    server = VbatchServer(data_dir, args.port, ["--enforce-eager"], log_path)
    try:
        print(f"engine ready in {server.wait_ready(timeout=900):.0f} s at {server.base_url}")
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="demo")
        lines = list(ticket_lines(args.tickets, model=MODEL, max_tokens=args.max_tokens))
        payload = "".join(json.dumps(line) + "\n" for line in lines).encode()
        uploaded = client.files.create(file=("tickets.jsonl", io.BytesIO(payload)), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        print(f"uploaded {uploaded.id} ({uploaded.bytes} bytes), created {batch.id}")
        print(f"follow it in the web console: {server.base_url}/console/batches/{batch.id}")
        started = time.monotonic()
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            time.sleep(2)
            batch = client.batches.retrieve(batch.id)
            counts = batch.request_counts
            print(f"  {batch.status:<12} {counts.completed + counts.failed}/{counts.total} done", flush=True)
        elapsed = time.monotonic() - started
        if batch.status != "completed":
            sys.exit(f"batch ended {batch.status}: {batch.errors}")
        questions = {line["custom_id"]: line["body"]["messages"][-1]["content"] for line in lines}
        results = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        for result in sorted(results, key=lambda r: int(r["custom_id"].split("-")[1])):
            answer = result["response"]["body"]["choices"][0]["message"]["content"].strip()
            print(f"\n{result['custom_id']}: {questions[result['custom_id']]}\n  -> {answer}")
        results_path = (data_dir / f"{batch.id}_output.jsonl").resolve()
        results_path.write_bytes(client.files.content(batch.output_file_id).content)
        usage = batch.usage
        print(
            f"\n{batch.request_counts.completed} answers, {usage.output_tokens} output tokens in {elapsed:.1f} s "
            f"({usage.output_tokens / elapsed:.1f} output tokens/s, created to completed)"
        )
        print(f"results: {results_path} (also {server.base_url}/v1/files/{batch.output_file_id}/content while it runs)")
        print(f"service log: {log_path}")
        print(
            f"the console again: .venv/bin/vbatch serve --data-dir {args.data_dir}, then http://127.0.0.1:8000/console"
        )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
