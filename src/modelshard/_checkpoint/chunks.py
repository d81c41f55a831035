"""The stored chunk shape of each array: one that a restore onto halves or quarters of any
dimension reads without waste.

TensorStore reads a stored (zarr v2) chunk whole. Orbax stores each shard as written as
one chunk, so an array saved split by columns and restored split by rows had every process
read every chunk whole: twice its share on two processes. Chunks here tile the shard as
written and also line up with the halves, then the quarters, of every dimension of the
array (the splits a restore onto another mesh most often asks for), as long as a chunk
keeps ``MIN_CHUNK_BYTES``: below that the number of chunks, not their bytes, is what a
read costs, and a whole small array is a small read anyway.

Orbax picks the chunk shape from the shape it writes (``build_array_write_spec``'s
``local_shape``) when no ``chunk_byte_size`` is asked for. ``aligned_array_handler`` marks
the arguments of its writes (``AlignedSaveArgs``), and Orbax's ``build_array_write_spec``
is wrapped, once, in the module where Orbax's own code looks it up, so that a marked write
is given the aligned chunk as its write shape (as ``stream.py`` writes its slabs): the files
are Orbax's own format, only with smaller chunks, and any reader (plain Orbax included)
reads them. Writes without the mark, plain Orbax's among them, are left as they were.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

# A chunk is cut into halves or quarters of a dimension only while it keeps this many
# bytes: a 4 MiB float32 [1024, 1024] leaf saved in four column shards is stored in 16
# chunks of 256 KiB, a [128, 128] kernel (64 KiB) stays one chunk per shard.
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


@functools.cache
def _args_class() -> type:
    import orbax.checkpoint as ocp

    @dataclasses.dataclass
    class AlignedSaveArgs(ocp.SaveArgs):
        """Orbax's ``SaveArgs``, marked: the write is stored in ``aligned_chunks``."""

    return AlignedSaveArgs


def _install() -> None:
    """Wrap Orbax's ``build_array_write_spec`` (once) so that a write marked with
    ``AlignedSaveArgs`` is stored in ``aligned_chunks``."""
    from .._internals import wrap_build_array_write_spec

    wrap_build_array_write_spec(_aligning)


def _aligning(original: Any) -> Any:
    """``original`` (Orbax's ``build_array_write_spec``) storing a write marked with
    ``AlignedSaveArgs`` in ``aligned_chunks``; None where it does so already."""
    if getattr(original, "modelshard_aligned", False):
        return None
    marked = _args_class()

    @functools.wraps(original)
    def build_array_write_spec(info: Any, arg: Any = None, **kwargs: Any) -> Any:
        if isinstance(arg, marked) and arg.chunk_byte_size is None and not arg.shard_axes:
            stored = np.dtype(arg.dtype or kwargs["dtype"])
            kwargs["local_shape"] = aligned_chunks(
                kwargs["global_shape"], kwargs["local_shape"], stored.itemsize
            )
        return original(info, arg, **kwargs)

    build_array_write_spec.modelshard_aligned = True  # type: ignore[attr-defined]
    return build_array_write_spec


@functools.cache
def _handler_class() -> type:
    import orbax.checkpoint as ocp

    marked = _args_class()

    class AlignedArrayHandler(ocp.type_handlers.ArrayHandler):
        """Orbax's ``jax.Array`` handler, each array stored in ``aligned_chunks``."""

        async def serialize(
            self, values: Sequence[Any], infos: Sequence[Any], args: Sequence[Any] | None = None
        ) -> Any:
            given = args or [ocp.SaveArgs()] * len(values)
            aligned = [
                marked(**{f.name: getattr(a, f.name) for f in dataclasses.fields(a)}) for a in given
            ]
            return await super().serialize(values, infos, aligned)

    return AlignedArrayHandler


def aligned_array_handler(**kwargs: Any) -> Any:
    """Orbax's ``ArrayHandler(**kwargs)``, storing each array in ``aligned_chunks``."""
    _install()
    return _handler_class()(**kwargs)
