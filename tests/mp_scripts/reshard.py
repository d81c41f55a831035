"""``modelshard.reshard`` on every process of a ``modelshard launch`` run.

Usage: ``python reshard.py SRC DST``: reshards SRC onto a (data=2, model=4) mesh with
``P("data", "model")`` (a PRNG key leaf replicated) into DST.
"""

from __future__ import annotations

import sys

import modelshard as ms

ms.distributed.initialize()

from jax.sharding import PartitionSpec as P  # noqa: E402

if __name__ == "__main__":
    mesh = ms.make_mesh({"data": 2, "model": 4})
    specs = ms.Rules([("^key$", P()), (".*", P("data", "model"))])
    ms.reshard(sys.argv[1], sys.argv[2], specs=specs, mesh=mesh)
