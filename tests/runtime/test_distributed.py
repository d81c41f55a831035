"""``modelshard.distributed`` in one process: a no-op, clear errors, cluster detection."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import modelshard as ms
from modelshard import distributed
from modelshard._runtime import distributed as runtime_distributed
from modelshard.distributed import cluster_detected

_VARS = [
    "MODELSHARD_COORDINATOR",
    "MODELSHARD_NUM_PROCESSES",
    "MODELSHARD_PROCESS_ID",
    "MODELSHARD_LOCAL_DEVICES",
    "MODELSHARD_HEARTBEAT_TIMEOUT",
    "MODELSHARD_BARRIER_TIMEOUT",
    "JAX_COORDINATOR_ADDRESS",
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_MCA_orte_hnp_uri",
    "TPU_WORKER_HOSTNAMES",
]


@pytest.fixture
def env(monkeypatch):
    for v in _VARS:
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


def test_a_plain_process_is_a_no_op(env):
    assert distributed.initialize() is False
    assert jax.process_count() == 1
    env.setenv("MODELSHARD_LOCAL_DEVICES", "8")  # what this process already has: fine
    assert distributed.initialize() is False


def test_launch_with_one_process_is_a_no_op(env):
    env.setenv("MODELSHARD_COORDINATOR", "127.0.0.1:1")
    env.setenv("MODELSHARD_NUM_PROCESSES", "1")
    env.setenv("MODELSHARD_PROCESS_ID", "0")
    assert distributed.initialize() is False


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"MODELSHARD_NUM_PROCESSES": "two"},
            "environment variable MODELSHARD_NUM_PROCESSES='two' must be an integer >= 1.",
        ),
        (
            {"MODELSHARD_PROCESS_ID": "-1"},
            "environment variable MODELSHARD_PROCESS_ID='-1' must be an integer >= 0.",
        ),
        (
            {"MODELSHARD_COORDINATOR": "127.0.0.1:1", "MODELSHARD_NUM_PROCESSES": "2"},
            "MODELSHARD_COORDINATOR is set but MODELSHARD_PROCESS_ID is not; start processes "
            "with `modelshard launch -n N -- ...`.",
        ),
        (
            {
                "MODELSHARD_COORDINATOR": "127.0.0.1:1",
                "MODELSHARD_NUM_PROCESSES": "2",
                "MODELSHARD_PROCESS_ID": "2",
            },
            "MODELSHARD_PROCESS_ID=2 is not below MODELSHARD_NUM_PROCESSES=2.",
        ),
        (
            {"MODELSHARD_HEARTBEAT_TIMEOUT": "0"},
            "environment variable MODELSHARD_HEARTBEAT_TIMEOUT='0' must be a positive number "
            "of seconds.",
        ),
        (
            {"MODELSHARD_LOCAL_DEVICES": "4"},
            "MODELSHARD_LOCAL_DEVICES=4 asks for 4 CPU devices, but JAX's backend was already "
            "started; call modelshard.distributed.initialize() first, before any JAX computation "
            "(jax.devices(), jnp arrays, ...).",
        ),
        (
            {
                "MODELSHARD_COORDINATOR": "127.0.0.1:1",
                "MODELSHARD_NUM_PROCESSES": "2",
                "MODELSHARD_PROCESS_ID": "1",
            },
            "JAX's backend was already started, so this process can no longer join the others; "
            "call modelshard.distributed.initialize() first, before any JAX computation "
            "(jax.devices(), jnp arrays, ...).",
        ),
    ],
)
def test_bad_or_late_settings_raise_a_clear_error(env, values, message):
    jax.devices()  # the backend is running, as in any test
    for k, v in values.items():
        env.setenv(k, v)
    with pytest.raises(ms.DistributedError) as e:
        distributed.initialize()
    assert str(e.value) == message
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({}, None),
        ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, "JAX_COORDINATOR_ADDRESS"),
        (
            {
                "SLURM_JOB_ID": "7",
                "SLURM_STEP_NODELIST": "n[1-2]",
                "SLURM_PROCID": "0",
                "SLURM_LOCALID": "0",
                "SLURM_NTASKS": "8",
            },
            "slurm",
        ),
        # an interactive one-task SLURM allocation is a single process
        (
            {
                "SLURM_JOB_ID": "7",
                "SLURM_STEP_NODELIST": "n1",
                "SLURM_PROCID": "0",
                "SLURM_LOCALID": "0",
                "SLURM_NTASKS": "1",
            },
            None,
        ),
        (
            {
                "OMPI_COMM_WORLD_RANK": "0",
                "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                "OMPI_COMM_WORLD_SIZE": "4",
            },
            "openmpi",
        ),
        ({"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "4"}, "openmpi"),
        ({"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "1"}, None),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4"}, None),  # not all three
        ({"TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3"}, "tpu"),
    ],
)
def test_cluster_detection_reads_only_the_environment(values, expected):
    assert cluster_detected(values) == expected


def test_to_host_returns_full_numpy_values_of_every_kind(container):
    tree = container
    mesh = ms.make_mesh({"data": 8})
    placed = ms.shard(tree, ms.fsdp("data", min_size=0), mesh)
    host = distributed.to_host(placed)
    got = ms.adapters.split(host).arrays
    want = ms.adapters.split(tree).arrays
    assert len(got) == len(want) > 0
    for g, w in zip(got, want, strict=True):
        assert isinstance(g, np.ndarray)
        if jnp.issubdtype(w.dtype, jax.dtypes.prng_key):
            w = jax.random.key_data(w)
        np.testing.assert_array_equal(g, np.asarray(w))


def test_to_host_rejects_abstract_leaves():
    with pytest.raises(ms.DistributedError, match=r"^to_host got an abstract leaf"):
        distributed.to_host({"w": jax.ShapeDtypeStruct((2,), jnp.float32)})


def test_single_process_helpers():
    assert distributed.is_main_process()
    distributed.barrier()  # returns at once
    assert distributed.broadcast({"steps": (1, 2)}, "x") == {"steps": [1, 2]}  # as JSON gives
    assert distributed.gather(3, "y") == [3]
    distributed.require_addressable(jnp.ones(3), "test")  # addressable: no error
    distributed.require_addressable("not an array", "test")


def test_local_slice_in_one_process_is_the_whole_array():
    from jax.sharding import PartitionSpec as P

    mesh = ms.make_mesh({"data": 2, "model": 4})
    assert distributed.local_slice((16, 8), P("data", "model"), mesh) == (
        slice(0, 16),
        slice(0, 8),
    )


@pytest.mark.parametrize(
    ("values", "kwargs"),
    [
        ({}, {"coordinator_address": "127.0.0.1:1", "num_processes": 2, "process_id": 0}),
        ({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1"}, {}),
        (
            {
                "SLURM_JOB_ID": "7",
                "SLURM_STEP_NODELIST": "n[1-2]",
                "SLURM_PROCID": "0",
                "SLURM_LOCALID": "0",
                "SLURM_NTASKS": "8",
            },
            {},
        ),
    ],
)
def test_explicit_arguments_and_cluster_environments_start_the_runtime(env, values, kwargs):
    jax.devices()  # too late here, so the attempt is visible as the error
    for k, v in values.items():
        env.setenv(k, v)
    with pytest.raises(ms.DistributedError, match=r"^JAX's backend was already started"):
        distributed.initialize(**kwargs)


@pytest.fixture
def launched(env, monkeypatch):
    """Process 1 of 2 as ``modelshard launch`` starts it; the runtime's start recorded."""
    started: list[dict] = []
    monkeypatch.setattr(runtime_distributed, "_start", lambda **kw: started.append(kw))
    env.setenv("MODELSHARD_COORDINATOR", "127.0.0.1:1")
    env.setenv("MODELSHARD_NUM_PROCESSES", "2")
    env.setenv("MODELSHARD_PROCESS_ID", "1")
    return started


def test_the_heartbeat_timeout_reaches_jax(env, launched):
    env.setenv("MODELSHARD_HEARTBEAT_TIMEOUT", "7")
    assert distributed.initialize() is True
    assert distributed.initialize(heartbeat_timeout_seconds=30) is True  # an argument wins
    env.delenv("MODELSHARD_HEARTBEAT_TIMEOUT")
    assert distributed.initialize() is True  # unset: JAX's own default
    where = {"coordinator_address": "127.0.0.1:1", "num_processes": 2, "process_id": 1}
    assert launched == [
        {**where, "heartbeat_timeout_seconds": 7},
        {**where, "heartbeat_timeout_seconds": 30},
        where,
    ]


def test_arguments_win_over_the_launch_variables(launched):
    assert distributed.initialize(process_id=0, local_device_ids=[0]) is True
    where = {"coordinator_address": "127.0.0.1:1", "num_processes": 2}
    assert launched == [{**where, "process_id": 0, "local_device_ids": [0]}]


@pytest.mark.parametrize("raw", ["0", "-3", "soon", "inf", "nan"])
def test_barrier_timeout_setting(env, raw):
    assert distributed.barrier_timeout_s() == distributed.DEFAULT_BARRIER_TIMEOUT_S == 600
    env.setenv("MODELSHARD_BARRIER_TIMEOUT", "2.5")
    assert distributed.barrier_timeout_s() == 2.5
    env.setenv("MODELSHARD_BARRIER_TIMEOUT", raw)
    with pytest.raises(ms.DistributedError) as e:
        distributed.barrier_timeout_s()
    assert str(e.value) == (
        f"environment variable MODELSHARD_BARRIER_TIMEOUT={raw!r} must be a positive number "
        "of seconds."
    )


@pytest.mark.multiprocess
@pytest.mark.skipif(sys.platform != "linux", reason="multi-process tests run on Linux")
def test_barrier_broadcast_and_gather_on_two_processes(tmp_path):
    """Through the coordination service: process 0's value everywhere, every value
    everywhere, and a barrier one process never reaches fails after the timeout with the
    barrier's name (the other process is unharmed, and both meet at the next one)."""
    from modelshard._runtime import processes as _launch

    script = Path(__file__).parents[1] / "mp_scripts" / "coordinate.py"
    cmd = [sys.executable, _launch.__file__, "-n", "2", "--timeout", "120", "--grace", "1"]
    cmd += ["--", sys.executable, str(script), str(tmp_path)]
    env = {**os.environ, "MODELSHARD_BARRIER_TIMEOUT": "3"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [json.loads((tmp_path / f"result_{i}.json").read_text()) for i in range(2)]
    for r in results:
        assert r["broadcast"] == {"from": 0, "steps": [1, 2]}
        assert r["again"] == "second from 0"  # the second call of a name is its own value
        assert r["gather"] == [{"me": 0}, {"me": 1}]
        assert r["done"] is True
        assert r["left"] == []  # every value was removed by its last reader
    assert "error" not in results[1]
    error = results[0]["error"]
    assert error.startswith(
        "process 0 of 2: barrier 'only process 0 comes here' failed after waiting up to 3 s "
        "for the other processes (MODELSHARD_BARRIER_TIMEOUT sets the wait): JaxRuntimeError: "
        "DEADLINE_EXCEEDED: Barrier timed out."
    ), error
    assert error.endswith(
        "Another process died, is stuck, or took another path through the program (every "
        "process must make the same calls in the same order)."
    ), error
    assert 3 <= results[0]["waited"] < 60
