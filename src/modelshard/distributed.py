"""One script, alone or on many processes: start JAX's distributed runtime from the environment.

``initialize()`` reads what ``modelshard launch`` (or a cluster launcher: SLURM, Open MPI,
a Cloud TPU pod, anything that sets ``JAX_COORDINATOR_ADDRESS``) put in the environment and
calls ``jax.distributed.initialize``; in a plain single process it does nothing. Call it
first, before any JAX computation, and the same script runs unchanged everywhere.

The helpers below are the few multi-process operations a training script needs:
``is_main_process`` (who prints and logs), ``barrier`` (everyone waits) and ``to_host``
(a global array's full value on every process, through an all-gather).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from ._errors import DistributedError
from ._flat import split
from ._launch import ENV_COORDINATOR, ENV_LOCAL_DEVICES, ENV_NUM_PROCESSES, ENV_PROCESS_ID

__all__ = [
    "ENV_COORDINATOR",
    "ENV_LOCAL_DEVICES",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "barrier",
    "cluster_detected",
    "initialize",
    "is_main_process",
    "local_slice",
    "require_addressable",
    "to_host",
]


def _env_int(env: Mapping[str, str], name: str, minimum: int) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise DistributedError(
            f"environment variable {name}={raw!r} must be an integer >= {minimum}."
        )
    return value


def cluster_detected(env: Mapping[str, str] | None = None) -> str | None:
    """The cluster launcher JAX can configure itself from, or ``None`` in a plain process.

    Only cheap checks of the environment (no network queries): ``JAX_COORDINATOR_ADDRESS``,
    SLURM with more than one task, Open MPI with more than one rank, GKE TPU worker lists,
    and Cloud TPU VMs (which JAX configures from the metadata server).
    """
    env = os.environ if env is None else env

    def many(name: str) -> bool:
        try:
            return int(env.get(name, "1")) > 1
        except ValueError:
            return False

    if env.get("JAX_COORDINATOR_ADDRESS"):
        return "JAX_COORDINATOR_ADDRESS"
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID")
    if all(k in env for k in slurm) and many("SLURM_NTASKS"):
        return "slurm"
    ompi = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")
    if ("OMPI_MCA_orte_hnp_uri" in env or all(k in env for k in ompi)) and many(
        "OMPI_COMM_WORLD_SIZE"
    ):
        return "openmpi"
    if any(
        k in env
        for k in ("TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES", "TPU_PROCESS_ADDRESSES_PATH")
    ):
        return "tpu"
    if env is os.environ:
        try:
            from jax._src import cloud_tpu_init
        except ImportError:  # pragma: no cover - private module moved
            return None
        if getattr(cloud_tpu_init, "running_in_cloud_tpu_vm", False):
            return "cloud-tpu-vm"
    return None


def initialize(**jax_kwargs: Any) -> bool:
    """Start JAX's distributed runtime if this process is one of several; else do nothing.

    Reads, in order:

    1. ``modelshard launch`` variables: ``MODELSHARD_COORDINATOR`` (``host:port``),
       ``MODELSHARD_NUM_PROCESSES``, ``MODELSHARD_PROCESS_ID`` and, for simulated CPU
       devices, ``MODELSHARD_LOCAL_DEVICES`` (sets ``jax_num_cpu_devices`` first);
    2. a cluster environment JAX detects itself (see ``cluster_detected``): then
       ``jax.distributed.initialize()`` is called without arguments;
    3. nothing: a single process, and this is a no-op (``MODELSHARD_LOCAL_DEVICES`` is
       still honoured).

    Call it once, first, before any JAX computation. Calling it again is harmless.

    Args:
        **jax_kwargs: passed on to ``jax.distributed.initialize`` (for example
            ``initialization_timeout=60``); explicit ``coordinator_address``,
            ``num_processes`` and ``process_id`` win over the environment.

    Returns:
        Whether the distributed runtime is running (``jax.process_count()`` may be > 1).

    Raises:
        DistributedError: a malformed variable, or a call after JAX's backend was
            already started (too late to join other processes).

    Example:
        >>> import modelshard as ms
        >>> ms.distributed.initialize()  # a plain process: nothing to do
        False
    """
    if jax.distributed.is_initialized():
        return True
    env = os.environ
    coordinator = env.get(ENV_COORDINATOR) or None
    num = _env_int(env, ENV_NUM_PROCESSES, 1)
    pid = _env_int(env, ENV_PROCESS_ID, 0)
    local = _env_int(env, ENV_LOCAL_DEVICES, 1)
    if local is not None:
        _set_cpu_devices(local)
    if "coordinator_address" in jax_kwargs or "num_processes" in jax_kwargs:
        _start(**jax_kwargs)
        return True
    if coordinator is not None:
        missing = [n for n, v in ((ENV_NUM_PROCESSES, num), (ENV_PROCESS_ID, pid)) if v is None]
        if missing:
            raise DistributedError(
                f"{ENV_COORDINATOR} is set but {', '.join(missing)} is not; "
                "start processes with `modelshard launch -n N -- ...`."
            )
        if pid >= num:  # type: ignore[operator]  # both are set: checked just above
            raise DistributedError(
                f"{ENV_PROCESS_ID}={pid} is not below {ENV_NUM_PROCESSES}={num}."
            )
        if num == 1:
            return False
        _start(coordinator_address=coordinator, num_processes=num, process_id=pid, **jax_kwargs)
        return True
    if cluster_detected() is not None:
        _start(**jax_kwargs)
        return True
    return False


def _backend_started() -> bool:
    from jax._src import xla_bridge

    return bool(xla_bridge.backends_are_initialized())


def _set_cpu_devices(count: int) -> None:
    if jax.config.jax_num_cpu_devices == count:  # type: ignore[attr-defined]
        return
    if _backend_started():
        raise DistributedError(
            f"{ENV_LOCAL_DEVICES}={count} asks for {count} CPU devices, but JAX's backend "
            "was already started; call modelshard.distributed.initialize() first, before "
            "any JAX computation (jax.devices(), jnp arrays, ...)."
        )
    jax.config.update("jax_num_cpu_devices", count)


def _start(**kwargs: Any) -> None:
    if _backend_started():
        raise DistributedError(
            "JAX's backend was already started, so this process can no longer join the "
            "others; call modelshard.distributed.initialize() first, before any JAX "
            "computation (jax.devices(), jnp arrays, ...)."
        )
    jax.distributed.initialize(**kwargs)


def is_main_process() -> bool:
    """Whether this is process 0, the one that should print, log and write side files."""
    return jax.process_index() == 0


def barrier(name: str = "modelshard.barrier") -> None:
    """Wait until every process reaches this point (a no-op in a single process).

    Every process must call it with the same ``name``, in the same order.
    """
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def to_host(tree: Any) -> Any:
    """The full value of every array leaf as NumPy, on every process.

    Arrays that span devices of other processes are all-gathered (a collective: every
    process must call it, with the same tree); the rest are copied. Typed PRNG keys come
    back as their ``jax.random.key_data``. NNX modules come back as their ``nnx.State``,
    other containers as themselves.

    Example:
        >>> import jax.numpy as jnp
        >>> import modelshard as ms
        >>> ms.distributed.to_host({"w": jnp.arange(3)})["w"]
        array([0, 1, 2], dtype=int32)
    """
    flat = split(tree)
    out = []
    for x in flat.arrays:
        if isinstance(x, jax.ShapeDtypeStruct):
            raise DistributedError(
                "to_host got an abstract leaf (jax.ShapeDtypeStruct): it has no value to fetch."
            )
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)  # NumPy has no key dtype: the raw uint32 words
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            from jax.experimental import multihost_utils

            out.append(np.asarray(multihost_utils.process_allgather(x, tiled=True)))
        else:
            out.append(np.asarray(x))
    return flat.rebuild(out, mirror=True)


def local_slice(shape: Sequence[int], spec: Any, mesh: Any) -> tuple[slice, ...]:
    """The block of a global array that this process's devices hold: what to load here.

    With a batch sharded over ``data``, each process reads only these rows from disk and
    passes them to [`modelshard.assemble`][modelshard.assemble] (or ``jax.make_array_from_process_local_data``).

    Args:
        shape: the global shape.
        spec: its ``PartitionSpec`` on ``mesh``.
        mesh: a concrete mesh (it may span several processes).

    Returns:
        One ``slice`` per dimension.

    Raises:
        DistributedError: this process's shards do not form one block (an unusual device
            order); use ``NamedSharding(mesh, spec).addressable_devices_indices_map``.

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> import modelshard as ms
        >>> ms.distributed.local_slice((16, 8), P("data"), ms.make_mesh({"data": 8}))
        (slice(0, 16, None), slice(0, 8, None))
    """
    shape = tuple(int(n) for n in shape)
    sharding = NamedSharding(mesh, spec)
    index = [i for i in sharding.addressable_devices_indices_map(shape).values() if i is not None]
    out = []
    for d, n in enumerate(shape):
        ranges = sorted({idx[d].indices(n)[:2] for idx in index})
        lo, hi = ranges[0][0], ranges[-1][1]
        if sum(b - a for a, b in ranges) != hi - lo:
            raise DistributedError(
                f"process {jax.process_index()}'s shards of a {list(shape)} array with spec "
                f"{spec} do not form one block along dimension {d} ({ranges}); use "
                "NamedSharding(mesh, spec).addressable_devices_indices_map(shape)."
            )
        out.append(slice(lo, hi))
    return tuple(out)


def require_addressable(x: Any, what: str) -> None:
    """Raise a clear error if ``x`` is an array that spans devices of other processes.

    Args:
        x: any value; only ``jax.Array`` instances are checked.
        what: what needed the value, for the message (``"assemble: leaf 'w'"``).
    """
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        mine = len(x.addressable_shards)
        total = len(x.sharding.device_set)
        raise DistributedError(
            f"{what} needs the full value of a {x.dtype}{list(x.shape)} array that spans "
            f"devices of other processes (process {jax.process_index()} of "
            f"{jax.process_count()} holds {mine} of its {total} devices); call "
            "modelshard.distributed.to_host(value) on every process to all-gather it, or "
            "work on value.addressable_shards."
        )
