"""The seed guide's support tickets as an OpenAI batch input file."""

from __future__ import annotations

import json
import sys

SYSTEM = "You are a support analyst for a GPU cloud. Answer in at most three sentences."
TOPICS = ["billing", "login", "latency", "data export", "permissions"]


def ticket_lines(count: int, *, model: str, max_tokens: int = 64, endpoint: str = "/v1/chat/completions"):
    for i in range(count):
        topic = TOPICS[i % len(TOPICS)]
        prompt = f"A customer reports a problem with {topic}. What is the most likely cause? (ticket {i})"
        if endpoint == "/v1/completions":
            body = {
                "model": model,
                "prompt": f"{SYSTEM}\nQuestion: {prompt}\nAnswer:",
                "max_tokens": max_tokens,
            }
        else:
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
            body = {"model": model, "messages": messages, "max_tokens": max_tokens}
        yield {"custom_id": f"ticket-{i}", "method": "POST", "url": endpoint, "body": body}


def write_tickets(path: str, count: int, *, model: str, max_tokens: int = 64, endpoint: str = "/v1/chat/completions"):
    with open(path, "w") as out:
        for line in ticket_lines(count, model=model, max_tokens=max_tokens, endpoint=endpoint):
            out.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    write_tickets(sys.argv[1], int(sys.argv[2]), model=sys.argv[3] if len(sys.argv) > 3 else "SmolLM2-135M-Instruct")
