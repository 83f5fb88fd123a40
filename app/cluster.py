"""`vbatch cluster`: `vbatch worker`s placed, restarted and scaled by Ray.

Each replica is a Ray actor that runs one `vbatch worker` (its engine, its batch loop, its /health and /metrics on
a port of its own) in the actor's process, with `num_gpus` GPUs that Ray picks for it. Ray restarts a replica whose
process dies (`max_restarts=-1`); the restarted worker frees the leases of its dead predecessor at start, as any
worker on that host does, and goes on from their checkpoints. A pool actor, named `vbatch-pool` in the `vbatch`
namespace, owns the replicas: `vbatch cluster scale N` asks it for N, and a replica it lets go stops as a worker
does on SIGTERM (its runs checkpoint, its leases are released for the others to take at once).

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
        self.app.state.engine.advertise(base_url(settings.host, port, wildcard_name=ray.util.get_node_ip_address()))
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
    *, build: AppBuilder, argv: Sequence[str], env: dict[str, str], replicas: int, gpus: float, cpus: float
) -> Any:
    """The named pool actor with `replicas` replicas (Ray must be initialised)."""
    import ray

    pool: Any = (
        ray.remote(Pool)  # type: ignore[attr-defined]
        .options(name=POOL_NAME, namespace=NAMESPACE, num_cpus=0, max_concurrency=4)
        .remote(build, list(argv), env, gpus=gpus, cpus=cpus)
    )
    ray.get(pool.scale.remote(replicas))
    return pool


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vbatch cluster", add_help=False)
    parser.add_argument(
        "--ray-address", default=None, help="The Ray cluster (default: RAY_ADDRESS, or a new local one)."
    )
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--gpus-per-replica", type=float, default=None, help="Default: 1 where Ray sees GPUs, else 0.")
    parser.add_argument("--cpus-per-replica", type=float, default=1.0)
    parser.add_argument("--data-dir", default=None)
    return parser


def main(argv: list[str]) -> None:
    """`vbatch cluster [options] [engine args]` runs the pool until SIGTERM or SIGINT; `vbatch cluster scale N`
    resizes a running one."""
    import ray

    from app.launch import parse_service_args

    if argv[:1] == ["scale"]:
        scale = argparse.ArgumentParser(prog="vbatch cluster scale")
        scale.add_argument("replicas", type=int)
        scale.add_argument("--ray-address", default=None)
        args = scale.parse_args(argv[1:])
        ray.init(address=args.ray_address or "auto", namespace=NAMESPACE, logging_level=logging.WARNING)
        pool = ray.get_actor(POOL_NAME, namespace=NAMESPACE)
        log.info("vbatch cluster: %d replicas", ray.get(pool.scale.remote(args.replicas)))
        return
    args, engine_args = _parser().parse_known_args(argv)
    parse_service_args(engine_args, "worker")  # a bad argument fails here, not in every replica Ray restarts
    if args.data_dir:
        os.environ["VBATCH_DATA_DIR"] = args.data_dir
    ray.init(address=args.ray_address, namespace=NAMESPACE, logging_level=logging.WARNING)
    gpus = args.gpus_per_replica
    if gpus is None:
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) else 0.0
    pool = start_pool(
        build=worker_app,
        argv=engine_args,
        env=passed_on(os.environ),
        replicas=args.replicas,
        gpus=gpus,
        cpus=args.cpus_per_replica,
    )
    log.info(
        "vbatch cluster: %d replicas of `vbatch worker %s`, %s GPUs each", args.replicas, " ".join(engine_args), gpus
    )
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    stopping.wait()
    log.info("vbatch cluster: stopping its replicas (running batches checkpoint)")
    ray.get(pool.scale.remote(0))
    ray.shutdown()
