"""``ArrayReader`` hands over boxes a CPU device adopts as they are (no copy).

``write_stream`` puts each slab it copies on a CPU device to checksum it; XLA's CPU client
adopts a host buffer aligned to ``HOST_ALIGN`` bytes as the device buffer, and copies any
other. The reader reads each box into such a buffer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import modelshard as ms
from modelshard._checkpoint import locate
from modelshard._checkpoint.arrival import HOST_ALIGN
from modelshard._checkpoint.stored import ArrayReader


def test_array_reader_boxes_are_adopted_by_a_cpu_device_without_a_copy(tmp_path):
    mesh = ms.make_mesh({"data": 8})
    w = jnp.arange(64 * 48, dtype=jnp.float32).reshape(64, 48)
    b = jnp.arange(40, dtype=jnp.bfloat16).reshape(8, 5)
    ms.save(tmp_path / "ck", ms.shard({"w": w, "b": b}, P("data"), mesh))
    source = locate(tmp_path / "ck")
    device = jax.local_devices()[0]
    cases = {
        "w": (w, [(slice(3, 17), slice(5, 41)), (slice(0, 64), slice(0, 48))]),
        "b": (b, [(slice(1, 7), slice(2, 5)), (slice(0, 8), slice(0, 5))]),
    }
    for path, (want, boxes) in cases.items():
        read = ArrayReader(source, source.record.by_path()[path])
        for box in boxes:
            got = read(box)
            assert got.ctypes.data % HOST_ALIGN == 0
            np.testing.assert_array_equal(got, np.asarray(want)[box])
            on_device = jax.device_put(got, device)
            assert on_device.unsafe_buffer_pointer() == got.ctypes.data
