"""Checksums summed on the host (``_checkpoint/host_sums.py``): shard by shard in small
blocks, the same numbers as on the devices, position terms reused across alike leaves."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import modelshard as ms


@pytest.mark.parametrize("spec", [P(), P("data", "model"), P(None, "model", "data")])
def test_shard_by_shard_host_checksums_match_in_small_blocks(spec, monkeypatch):
    from modelshard._checkpoint import checksum as _record
    from modelshard._checkpoint import host_sums

    x = jnp.asarray(np.random.default_rng(2).integers(0, 2**31, size=(6, 4, 10)), jnp.uint32)
    mesh = ms.make_mesh({"data": 2, "model": 2})
    sharded = jax.device_put(x, NamedSharding(mesh, spec))
    want = _record.checksums([x], host_max_elements=0)
    monkeypatch.setattr(host_sums, "HOST_BLOCK_ELEMENTS", 3)  # blocks split rows and columns
    assert _record.checksums([sharded], host=True) == want
    assert _record.checksums([x]) == want


def test_host_checksums_reuse_position_terms_across_alike_leaves(monkeypatch):
    """Leaves of one layout share the cached position terms; values still change the sums."""
    from modelshard._checkpoint import checksum as cs
    from modelshard._checkpoint import host_sums

    monkeypatch.setattr(host_sums, "_WEIGHTS", {})
    monkeypatch.setattr(host_sums, "_weight_bytes", [0])
    rng = np.random.default_rng(3)
    a, b = (jnp.asarray(rng.normal(size=(64, 32)), jnp.float32) for _ in range(2))
    want = cs.checksums([a, b], host_max_elements=0)  # on the devices
    assert cs.checksums([a, b, a], host=True) == [*want, want[0]]
    assert len(host_sums._WEIGHTS) > 0 and want[0] != want[1]
    monkeypatch.setattr(host_sums, "HOST_WEIGHT_CACHE_BYTES", 1)  # nothing fits: computed each time
    monkeypatch.setattr(host_sums, "_WEIGHTS", {})
    assert cs.checksums([b, a], host=True) == want[::-1] and host_sums._WEIGHTS == {}
