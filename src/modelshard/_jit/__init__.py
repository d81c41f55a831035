"""``shard_jit``: ``jax.jit`` over containers (see README.md in this folder for the call path)."""

from .wrapper import ShardJit as ShardJit
from .wrapper import shard_jit as shard_jit
