"""How a streamed leaf is laid out (``_checkpoint/slabs.py``): slabs that follow the
source's blocks, stored chunks that tile slabs and shards."""

from __future__ import annotations

from modelshard._checkpoint.slabs import slab_plan


def test_slab_plan_follows_the_source_blocks_and_tiles_the_new_shards():
    kib = 1 << 10
    # a block over the slab budget but within whole_bytes is one slab
    plan = slab_plan((1024, 256), 4, (256, 256), 64 * kib, 256 * kib, (128, 256))
    assert plan == ((128, 256), (128, 256))
    # small blocks: whole rows first, then more rows up to the budget
    assert slab_plan((1024, 256), 4, (32, 256), 64 * kib, 256 * kib, (16, 256)) == (
        (64, 256),
        (32, 256),
    )
    assert slab_plan((1024, 256), 4, (32, 256), 64 * kib, 256 * kib) == ((64, 256), (32, 256))
    assert slab_plan((512, 64), 4, (512, 16), 4 * kib, 16 * kib, (512, 8)) == ((512, 8), (512, 8))
    # a block over whole_bytes is cut, leading dimension first (a row too long: columns too)
    assert slab_plan((512, 64), 4, (512, 16), 4 * kib, 16 * kib, (512, 64)) == ((16, 64), (16, 16))
    assert slab_plan((4, 1024), 4, (4, 1024), kib, kib) == ((1, 256), (1, 256))
    assert slab_plan((), 4, (), 1, 1) == ((), ())
    assert slab_plan((0, 8), 4, (0, 8), 1, 1) == ((0, 8), (0, 8))
