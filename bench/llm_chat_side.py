"""The seed guide's batch.py, measured: every prompt in one `LLM.chat` call. Prints one JSON line."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--input", required=True, help="an OpenAI batch file of chat lines")
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--extra", default="{}", help="JSON of extra LLM(...) keyword arguments")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    bodies = [json.loads(line)["body"] for line in Path(args.input).read_text().splitlines()]
    first = bodies[0]
    params = SamplingParams(
        max_tokens=first.get("max_tokens", 16),
        temperature=first.get("temperature", 1.0),
        top_p=first.get("top_p", 1.0),
        top_k=first.get("top_k", 0) or -1,
    )
    started = time.perf_counter()
    llm = LLM(model=args.model, max_model_len=args.max_model_len, **json.loads(args.extra))
    loaded = time.perf_counter()
    # Warm, as vbatch's side is: one small call first, on prompts the timed call does not contain (no cache hits).
    warm_up = [[{"role": "user", "content": f"Warm-up {i}: say hello."}] for i in range(64)]
    llm.chat(warm_up, SamplingParams(max_tokens=16), use_tqdm=False)
    ready = time.perf_counter()
    outputs = llm.chat(
        [b["messages"] for b in bodies], params, chat_template_kwargs=first.get("chat_template_kwargs"), use_tqdm=False
    )
    generated = time.perf_counter()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens or 0 for o in outputs)
    print(json.dumps({
        "side": "llm_chat", "prompts": len(bodies), "engine_start_s": round(loaded - started, 2),
        "warm_up_s": round(ready - loaded, 2),
        "generating_s": round(generated - ready, 2), "output_tokens": tokens, "cached_tokens": cached,
        "output_tokens_per_s": round(tokens / (generated - ready), 1), "whole_s": round(generated - started, 2),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
