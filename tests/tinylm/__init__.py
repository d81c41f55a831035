"""tinylm: a small model library, written as a library author would with modelshard.

It names logical axes only: its parameters carry logical names (linen's
``with_logical_partitioning``, NNX's ``with_partitioning``) and its activations go through
``tinylm.sharding.constrain``; which mesh axes those names mean is its users' choice, with
the defaults declared in ``AXES``. The linen and NNX variants have the same parameter
paths, so one checkpoint serves both.
"""

from __future__ import annotations

import dataclasses

import modelshard as ms

AXES = ms.LogicalAxes(
    "tinylm",
    names=("batch", "seq", "embed", "heads", "kv", "mlp", "vocab"),
    defaults={
        "batch": "data",
        "seq": None,
        "embed": None,
        "heads": "model",
        "kv": None,
        "mlp": "model",
        "vocab": "model",
    },
)
"""tinylm's logical axes: the defaults suit a ``data`` x ``model`` mesh (tensor parallel)."""


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 32
    embed: int = 16
    heads: int = 4
    kv: int = 4
    mlp: int = 32
    layers: int = 2
    flax_constraints: bool = False
    """The linen variant constrains its activations with Flax's own
    ``nn.with_logical_constraint`` instead of ``tinylm.sharding.constrain``, as a library
    written for Flax's ``nn.logical_axis_rules`` does."""
