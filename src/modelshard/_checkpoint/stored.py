"""A stored array read straight from its TensorStore store: boxes as NumPy arrays of the
stored dtype, no device, no Orbax restore. What ``reshard`` copies from, what
``restore(mapping=)`` and ``modelshard convert --to safetensors`` read leaves with.
"""

from __future__ import annotations

from typing import Any

from .._base import CheckpointError
from .arrival import start_read
from .leaks import stop_leaks
from .record import LeafRecord
from .sources import Source, store_format
from .storage import orbax_name


def _unreadable(source: Source, rec: LeafRecord, e: BaseException) -> CheckpointError:
    text = (str(e).strip().splitlines() or [""])[0][:300]
    return CheckpointError(
        f"cannot read 1 leaf of {source.path} (damaged or incomplete checkpoint):\n"
        f"  {rec.path or '<root>'}: {type(e).__name__}: {text}"
    )


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
        context: a TensorStore context shared by the readers of one checkpoint, or None.
    """

    def __init__(
        self,
        source: Source,
        rec: LeafRecord,
        fmt: tuple[bool, bool] | None = None,
        context: Any = None,
    ):
        from orbax.checkpoint import type_handlers as tsu

        self.source, self.rec = source, rec
        self.fmt = store_format(source) if fmt is None else fmt
        self.context = tsu.get_ts_context(use_ocdbt=self.fmt[0]) if context is None else context
        self.store: Any = None

    def __call__(self, box: tuple[slice, ...]) -> Any:
        import tensorstore as ts

        from .._internals import ArrayReadSpec

        try:
            if self.store is None:
                use_ocdbt, use_zarr3 = self.fmt
                stop_leaks()  # Orbax's spec converts TensorStore JSON to Python
                spec = ArrayReadSpec(
                    str(self.source.tree_dir),
                    orbax_name(self.rec.key),
                    use_zarr3,
                    use_ocdbt=use_ocdbt,
                )
                self.store = ts.open(spec.json, context=self.context).result()
            # Read into a buffer aligned for XLA's CPU client: ``device_put`` onto a CPU
            # device (``write_stream`` checksums each slab there) then adopts it as it
            # is, where TensorStore's own ``read()`` result was copied first.
            out, done = start_read(self.store[box])
            done.result()
            return out
        except Exception as e:
            raise _unreadable(self.source, self.rec, e) from e
