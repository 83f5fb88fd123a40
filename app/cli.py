"""`vbatch serve` (API and engine in one process), `vbatch api` and `vbatch worker` (the same, split over processes
that share one database and one files directory) and `vbatch run` (offline drop-in for `vllm run-batch`)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from app.core import logs
from app.core.config import Settings
from app.launch import (
    add_service_options,
    check_binding,
    check_fleet,
    engine_factory_from,
    options_first,
    prepare_engine_args,
    server_options,
    service_app,
    settings_from,
)

if TYPE_CHECKING:
    from app.domain.merge import MergeReport

log = logging.getLogger("vbatch")

USAGE = """usage: vbatch {serve,api,worker,cluster,run,merge} [options] [vLLM engine args]

  vbatch serve [--host 127.0.0.1] [--port 8000] [--data-dir DIR] [vLLM engine args]
  vbatch api [--host 127.0.0.1] [--port 8000] [--data-dir DIR]
  vbatch worker [--host 127.0.0.1] [--port 8001] [--data-dir DIR] [vLLM engine args]
  vbatch cluster [--ray-address ADDR] [--replicas N] [--gpus-per-replica K] [--data-dir DIR] [vLLM engine args]
  vbatch cluster [--ray-address ADDR] [--data-dir DIR] --pool NAME [--replicas N] [vLLM engine args] --pool NAME2 ...
  vbatch cluster scale N [--pool NAME] [--ray-address ADDR]
  vbatch run -i in.jsonl -o out.jsonl [--error-file err.jsonl] [vLLM engine args]
  vbatch merge BATCH_ID -o merged.jsonl [--data-dir DIR]
  vbatch merge --input in.jsonl -o merged.jsonl RESULT_FILE...

Engine args are exactly those of `vllm serve` (--model, --max-model-len, --tensor-parallel-size, ...).
With no --model, vbatch serves SmolLM2-135M-Instruct, prepared once in the data directory.
"""


def serve(argv: list[str], role: str = "serve") -> None:
    """`vbatch serve` and `vbatch worker`: the engine's arguments are `vllm serve`'s."""
    app, settings = service_app(argv, role)
    _run_app(app, settings)


def api(argv: list[str]) -> None:
    """`vbatch api`: the HTTP API and console only; workers run the batches."""
    from app.engine.online.view import WorkersView
    from app.main import Role, create_app

    args = api_parser().parse_args(argv)
    settings = settings_from(args)
    check_binding(settings, insecure_no_auth=args.insecure_no_auth)
    check_fleet(settings, "api")
    _run_app(create_app(settings, WorkersView(), Role.API), settings)


def api_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vbatch api",
        description="The HTTP API and the console, without an engine: `vbatch worker`s that share its database and "
        "store run the batches and answer the online requests it forwards.",
    )
    parser.add_argument("--host", default=None, help="Where the API listens (default 127.0.0.1, VBATCH_HOST).")
    parser.add_argument("--port", type=int, default=None, help="The API's port (default 8000, VBATCH_PORT).")
    return add_service_options(parser)


def _run_app(app, settings: Settings) -> None:
    import uvicorn

    from app.core.orphans import no_orphans

    log.info("vbatch on http://%s:%d, data in %s", settings.host, settings.port, settings.data_dir.resolve())
    with no_orphans():
        uvicorn.run(app, **server_options(settings))


def cluster(argv: list[str]) -> None:
    """`vbatch cluster`: workers on a Ray cluster (the `ray` extra)."""
    from app import cluster as ray_cluster

    ray_cluster.main(argv)


def run(argv: list[str]) -> None:
    import asyncio

    from app.engine.batch.offline import run_file

    args = run_parser().parse_args(argv)
    settings = Settings(**({"data_dir": args.data_dir} if args.data_dir else {}))
    prepare_engine_args(argv, args, settings)
    output = Path(args.output_file)
    errors = Path(args.error_file) if args.error_file else output.with_name(f"{output.stem}.errors.jsonl")
    from app.core.orphans import no_orphans

    with no_orphans():
        code = asyncio.run(
            run_file(engine_factory_from(args), input_path=Path(args.input_file), output=output, errors=errors)
        )
    sys.exit(code)


def run_parser() -> argparse.ArgumentParser:
    """`vllm run-batch`'s own parser, and vbatch's options."""
    from app.engine.inference.vllm_adapter import run_batch_parser

    parser = run_batch_parser("vbatch run")
    parser.add_argument("--error-file", default=None, help="Where failed lines go (default: beside -o).")
    parser.add_argument("--data-dir", default=None, help="Where the default model is prepared.")
    if not any("--api-server-count" in action.option_strings for action in parser._actions):
        parser.add_argument(
            "--api-server-count",
            type=int,
            default=None,
            help="Front-end processes over the one engine, as for `vllm serve` (default: from the host's cores).",
        )
    parser.usage = "%(prog)s -i INPUT_FILE -o OUTPUT_FILE [--error-file FILE] [vbatch options] [vLLM engine args]"
    run_batch_own = ("input_file", "output_file", "error_file", "data_dir", "api_server_count")
    own = [action for action in parser._actions if action.dest in run_batch_own]
    return options_first(parser, "The offline drop-in for `vllm run-batch`: a file in, results out, no service.", own)


def merge(argv: list[str]) -> None:
    """`vbatch merge`: a batch's results and its retries' in one file, every custom_id once, in the input's order."""
    from app.core.errors import DomainError
    from app.domain.merge import MergeRefused

    parser = merge_parser()
    args = parser.parse_args(argv)
    if args.input is None and len(args.sources) != 1:
        parser.error("give one batch id, or --input and the result files")
    try:
        report = _merge_into(Path(args.output), args)
    except (DomainError, MergeRefused, OSError) as exc:
        print(f"vbatch merge: {getattr(exc, 'message', exc)}", file=sys.stderr)
        sys.exit(2)
    missing = f", {len(report.no_result)} with no result (error code no_result)" if report.no_result else ""
    print(f"{report.lines} lines: {report.succeeded} succeeded, {report.failed} failed{missing}", file=sys.stderr)


def merge_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vbatch merge",
        description="Join the results of a batch and its retries (POST /v1/batches/{id}/retry) into one JSONL: "
        "every custom_id of the input once, in its order; the latest success, else the latest error.",
    )
    parser.add_argument(
        "sources",
        nargs="+",
        help="A batch id (any batch of the chain), or with --input the "
        "output and error files of the batches, oldest batch first.",
    )
    parser.add_argument("--input", default=None, help="The first batch's input file (the sources are then files).")
    parser.add_argument("-o", "--output", required=True, help="Where the merged lines go.")
    parser.add_argument("--data-dir", default=None, help="The service's data directory (for a batch id).")
    return parser


def _merge_into(output: Path, args: argparse.Namespace) -> MergeReport:
    """The merged file is written beside `output` and renamed over it whole: a refusal leaves nothing."""
    from app.domain.merge import merge, refuse_overwriting

    if args.input is not None:
        source, results = Path(args.input), [Path(each) for each in args.sources]
    else:
        source, results = _chain_paths(
            args.sources[0], Settings(**({"data_dir": args.data_dir} if args.data_dir else {}))
        )
    refuse_overwriting(output, [source, *results])
    partial = output.with_name(f".{output.name}.partial")
    try:
        with partial.open("wb") as out:
            report = merge(source, results, out)
        partial.replace(output)
    finally:
        partial.unlink(missing_ok=True)
    return report


def _chain_paths(batch_id: str, settings: Settings) -> tuple[Path, list[Path]]:
    """The retry chain's files in the service's database and store (an object store's downloaded first)."""
    import asyncio

    from app.core.db import make_engine
    from app.core.stores import open_storage
    from app.domain.merge import chain_files

    if settings.database_url is None and not settings.database_path.exists():
        raise OSError(f"there is no vbatch database in {settings.data_dir} (--data-dir, or VBATCH_DATABASE_URL)")
    found = chain_files(db=make_engine(settings.database), batch_id=batch_id)
    storage = open_storage(settings.storage_url, settings.files_dir)

    async def local() -> list[Path]:
        return [await storage.local_path(each) for each in [found.input_file_id, *found.result_file_ids]]

    paths = asyncio.run(local())
    return paths[0], paths[1:]


def main(argv: list[str] | None = None) -> None:
    if argv is None and sys.argv[1:2] in (["serve"], ["worker"], ["api"], ["run"]):
        from app.core.orphans import start_in_lineage

        start_in_lineage()  # first: every process these commands start is ended with them (app.core.orphans)
    argv = list(sys.argv[1:] if argv is None else argv)
    logs.configure(Settings().log_format)
    commands = {
        "serve": serve,
        "worker": lambda rest: serve(rest, "worker"),
        "api": api,
        "run": run,
        "cluster": cluster,
        "merge": merge,
    }
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return
    if not argv or argv[0] not in commands:
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    commands[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
