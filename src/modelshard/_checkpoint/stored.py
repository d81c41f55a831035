"""A stored array read straight from its TensorStore store: boxes as NumPy arrays of the
stored dtype, no device, no Orbax restore. What ``reshard`` copies from, what
``restore(mapping=)`` and ``modelshard convert --to safetensors`` read leaves with.
"""

from __future__ import annotations

from typing import Any

from .._base import CheckpointError
from .arrival import start_read
from .leaks import stop_leaks
from .ocdbt import context, read_spec
from .read import read_failure, unreadable
from .record import LeafRecord, parse_dtype
from .sources import Source, store_format
from .storage import orbax_name
from .urls import is_remote


def _unreadable(source: Source, rec: LeafRecord, e: BaseException) -> CheckpointError:
    return unreadable(source.path, [(rec.path, read_failure(e, source.tree_dir))])


def _local_ocdbt(source: Source, fmt: tuple[bool, bool]) -> bool:
    """Whether ``source``'s arrays are read without Orbax (``ocdbt.py``): zarr v2 in OCDBT
    on a local disk."""
    return fmt == (True, False) and not is_remote(source.path)


def reader_context(source: Source, fmt: tuple[bool, bool]) -> Any:
    """The TensorStore context the readers of ``source`` (``store_format`` ``fmt``) share:
    Orbax's, built without Orbax where ``ocdbt.py`` reads the checkpoint."""
    if _local_ocdbt(source, fmt):
        return context()
    from orbax.checkpoint import type_handlers as tsu

    return tsu.get_ts_context(use_ocdbt=fmt[0])


def _spec(source: Source, fmt: tuple[bool, bool], name: str) -> Any:
    if _local_ocdbt(source, fmt):
        return read_spec(str(source.tree_dir), name)
    from .._internals import ArrayReadSpec

    stop_leaks()  # Orbax's spec converts TensorStore JSON to Python
    use_ocdbt, use_zarr3 = fmt
    return ArrayReadSpec(str(source.tree_dir), name, use_zarr3, use_ocdbt=use_ocdbt).json


class ArrayReader:
    """Reads boxes of one stored array of a checkpoint straight from its TensorStore store
    (the spec Orbax's read path uses), as NumPy arrays of the stored dtype: nothing is
    placed on a device. ``reader(box)`` takes a tuple of ``slice(start, stop)`` and returns
    a new array aligned as ``arrival.aligned_empty`` makes it; a failure
    is a CheckpointError naming the leaf. Not verified: compare the boxes' checksums
    (``checksum.box_sums``) with ``rec.checksum``, as ``write_stream`` does with ``expect``.

    Args:
        source: the located checkpoint.
        rec: the leaf's record in ``source.record``.
        fmt: ``store_format(source)`` (computed once per checkpoint), or None.
        context: a TensorStore context shared by the readers of one checkpoint
            (``reader_context``), or None.
    """

    def __init__(
        self,
        source: Source,
        rec: LeafRecord,
        fmt: tuple[bool, bool] | None = None,
        context: Any = None,
    ):
        self.source, self.rec = source, rec
        self.fmt = store_format(source) if fmt is None else fmt
        self.context = reader_context(source, self.fmt) if context is None else context
        self.store: Any = None

    def __call__(self, box: tuple[slice, ...]) -> Any:
        import tensorstore as ts

        try:
            if self.store is None:
                spec = _spec(self.source, self.fmt, orbax_name(self.rec.key))
                self.store = ts.open(spec, context=self.context).result()
                want = parse_dtype(self.rec.stored_dtype)
                if self.store.dtype.numpy_dtype != want:
                    # a Python number plain Orbax stored 64-bit, recorded as JAX holds it
                    self.store = ts.cast(self.store, want)
            # Read into a buffer aligned for XLA's CPU client: ``device_put`` onto a CPU
            # device (``write_stream`` checksums each slab there) then adopts it as it
            # is, where TensorStore's own ``read()`` result was copied first.
            out, done = start_read(self.store[box])
            done.result()
            return out
        except Exception as e:
            raise _unreadable(self.source, self.rec, e) from e
