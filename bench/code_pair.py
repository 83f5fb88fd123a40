"""Issue 40's device pair (the code before its refactors against the code now) and issue 37's (tenants apart in the
prefix cache against a shared cache), in one device call: fresh, warm `vbatch serve`s with one key, each running the
seed's tickets and the 20,000 labels that share a block of rules (bench/tenant_cache.py's workload). `before` runs
the earlier commit's `app/` and `migrations/` from `--before`, a tree made with `git archive`; `after` is this tree
as configured by default (tenants apart); `shared` is this tree with `VBATCH_SHARED_PREFIX_CACHE=true`. Goal: no
loss over 3% for after against before, and for after against shared.

  git archive 290cf44 app migrations | (mkdir -p .before && tar -x -C .before)    # here; carry ".before"
  . .gpu/bin/env.sh && PYTHONPATH=$PWD:$PYTHONPATH python3 -m bench.code_pair --model $BENCH_MODEL --out /tmp/p \\
      --before .before --results $OUT/code-pair.json [--order shared,after,before]
"""

from __future__ import annotations

from pathlib import Path

from bench import tenant_cache

SIDES = {"before": {}, "after": {}, "shared": {"VBATCH_SHARED_PREFIX_CACHE": "true"}}


def main() -> None:
    parser = tenant_cache.parser()
    parser.add_argument("--before", type=Path, required=True, help="a tree holding the earlier commit's app/")
    parser.add_argument("--order", default="before,after,shared", help="the sides, in the order they run")
    args = parser.parse_args()
    # `before` runs in its own tree, so a path given relative to this one must not change meaning there
    args.out = args.out.resolve()
    if Path(args.model).exists():
        args.model = str(Path(args.model).resolve())
    files, results = tenant_cache.workload(args)
    for name in args.order.split(","):
        env = {"VBATCH_API_KEYS": tenant_cache.KEY, **SIDES[name]}
        cwd = args.before.resolve() if name == "before" else None
        tenant_cache.serve_side(args, files, results.side, name, env, cwd)
    lines = tenant_cache.ratios(results.data["sides"], "after", "before")
    tenant_cache.report(results, lines + tenant_cache.ratios(results.data["sides"], "after", "shared"))


if __name__ == "__main__":
    main()
