"""The whole GPU comparison in one device call (docs/benchmarks.md): one warm vbatch service runs the seed's
tickets, the `vllm bench throughput` shape and the shared-prefix file; then `LLM.chat` and `vllm run-batch` on the
tickets, `vllm bench throughput`, and `vllm run-batch` on the shared-prefix file. Results land in --results after
every side, so a run cut short still reports what it finished.

  . .gpu/bin/env.sh && PYTHONPATH=$PWD:$PYTHONPATH python3 -m bench.gpu --model $BENCH_MODEL --out /tmp/g \\
      --results $OUT/results.json
"""

from __future__ import annotations

import json

from bench import compare, shapes
from bench.common import SideResults, VbatchServer, run_batch_through_sdk, warm_up, write_ticket_batch


def main() -> None:
    parser = compare.device_parser()
    args = parser.parse_args()
    engine = compare.device_engine(args)
    flags = compare.engine_flags(engine)
    tickets, random_file, prefix_file = (args.out / n for n in ("tickets.jsonl", "random.jsonl", "prefix.jsonl"))
    write_ticket_batch(tickets, 2000, model=compare.SERVED, sampling=compare.SAMPLING)
    shapes.random_token_batch(random_file, 1000, 1024, 256, vocab=150_000)
    shapes.shared_prefix_batch(prefix_file, 2000, 32)
    side = SideResults(args.results, json.loads(args.meta)).side

    server = VbatchServer(args.out / "vbatch-data", 8125, flags, args.out / "vbatch-serve.log")
    try:
        side("vbatch_engine_start", lambda: {"s": round(server.wait_ready(timeout=300), 2)})
        warm_up(server.base_url, args.out, compare.SERVED, compare.SAMPLING)
        side("vbatch_tickets", lambda: run_batch_through_sdk(server.base_url, tickets).summary())
        for name, value in shapes.vbatch_sides(server.base_url, random_file, prefix_file).items():
            side(name, lambda value=value: value)
    finally:
        server.stop()
    side("llm_chat_tickets", lambda: compare.llm_chat_side(engine, tickets, args.out))
    side("run_batch_tickets", lambda: compare.run_batch_side(engine, tickets, args.out))
    side("vllm_bench_throughput", lambda: shapes.bench_throughput_side(args.model, args.max_model_len, args.out))
    side("run_batch_shared_prefix", lambda: shapes.run_batch_prefix_side(prefix_file, flags, args.out))


if __name__ == "__main__":
    main()
