"""`vbatch cluster` on a local Ray cluster: `vbatch worker` replicas (fake engines) in Ray actors, over Postgres and
an S3 store, with a `vbatch api` process in front. Batches run once each across the replicas; each replica says in
its beats a URL of its own that answers (where `vbatch api` forwards online requests); a replica killed mid-shard is
restarted by Ray and the shard finishes once; scaling from two replicas to one mid-batch loses nothing."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from sqlalchemy import Engine

from app import cluster
from app.core import failpoints
from app.core.db import make_engine
from app.domain import batches, workers
from app.testing import VbatchServer, fake_worker_app, free_port
from tests.helpers import wait_for
from tests.integration.test_roles import answers, answers_or_errors, ended, sdk, single_process_answers, submit

SHARD_LINES = 500
HOLD_AFTER = 60  # while a test holds, each feed sends this many lines and waits (app.core.failpoints)


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    # Four logical CPUs on two cores: with two, a pool of two actors was seen to starve (FACTS.md).
    ray.init(num_cpus=4, include_dashboard=False, namespace=cluster.NAMESPACE, logging_level="WARNING")
    yield
    ray.shutdown()


@dataclass
class RayCluster:
    pool: Any
    api: VbatchServer
    database_url: str
    data_dir: Path

    @contextmanager
    def holding(self) -> Iterator[None]:
        """Every replica (and each one Ray restarts meanwhile) sends HOLD_AFTER lines of each feed, then waits."""
        holds = [self.data_dir / f"replica-{n}" / failpoints.HOLD_FILE for n in range(2)]
        for hold in holds:
            hold.parent.mkdir(parents=True, exist_ok=True)
            hold.touch()
        try:
            yield
        finally:
            for hold in holds:
                hold.unlink(missing_ok=True)

    def holders(self) -> list[str]:
        return ray.get(self.pool.holders.remote())

    @contextmanager
    def database(self) -> Iterator[Engine]:
        db = make_engine(self.database_url)
        try:
            yield db
        finally:
            db.dispose()

    def shards(self, batch_id: str) -> list:
        with self.database() as db:
            return batches.shards_of(db=db, batch_id=batch_id)

    def holding_now(self, batch_id: str) -> set[str | None]:
        """Who holds the batch and its shards now."""
        with self.database() as db:
            rows = [batches.get(db=db, batch_id=batch_id, owner=None), *batches.shards_of(db=db, batch_id=batch_id)]
        return {row.lease_holder for row in rows}


@pytest.fixture(scope="module")
def ray_cluster(local_ray, tmp_path_factory: pytest.TempPathFactory, postgres, s3) -> Iterator[RayCluster]:
    """One pool and API for the module's tests in turn (a pool a test cost 10 to 14 s to start on two cores); the
    test that scales it down last."""
    tmp_path = tmp_path_factory.mktemp("ray-cluster")
    database_url = postgres.new_database()
    settings = {
        "VBATCH_DATABASE_URL": database_url,
        "VBATCH_STORAGE_URL": s3.new_url(),
        "VBATCH_DATA_DIR": str(tmp_path / "data"),
        # Longer than any test waits: a replica's shards go to another only when it releases them or Ray restarts it.
        "VBATCH_LEASE_SECONDS": "60",
        "VBATCH_CHECKPOINT_SECONDS": "0.1",
        "VBATCH_FAKE_SECONDS_PER_ANSWER": "0.02",
        "VBATCH_SHARD_LINES": str(SHARD_LINES),
        "VBATCH_DISK_RESERVE_BYTES": "65536",
        "VBATCH_FAILPOINT": f"hold_after:{HOLD_AFTER}",  # inert until a test holds
    }
    env = cluster.passed_on({**os.environ, **settings})  # the store's AWS_* variables come from the s3 fixture
    api = VbatchServer(tmp_path / "api", free_port(), [], tmp_path / "api.log", env=env, fake_engine=True, role="api")
    pool = cluster.start_pool(build=fake_worker_app, argv=[], env=env, replicas=2, gpus=0, cpus=1)
    running = RayCluster(pool, api, database_url, tmp_path / "data")
    try:
        api.wait_ready(timeout=120)
        wait_for(lambda: len(set(running.holders())) == 2, timeout=120)
        yield running
    finally:
        ray.get(pool.scale.remote(0))
        ray.kill(pool)
        api.stop()


def test_two_replicas_run_ten_batches_once_each(ray_cluster, tmp_path):
    client = sdk(ray_cluster.api)
    ids = [submit(client, tmp_path, f"b{n}", 20) for n in range(10)]
    done = [ended(client, batch_id) for batch_id in ids]
    assert {batch.status for batch in done} == {"completed"}
    for n, batch in enumerate(done):
        assert answers(client, batch.output_file_id) == single_process_answers(tmp_path / f"alone{n}", f"b{n}", 20)
    with ray_cluster.database() as db:
        ran_on = {batches.get(db=db, batch_id=batch_id, owner=None).lease_holder for batch_id in ids}
    assert ran_on == set(ray_cluster.holders())  # both replicas ran some


def test_each_replica_says_in_its_beats_where_it_answers(ray_cluster):
    holders = set(ray_cluster.holders())

    def urls() -> dict[str, str | None] | None:
        with ray_cluster.database() as db:
            seen = {worker.holder: worker.url for worker in workers.seen(db=db, within_seconds=10)}
        return seen if seen.keys() == holders else None  # each has begun to beat

    seen = wait_for(urls)
    for url in seen.values():  # each on a port of its own, from its first beat
        assert url is not None
        wait_for(lambda url=url: httpx.get(f"{url}/health", timeout=10).status_code == 200)
    assert len(set(seen.values())) == 2


def test_a_replica_killed_mid_shard_is_restarted_by_ray_and_the_shard_finishes_once(ray_cluster, tmp_path):
    client = sdk(ray_cluster.api)
    with ray_cluster.holding():
        batch_id = submit(client, tmp_path, "large", 1200)
        shard = wait_for(lambda: next((s for s in ray_cluster.shards(batch_id) if s.completed == HOLD_AFTER), None))
        before = ray_cluster.holders()
        number = before.index(shard.lease_holder)
        ray.kill(ray.get(ray_cluster.pool.replica.remote(number)), no_restart=False)
    batch = ended(client, batch_id)
    assert batch.status == "completed" and batch.request_counts.completed == 1200
    assert answers(client, batch.output_file_id).keys() == {f"large-{i}" for i in range(1200)}
    after = ray_cluster.holders()
    assert after[number] != before[number] and after[1 - number] == before[1 - number]  # Ray restarted that one


def test_scaling_from_two_replicas_to_one_mid_batch_loses_nothing(ray_cluster, tmp_path):
    # The module's last on its pool: it leaves one replica.
    client = sdk(ray_cluster.api)
    with ray_cluster.holding():
        batch_id = submit(client, tmp_path, "scaled", 1200)
        wait_for(lambda: sum(s.completed for s in ray_cluster.shards(batch_id)) == 2 * HOLD_AFTER)  # two feeding
        stopped = ray_cluster.holders()[1]
        assert stopped in ray_cluster.holding_now(batch_id)
        assert ray.get(ray_cluster.pool.scale.remote(1)) == 1  # the second replica checkpoints, lets its shards go
        # Released on the way down, not left to run out: no shard is still held by the stopped replica.
        assert stopped not in ray_cluster.holding_now(batch_id)
    batch = ended(client, batch_id)
    assert batch.status == "completed"
    done = {**answers(client, batch.output_file_id), **answers_or_errors(client, batch.error_file_id)}
    assert done.keys() == {f"scaled-{i}" for i in range(1200)} and batch.request_counts.failed == 0
    assert len(ray_cluster.holders()) == 1
