"""One test per bug the fuzz suite (``tests/test_fuzz.py``) found, with its exact message.

Each test names the finding in ``docs/reliability.md`` it guards.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms


def test_fsdp_repeated_axis_is_rejected_when_built() -> None:
    """Finding 3: fsdp(('data', 'data')) silently replicated every leaf that was small or
    had no dimension divisible by data*data; only a big divisible leaf raised."""
    with pytest.raises(ms.SpecError) as e:
        ms.fsdp(("data", "data"), min_size=0)
    assert str(e.value).splitlines() == [
        "1 sharding problem found (every offending leaf is listed; paths are arg:path):",
        "  fsdp:axis",
        "    problem: mesh axis 'data' is used twice in ('data', 'data')",
        "    hint: each mesh axis may shard at most one dimension of a leaf",
    ]


def test_fsdp_distinct_axes_still_accepted(mesh24) -> None:
    p = ms.plan({"w": jnp.zeros((16, 3))}, ms.fsdp(("data", "model"), min_size=0), mesh24)
    assert p["w"].spec == P(("data", "model"))
