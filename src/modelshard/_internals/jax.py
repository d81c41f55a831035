"""Every private name of JAX (``jax._src``) that modelshard uses, each imported once with what it is
for."""

from __future__ import annotations

from .needs import needed

DIST = "jax"

with needed(
    DIST,
    "jax._src.array.ArrayImpl",
    "the concrete type of jax.Array values: leaves of that exact type are known arrays "
    "without an isinstance check (planning and shard_jit's dispatch over 10,000-leaf trees)",
):
    from jax._src.array import ArrayImpl

with needed(
    DIST,
    "jax._src.xla_bridge.backends_are_initialized",
    "whether JAX's backend has started: CPU devices can be simulated and the distributed "
    "runtime joined only before it has (distributed.initialize, the reshard CLI)",
):
    from jax._src.xla_bridge import backends_are_initialized

with needed(
    DIST,
    "jax._src.distributed.global_state",
    "the coordination-service client of jax.distributed.initialize, whose key-value store "
    "and barriers modelshard's barrier, broadcast and gather use, and its preemption "
    "sync manager, to which a polling loop hands a signal (checkpoint guard)",
):
    from jax._src.distributed import global_state

with needed(
    DIST,
    "jax._src.cloud_tpu_init",
    "telling a Cloud TPU VM apart when detecting a cluster (distributed.cluster_detected)",
):
    from jax._src import cloud_tpu_init
