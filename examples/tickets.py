"""Support tickets as an OpenAI batch input file: the seed guide's workload, asked the way a 135M model answers
best (one clear question, a short answer, low temperature)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

SYSTEM = "You are a helpful support assistant for a cloud GPU service. Answer in one short sentence."
QUESTIONS = [
    "How do I reset my password?",
    "Why was my credit card charged twice this month?",
    "How can I export my data as a CSV file?",
    "Why is my model slow to answer?",
    "How do I give a teammate access to my project?",
]
# SmolLM2's own model card samples at 0.2; at vLLM's default of 1.0 a 135M model rambles.
SAMPLING = {"temperature": 0.2, "top_p": 0.9}


def ticket_lines(count: int, *, model: str, max_tokens: int = 64, endpoint: str = "/v1/chat/completions") -> Iterator:
    for i in range(count):
        question = QUESTIONS[i % len(QUESTIONS)]
        if endpoint == "/v1/completions":
            body = {"model": model, "prompt": f"{SYSTEM}\nQuestion: {question}\nAnswer:", "max_tokens": max_tokens}
        else:
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            body = {"model": model, "messages": messages, "max_tokens": max_tokens}
        yield {"custom_id": f"ticket-{i}", "method": "POST", "url": endpoint, "body": {**body, **SAMPLING}}


def write_tickets(path: str, count: int, *, model: str, max_tokens: int = 64, endpoint: str = "/v1/chat/completions"):
    with open(path, "w") as out:
        for line in ticket_lines(count, model=model, max_tokens=max_tokens, endpoint=endpoint):
            out.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    write_tickets(sys.argv[1], int(sys.argv[2]), model=sys.argv[3] if len(sys.argv) > 3 else "SmolLM2-135M-Instruct")
