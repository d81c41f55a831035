"""The runtime behind ``modelshard.distributed``: ``initialize`` and the collectives."""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from .._base import DistributedError
from .._containers import split
from .._internals import backends_are_initialized, cloud_tpu_init, global_state
from .processes import (
    ENV_BARRIER_TIMEOUT,
    ENV_COORDINATOR,
    ENV_HEARTBEAT_TIMEOUT,
    ENV_LOCAL_DEVICES,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)

DEFAULT_BARRIER_TIMEOUT_S = 600.0
"""How long ``barrier``, ``broadcast`` and ``gather`` wait for the other processes unless
``MODELSHARD_BARRIER_TIMEOUT`` says otherwise: it bounds a process alive but stuck (a dead one
is noticed sooner, after the heartbeat timeout)."""


def _env_number(
    env: Mapping[str, str],
    name: str,
    parse: Callable[[str], Any],
    valid: Callable[[Any], bool],
    must: str,
) -> Any:
    """``parse`` of the variable ``name``, None when unset or empty; else ``valid`` or an error."""
    raw = env.get(name, "")
    if raw == "":
        return None
    try:
        value = parse(raw)
    except ValueError:
        value = None
    if value is None or not valid(value):
        raise DistributedError(f"environment variable {name}={raw!r} must be {must}.")
    return value


def _env_int(env: Mapping[str, str], name: str, minimum: int) -> int | None:
    return _env_number(env, name, int, lambda v: v >= minimum, f"an integer >= {minimum}")


def env_seconds(name: str, env: Mapping[str, str] | None = None) -> float | None:
    """The positive seconds in the environment variable ``name``, or None when unset or empty."""
    env = os.environ if env is None else env
    return _env_number(env, name, float, lambda v: 0 < v < math.inf, "a positive number of seconds")


def cluster_detected(env: Mapping[str, str] | None = None) -> str | None:
    """The cluster launcher JAX can configure itself from (SLURM, Open MPI, TPU pods, ...), or
    ``None`` in a plain process; the environment only, no network queries."""
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
    ompi_env = "OMPI_MCA_orte_hnp_uri" in env or all(k in env for k in ompi)
    if ompi_env and many("OMPI_COMM_WORLD_SIZE"):
        return "openmpi"
    tpu = ("TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES", "TPU_PROCESS_ADDRESSES_PATH")
    if any(k in env for k in tpu):
        return "tpu"
    if env is os.environ and getattr(cloud_tpu_init, "running_in_cloud_tpu_vm", False):
        return "cloud-tpu-vm"
    return None


def initialize(**jax_kwargs: Any) -> bool:
    """Start JAX's distributed runtime if this process is one of several; else do nothing.

    Reads ``modelshard launch``'s ``MODELSHARD_*`` variables, else a cluster environment
    JAX detects itself (``cluster_detected``); in a plain process it does nothing.
    ``MODELSHARD_LOCAL_DEVICES`` sets the simulated CPU devices, and
    ``MODELSHARD_HEARTBEAT_TIMEOUT`` the seconds a silent process has before it is declared
    dead. Call it once, first, before any JAX computation; again is harmless.

    Args:
        **jax_kwargs: passed on to ``jax.distributed.initialize``; they win over the
            environment.

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
    heartbeat = env_seconds(ENV_HEARTBEAT_TIMEOUT, env)
    if heartbeat is not None:  # JAX counts whole seconds: a fraction is rounded up
        jax_kwargs.setdefault("heartbeat_timeout_seconds", math.ceil(heartbeat))
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
        where = {"coordinator_address": coordinator, "num_processes": num, "process_id": pid}
        _start(**{**where, **jax_kwargs})  # the caller's arguments win
        return True
    if cluster_detected() is not None:
        _start(**jax_kwargs)
        return True
    return False


def _set_cpu_devices(count: int) -> None:
    if jax.config.jax_num_cpu_devices == count:  # type: ignore[attr-defined]
        return
    if backends_are_initialized():
        raise DistributedError(
            f"{ENV_LOCAL_DEVICES}={count} asks for {count} CPU devices, but JAX's backend "
            "was already started; call modelshard.distributed.initialize() first, before "
            "any JAX computation (jax.devices(), jnp arrays, ...)."
        )
    jax.config.update("jax_num_cpu_devices", count)


def _start(**kwargs: Any) -> None:
    if backends_are_initialized():
        raise DistributedError(
            "JAX's backend was already started, so this process can no longer join the "
            "others; call modelshard.distributed.initialize() first, before any JAX "
            "computation (jax.devices(), jnp arrays, ...)."
        )
    jax.distributed.initialize(**kwargs)


def is_main_process() -> bool:
    """Whether this is process 0, the one that should print, log and write side files."""
    return jax.process_index() == 0


def barrier_timeout_s() -> float:
    """How long ``barrier``, ``broadcast`` and ``gather`` wait: ``MODELSHARD_BARRIER_TIMEOUT``
    seconds, else ``DEFAULT_BARRIER_TIMEOUT_S``.

    Raises:
        DistributedError: the variable is not a positive number.
    """
    value = env_seconds(ENV_BARRIER_TIMEOUT)
    return DEFAULT_BARRIER_TIMEOUT_S if value is None else value


_seen: dict[str, int] = {}
_seen_lock = threading.Lock()


def _key(client: Any, kind: str, name: str) -> str:
    """A coordination-service key for this call of ``name``."""
    with _seen_lock:
        n = _seen.get(f"{kind}:{name}", 0) + 1
        while _abandoned(client, f"modelshard/{kind}/{name}/{n}"):
            n += 1
        _seen[f"{kind}:{name}"] = n
    return f"modelshard/{kind}/{name}/{n}"


def _abandoned(client: Any, key: str) -> bool:
    try:
        client.key_value_try_get(f"{key}/abandoned")
    except Exception:  # NOT_FOUND: nobody gave up on it
        return False
    return True


@contextlib.contextmanager
def _waiting(client: Any, key: str, what: str, name: str, timeout: float) -> Iterator[None]:
    """Wait on ``key``; on failure mark it given up (``_key`` skips it), raise ``wait_failed``."""
    try:
        yield
    except Exception as e:  # JaxRuntimeError: DEADLINE_EXCEEDED, or a peer's failure
        with contextlib.suppress(Exception):  # another process marked it first
            client.key_value_set(f"{key}/abandoned", "1")
        raise wait_failed(what, name, timeout, e) from e


def wait_failed(what: str, name: str, timeout: float, e: Exception) -> DistributedError:
    """The error of a wait for the other processes that failed or timed out (ours or Orbax's)."""
    return DistributedError(
        f"process {jax.process_index()} of {jax.process_count()}: {what} {name!r} failed "
        f"after waiting up to {timeout:g} s for the other processes ({ENV_BARRIER_TIMEOUT} "
        f"sets the wait): {type(e).__name__}: {e}. Another process died, is stuck, or took "
        "another path through the program (every process must make the same calls in the "
        "same order)."
    )


def barrier(name: str = "modelshard.barrier", *, timeout_s: float | None = None) -> None:
    """Wait until every process reaches this point (a no-op in a single process).

    Every process must call it with the same ``name``, in the same order. It goes through
    the coordination service (no device collective), so it is safe while devices are busy.

    Args:
        name: the barrier's name (the n-th call of a name is one barrier).
        timeout_s: how long to wait; default ``barrier_timeout_s()``.

    Raises:
        DistributedError: not every process arrived in time (its message names the
            barrier and the timeout).
    """
    if jax.process_count() == 1:
        return
    timeout = barrier_timeout_s() if timeout_s is None else timeout_s
    client = global_state.client
    if client is None:  # a runtime started without JAX's coordination service
        multihost_utils.sync_global_devices(name)
        return
    key = _key(client, "barrier", name)
    with _waiting(client, key, "barrier", name, timeout):
        client.wait_at_barrier(key, _ms(timeout))


def broadcast(
    value: Any, name: str = "modelshard.broadcast", *, timeout_s: float | None = None
) -> Any:
    """Process 0's ``value`` on every process (a JSON value; the others' are ignored).

    Every process acts on process 0's decision; all call it with the same ``name``, in the
    same order (process 0 does not wait).

    Raises:
        DistributedError: process 0's value did not come within the timeout
            (``barrier_timeout_s()`` unless ``timeout_s``).

    Example:
        >>> import modelshard as ms
        >>> ms.distributed.broadcast({"steps": [1, 2]}, "listing")  # one process: itself
        {'steps': [1, 2]}
    """
    if jax.process_count() == 1:
        return json.loads(json.dumps(value))
    timeout = barrier_timeout_s() if timeout_s is None else timeout_s
    client = global_state.client
    text = json.dumps(value) if jax.process_index() == 0 else None
    if client is None:
        return json.loads(_broadcast_by_devices(text))
    key = _key(client, "broadcast", name)
    if text is not None:
        client.key_value_set(key, text)
        return json.loads(text)
    with _waiting(client, key, "broadcast", name, timeout):
        value = json.loads(client.blocking_key_value_get(key, _ms(timeout)))
    _read(client, key, readers=jax.process_count() - 1)
    return value


def gather(
    value: Any, name: str = "modelshard.gather", *, timeout_s: float | None = None
) -> list[Any]:
    """Every process's ``value`` (JSON), in process order, on every process.

    Every process must call it with the same ``name``, in the same order.

    Raises:
        DistributedError: a process's value did not come within the timeout.

    Example:
        >>> import modelshard as ms
        >>> ms.distributed.gather("ok", "status")
        ['ok']
    """
    text = json.dumps(value)
    if jax.process_count() == 1:
        return [json.loads(text)]
    timeout = barrier_timeout_s() if timeout_s is None else timeout_s
    client = global_state.client
    if client is None:
        texts = [
            _broadcast_by_devices(text if p == jax.process_index() else None, p)
            for p in range(jax.process_count())
        ]
        return [json.loads(t) for t in texts]
    key = _key(client, "gather", name)
    client.key_value_set(f"{key}/{jax.process_index()}", text)
    keys = [f"{key}/{p}" for p in range(jax.process_count())]
    with _waiting(client, key, "gather", name, timeout):
        out = [json.loads(client.blocking_key_value_get(k, _ms(timeout))) for k in keys]
    _read(client, key, readers=len(out))
    return out


def _ms(timeout: float) -> int:
    return max(1, int(timeout * 1000))


def _read(client: Any, key: str, readers: int) -> None:
    """Count this process done reading ``key``; the last reader removes all under it."""
    if client.key_value_increment(f"{key}/read", 1) == readers:
        client.key_value_delete(key)  # the key and every key under ``key/``


def _broadcast_by_devices(text: str | None, source: int = 0) -> str:
    """``text`` of process ``source`` on every process, by device collectives (no client)."""
    mine = np.frombuffer((text or "").encode(), np.uint8)
    me = jax.process_index() == source
    size = int(multihost_utils.broadcast_one_to_all(np.int64(mine.size), is_source=me))
    buf = np.zeros(size, np.uint8)
    if me:
        buf[:] = mine
    out = multihost_utils.broadcast_one_to_all(buf, is_source=me)
    return np.asarray(out, np.uint8).tobytes().decode()


def to_host(tree: Any) -> Any:
    """The full value of every array leaf as NumPy, on every process.

    Arrays spanning other processes' devices are all-gathered (every process must call it,
    with the same tree). PRNG keys come back as their ``key_data``, NNX modules as their
    ``nnx.State``.

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
            out.append(np.asarray(multihost_utils.process_allgather(x, tiled=True)))
        else:
            out.append(np.asarray(x))
    return flat.rebuild(out, mirror=True)


def local_slice(shape: Sequence[int], spec: Any, mesh: Any) -> tuple[slice, ...]:
    """The block of a global array that this process's devices hold: what to load here.

    Each process reads only this block, for [`modelshard.assemble`][modelshard.assemble].

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
