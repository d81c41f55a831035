"""``modelshard.distributed`` in one process: a no-op, clear errors, cluster detection."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import modelshard as ms
from modelshard import distributed
from modelshard.distributed import cluster_detected

_VARS = [
    "MODELSHARD_COORDINATOR",
    "MODELSHARD_NUM_PROCESSES",
    "MODELSHARD_PROCESS_ID",
    "MODELSHARD_LOCAL_DEVICES",
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
