"""`vbatch cluster`: `vbatch worker`s placed, restarted and scaled by Ray.

Each replica is a Ray actor that runs one `vbatch worker` (its engine, its batch loop, its /health and /metrics on
a port of its own) in the actor's process, with `num_gpus` GPUs that Ray picks for it. Ray restarts a replica whose
process dies (`max_restarts=-1`); the restarted worker frees the leases of its dead predecessor at start, as any
worker on that host does, and goes on from their checkpoints. A pool actor, named `vbatch-pool` in the `vbatch`
namespace, owns the replicas: `vbatch cluster scale N` asks it for N, and a replica it lets go stops as a worker
does on SIGTERM (its runs checkpoint, its leases are released for the others to take at once).

Pools of replicas for different models (`--pool NAME [--replicas N] --model M ...`, once a pool) are actors named
`vbatch-pool-NAME`, each scaled on its own (`vbatch cluster scale N --pool NAME`); each worker claims only the
batches for the models it serves (`app.domain.leases.claim`).

Everything durable stays in the database and the store, never in an actor: the cluster needs Postgres and an S3
store (`VBATCH_DATABASE_URL`, `VBATCH_STORAGE_URL`) once it spans machines.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.core.config import Settings

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger("vbatch.cluster")

NAMESPACE = "vbatch"
POOL_NAME = "vbatch-pool"
# What a replica's worker reads from its environment: vbatch's settings, the store's credentials, vLLM's and
# Hugging Face's variables. Ray starts actors with the raylet's environment, not the driver's.
PASSED_ON = ("VBATCH_", "AWS_", "VLLM_", "HF_", "HUGGING_FACE_")

AppBuilder = Callable[[list[str]], "tuple[FastAPI, Settings]"]


def worker_app(argv: list[str]) -> tuple[FastAPI, Settings]:
    """A `vbatch worker`'s app and settings, from its arguments (`vllm serve`'s engine args)."""
    from app.launch import service_app

    return service_app(argv, "worker")


class Replica:
    """One `vbatch worker` in this actor's process; its HTTP port (/health, /metrics, online requests) is any free
    one, bound before the worker starts, so that its beats say from the first where it answers: the host it listens
    on, or, listening on every interface, the address Ray knows its node by (`VBATCH_ADVERTISE_URL`, one value for
    every replica, is not used)."""

    def __init__(self, build: AppBuilder, argv: list[str]) -> None:
        import ray
        import uvicorn

        from app.core import logs
        from app.core.config import base_url
        from app.core.orphans import no_orphans
        from app.launch import server_options

        logs.configure(Settings().log_format)
        self.app, settings = build(argv)
        listening = bound_socket(settings.host)
        port = listening.getsockname()[1]
        wildcard_name = ray.util.get_node_ip_address()
        self.app.state.engine.advertise(
            base_url(settings.host, port, wildcard_name=wildcard_name, scheme=settings.scheme)
        )
        self.server = uvicorn.Server(uvicorn.Config(self.app, **{**server_options(settings), "port": port}))
        # Ray kills a stopped or lost actor's process outright: the reaper ends the engine it started.
        self.ending = ExitStack()
        self.ending.enter_context(no_orphans())
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [listening]}, name="vbatch-worker", daemon=True
        )
        self.thread.start()

    def holder(self) -> str:
        """The name this worker holds leases under."""
        return self.app.state.engine.holder

    def stop(self) -> None:
        """As on SIGTERM: no batch starts, running ones checkpoint, leases are released; returns once it is down."""
        self.server.should_exit = True
        self.thread.join()
        self.ending.close()


class Pool:
    """The replicas, as many as asked for; replica `n` keeps its number (and its scratch) across restarts."""

    def __init__(self, build: AppBuilder, argv: list[str], env: dict[str, str], *, gpus: float, cpus: float) -> None:
        import ray

        self.build, self.argv, self.env = build, argv, env
        self.actor = ray.remote(Replica)  # type: ignore[attr-defined]
        self.resources = {"num_gpus": gpus, "num_cpus": cpus, "max_restarts": -1, "max_task_retries": -1}
        self.replicas: list[Any] = []

    def scale(self, count: int) -> int:
        import ray

        while len(self.replicas) < count:
            # In the process's environment from its start: some settings are read at import (failpoints).
            env = replica_env(self.env, len(self.replicas))
            replica = self.actor.options(**self.resources, runtime_env={"env_vars": env})
            self.replicas.append(replica.remote(self.build, self.argv))
        while len(self.replicas) > count:
            replica = self.replicas.pop()
            ray.get(replica.stop.remote())
            ray.kill(replica, no_restart=True)
        return len(self.replicas)

    def holders(self) -> list[str]:
        """Each replica's lease holder name, in replica order (waits for replicas still starting)."""
        import ray

        return ray.get([replica.holder.remote() for replica in self.replicas])

    def replica(self, number: int) -> Any:
        return self.replicas[number]


def bound_socket(host: str) -> socket.socket:
    """A listening TCP socket on a free port of `host`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, 0), family=family)


def replica_env(env: dict[str, str], number: int) -> dict[str, str]:
    """With an object store each replica keeps scratch of its own; without, all share the data directory's files
    (one machine)."""
    if not env.get("VBATCH_STORAGE_URL"):
        return env
    return {**env, "VBATCH_DATA_DIR": str(Path(env["VBATCH_DATA_DIR"]) / f"replica-{number}")}


def passed_on(environ: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """What every replica gets of `environ`, its data directory made absolute (the actors' working directory is
    Ray's)."""
    env = {name: value for name, value in environ.items() if name.startswith(PASSED_ON)}
    env["VBATCH_DATA_DIR"] = str(Path(env.get("VBATCH_DATA_DIR", "data")).resolve())
    return env


def start_pool(
    *,
    build: AppBuilder,
    argv: Sequence[str],
    env: dict[str, str],
    replicas: int,
    gpus: float,
    cpus: float,
    name: str = POOL_NAME,
) -> Any:
    """The pool actor named `name` with `replicas` replicas (Ray must be initialised)."""
    import ray

    pool: Any = (
        ray.remote(Pool)  # type: ignore[attr-defined]
        .options(name=name, namespace=NAMESPACE, num_cpus=0, max_concurrency=4)
        .remote(build, list(argv), env, gpus=gpus, cpus=cpus)
    )
    ray.get(pool.scale.remote(replicas))
    return pool


@dataclass(frozen=True)
class PoolSpec:
    """One pool of a cluster: `replicas` workers, each running `vbatch worker ENGINE_ARGS` (its own `--model`)."""

    name: str | None  # None: the one pool of a cluster started without `--pool`
    replicas: int
    gpus: float | None  # per replica; None: 1 where Ray sees GPUs, else 0
    cpus: float
    engine_args: list[str]

    @property
    def actor_name(self) -> str:
        return pool_actor_name(self.name)


def pool_actor_name(name: str | None) -> str:
    """The pool actor's name in the `vbatch` namespace: `vbatch-pool`, or `vbatch-pool-NAME` for the pool NAME."""
    return POOL_NAME if name is None else f"{POOL_NAME}-{name}"


def _cluster_options(parser: argparse._ActionsContainer) -> None:
    parser.add_argument(
        "--ray-address",
        default=None,
        help="The Ray cluster (`auto`, `ray://HOST:10001`, ...; default: RAY_ADDRESS, else a cluster `ray start` "
        "left running here, else a new local one).",
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        help="The replicas' data directory (VBATCH_DATA_DIR; with an object store each replica keeps its scratch in "
        "DIR/replica-N).",
    )


def _pool_options(parser: argparse._ActionsContainer) -> None:
    parser.add_argument("--replicas", type=int, default=1, help="How many `vbatch worker`s the pool runs (default 1).")
    parser.add_argument(
        "--gpus-per-replica",
        type=float,
        default=None,
        help="GPUs Ray gives each replica (default: 1 where Ray sees GPUs, else 0); with --tensor-parallel-size K, K.",
    )
    parser.add_argument("--cpus-per-replica", type=float, default=1.0, help="CPUs Ray reserves for each replica.")


def _cluster_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vbatch cluster", add_help=False, allow_abbrev=False)
    _cluster_options(parser)
    return parser


def _pool_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vbatch cluster --pool NAME", add_help=False, allow_abbrev=False)
    _pool_options(parser)
    return parser


def help_parser() -> argparse.ArgumentParser:
    """What `vbatch cluster --help` prints: the cluster's and its pools' own options (the engine's are `vbatch
    worker`'s, which `vbatch worker --help` shows)."""
    parser = argparse.ArgumentParser(
        prog="vbatch cluster",
        usage="%(prog)s [cluster options] [pool options] [vLLM engine args]\n"
        "       %(prog)s [cluster options] --pool NAME [pool options] [vLLM engine args] --pool NAME2 ...\n"
        "       %(prog)s scale N [--pool NAME] [--ray-address ADDR]",
        description="`vbatch worker`s as Ray actors, placed, restarted and scaled by Ray; runs until SIGTERM or\n"
        "Ctrl-C. Needs the `ray` extra, and Postgres and an S3 store (VBATCH_DATABASE_URL, VBATCH_STORAGE_URL)\n"
        "once it spans machines.",
        epilog="vLLM engine args: those of `vbatch worker` (--model, --max-model-len, --tensor-parallel-size, ...;\n"
        "`vbatch worker --help`), for every replica of the pool they follow.\n"
        "`vbatch cluster scale N [--pool NAME]` resizes a pool of a running cluster (`vbatch cluster scale --help`).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _cluster_options(parser.add_argument_group("cluster options"))
    pool = parser.add_argument_group("pool options", "Once for the one pool, or after each --pool NAME.")
    pool.add_argument(
        "--pool",
        metavar="NAME",
        help="Starts a pool of its own (an actor named vbatch-pool-NAME): its options and engine args follow it.",
    )
    _pool_options(pool)
    return parser


def scale_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vbatch cluster scale", description="Resize one pool of a running `vbatch cluster`."
    )
    parser.add_argument("replicas", type=int, help="The pool's new number of replicas.")
    parser.add_argument("--pool", default=None, help="The pool's name, as given to `vbatch cluster --pool NAME`.")
    parser.add_argument(
        "--ray-address", default=None, help="The running cluster's Ray address (default: auto, this machine's)."
    )
    return parser


def parse_pools(argv: Sequence[str]) -> tuple[argparse.Namespace, list[PoolSpec]]:
    """`[--ray-address A] [--data-dir D] [pool options] [engine args]`: one pool; or, for pools that serve different
    models, `[--ray-address A] [--data-dir D] --pool NAME [pool options] ENGINE_ARGS --pool NAME2 ...`, each pool
    with its replicas and its own engine arguments (its `--model`)."""
    head, groups = _split_pools(list(argv))
    options, rest = _cluster_parser().parse_known_args(head)
    if not groups:
        return options, [_pool_spec(None, rest)]
    if rest:
        raise SystemExit(f"vbatch cluster: {' '.join(rest)}: pool options and engine arguments go after a --pool NAME")
    names = [name for name, _ in groups]
    if len(set(names)) != len(names):
        raise SystemExit(f"vbatch cluster: each --pool needs a name of its own; got {', '.join(names)}")
    return options, [_pool_spec(name, args) for name, args in groups]


def _split_pools(argv: list[str]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """The arguments before the first `--pool`, and each pool's name with the arguments up to the next."""
    head: list[str] = []
    groups: list[tuple[str, list[str]]] = []
    tokens = iter(argv)
    for token in tokens:
        if token == "--pool" or token.startswith("--pool="):
            name = token.partition("=")[2] if "=" in token else next(tokens, "")
            if not name or name.startswith("-"):
                raise SystemExit("vbatch cluster: --pool needs a name (--pool NAME)")
            groups.append((name, []))
        else:
            (groups[-1][1] if groups else head).append(token)
    return head, groups


def _pool_spec(name: str | None, argv: list[str]) -> PoolSpec:
    options, engine_args = _pool_parser().parse_known_args(argv)
    return PoolSpec(
        name=name,
        replicas=options.replicas,
        gpus=options.gpus_per_replica,
        cpus=options.cpus_per_replica,
        engine_args=engine_args,
    )


def _scale(argv: list[str]) -> None:
    """`vbatch cluster scale N [--pool NAME]`: resize one pool of a running cluster (the one, without `--pool`)."""
    import ray

    args = scale_parser().parse_args(argv)
    ray.init(address=args.ray_address or "auto", namespace=NAMESPACE, logging_level=logging.WARNING)
    name = pool_actor_name(args.pool)
    pool = ray.get_actor(name, namespace=NAMESPACE)
    log.info("vbatch cluster: %s has %d replicas", name, ray.get(pool.scale.remote(args.replicas)))


def main(argv: list[str]) -> None:
    """`vbatch cluster [options] [engine args]` (or its pools, `parse_pools`) runs until SIGTERM or SIGINT;
    `vbatch cluster scale N [--pool NAME]` resizes a running one's pool."""
    if argv[:1] != ["scale"] and ("-h" in argv or "--help" in argv):
        help_parser().print_help()  # its own options: the engine args' are `vbatch worker --help`'s
        return
    import ray

    from app.launch import check_fleet, parse_service_args

    if argv[:1] == ["scale"]:
        _scale(argv[1:])
        return
    options, specs = parse_pools(argv)
    for spec in specs:  # a bad argument fails here, not in every replica Ray restarts
        parse_service_args(spec.engine_args, "worker")
    check_fleet(Settings(), "worker")  # as is a missing fleet secret, which every replica needs
    if options.data_dir:
        os.environ["VBATCH_DATA_DIR"] = options.data_dir
    ray.init(address=options.ray_address, namespace=NAMESPACE, logging_level=logging.WARNING)
    pools = [_start(spec) for spec in specs]
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    stopping.wait()
    log.info("vbatch cluster: stopping its replicas (running batches checkpoint)")
    ray.get([pool.scale.remote(0) for pool in pools])
    ray.shutdown()


def _start(spec: PoolSpec) -> Any:
    import ray

    gpus = spec.gpus
    if gpus is None:
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) else 0.0
    pool = start_pool(
        build=worker_app,
        argv=spec.engine_args,
        env=passed_on(os.environ),
        replicas=spec.replicas,
        gpus=gpus,
        cpus=spec.cpus,
        name=spec.actor_name,
    )
    log.info(
        "vbatch cluster: %s, %d replicas of `vbatch worker %s`, %s GPUs each",
        spec.actor_name,
        spec.replicas,
        " ".join(spec.engine_args),
        gpus,
    )
    return pool
