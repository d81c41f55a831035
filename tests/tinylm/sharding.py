"""tinylm's one way to constrain an activation: logical names only."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
from jax.sharding import PartitionSpec as P

import modelshard as ms


def constrain(x: Any, *names: str | None) -> Any:
    """``x`` constrained to the logical ``names`` (one per dimension); nothing without a
    mesh or rules. ``stacklevel=2``: errors name the model line calling this, not it."""
    return ms.constrain(x, P(*names), stacklevel=2, name="/".join(n or "-" for n in names))


def flax_constrain(x: Any, *names: str | None) -> Any:
    """The same constraint through Flax's own API, as a library written for Flax's
    ``nn.logical_axis_rules`` writes it."""
    return nn.with_logical_constraint(x, names)
