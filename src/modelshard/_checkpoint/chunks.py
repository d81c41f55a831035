"""The stored chunk shape of each array: one that a restore onto halves or quarters of any
dimension reads without waste.

TensorStore reads a stored chunk whole, and Orbax stores each shard as one chunk. Chunks here
tile the shard as written and also line up with the halves, then the quarters, of every
dimension, as long as a chunk keeps ``MIN_CHUNK_BYTES`` (below that, the number of chunks is
what a read costs). Any reader, plain Orbax included, reads them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# A chunk is cut into halves or quarters of a dimension only while it keeps this many bytes.
MIN_CHUNK_BYTES = 256 << 10

# The parts of a dimension a chunk lines up with, coarsest first.
PARTS = (2, 4)


def aligned_chunks(
    global_shape: Sequence[int], write_shape: Sequence[int], itemsize: int
) -> tuple[int, ...]:
    """The chunk shape an array of ``global_shape`` is stored in when written in blocks of
    ``write_shape``: it divides ``write_shape`` and, dimension by dimension (the largest
    chunk dimension first), the halves and then the quarters of ``global_shape``, each cut
    made only while the chunk keeps ``MIN_CHUNK_BYTES``."""
    chunk = [max(1, int(w)) for w in write_shape]
    for parts in PARTS:
        for d in sorted(range(len(chunk)), key=lambda d: -chunk[d]):
            size = int(global_shape[d])
            if size == 0 or size % parts:
                continue
            cut = math.gcd(chunk[d], size // parts)
            if cut == chunk[d]:
                continue
            if math.prod(chunk) // chunk[d] * cut * itemsize < MIN_CHUNK_BYTES:
                continue
            chunk[d] = cut
    return tuple(chunk)
