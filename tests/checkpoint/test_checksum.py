"""Where each leaf's checksum is summed (``_checkpoint/checksum.py``): device programs on
CPU devices, the host beside the reads and writes elsewhere, the same numbers either way."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from modelshard._checkpoint import checksum


def test_cpu_devices_keep_their_programs_for_large_leaves(mesh8):
    x = jax.device_put(jnp.ones((2048, 1024)), NamedSharding(mesh8, P("data")))
    abstract = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    assert not checksum.on_accelerator(x) and not checksum.on_accelerator(abstract)
    assert checksum.on_host([x, abstract], checksum.HOST_MAX_ELEMENTS) == [False, False]
    assert checksum.on_host([jnp.ones(3)], checksum.HOST_MAX_ELEMENTS) == [True]


def test_host_sums_taken_in_parallel_match_the_device_programs(mesh8):
    """Many leaves handed to the host workers at once (as a restore on an accelerator adds
    them): each sum is the device program's."""
    rng = np.random.default_rng(0)
    specs = [P("data"), P(None, "data"), P()]
    leaves = {
        f"l{i}": jax.device_put(
            jnp.asarray(rng.standard_normal((64, 48)), jnp.float32),
            NamedSharding(mesh8, specs[i % 3]),
        )
        for i in range(24)
    }
    want = dict(zip(leaves, checksum.checksums(list(leaves.values())), strict=True))
    sums = checksum.Checksums(leaves, host=True)
    for k, x in leaves.items():
        sums.add(k, x)
    assert sums.collect() == want
    assert checksum.checksums(list(leaves.values()), host=True) == list(want.values())
