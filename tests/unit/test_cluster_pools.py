"""`vbatch cluster`'s pools (issue 30): one pool a model, each with its replicas and its own engine arguments, and
a named actor to scale it by; the one-pool command line reads as it always did. (The pools' replicas themselves
run as tests/integration/test_cluster.py runs one pool's.)"""

from __future__ import annotations

import pytest

from app.cluster import POOL_NAME, PoolSpec, parse_pools, pool_actor_name


def test_without_pools_the_command_line_is_one_pool_as_before():
    options, [pool] = parse_pools(
        ["--ray-address", "auto", "--replicas", "3", "--gpus-per-replica", "2", "--model", "m", "--max-model-len", "64"]
    )
    assert options.ray_address == "auto" and options.data_dir is None
    assert pool == PoolSpec(
        name=None, replicas=3, gpus=2.0, cpus=1.0, engine_args=["--model", "m", "--max-model-len", "64"]
    )
    assert pool.actor_name == POOL_NAME == "vbatch-pool"


def test_each_pool_has_its_own_replicas_and_engine_arguments():
    options, pools = parse_pools(
        [
            "--data-dir", "/srv/vbatch",
            "--pool", "small", "--replicas", "2", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct",
            "--pool=big", "--gpus-per-replica", "2", "--model", "Qwen/Qwen3-8B", "--tensor-parallel-size", "2",
        ]
    )  # fmt: skip
    assert options.data_dir == "/srv/vbatch"
    small = ["--model", "HuggingFaceTB/SmolLM2-135M-Instruct"]
    big = ["--model", "Qwen/Qwen3-8B", "--tensor-parallel-size", "2"]
    assert pools == [
        PoolSpec("small", replicas=2, gpus=None, cpus=1.0, engine_args=small),
        PoolSpec("big", replicas=1, gpus=2.0, cpus=1.0, engine_args=big),
    ]
    assert [pool.actor_name for pool in pools] == ["vbatch-pool-small", "vbatch-pool-big"]
    assert pool_actor_name("small") == "vbatch-pool-small" and pool_actor_name(None) == "vbatch-pool"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--pool"], "--pool needs a name"),
        (["--pool", "--replicas", "2"], "--pool needs a name"),
        (["--pool", "a", "--model", "m", "--pool", "a", "--model", "n"], "a name of its own"),
        (["--model", "m", "--pool", "a", "--model", "n"], "go after a --pool NAME"),
    ],
)
def test_a_malformed_pool_is_refused_with_what_is_wrong(argv, says):
    with pytest.raises(SystemExit, match=says):
        parse_pools(argv)
