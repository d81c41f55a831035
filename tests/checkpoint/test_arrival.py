"""Restore through Orbax hands each array over as Orbax reads it: checksums start while
later leaves are still being read, under a byte cap that queues reads first come, first
served. Orbax reads plain Orbax checkpoints and those on object storage; the tests of that
path that use a local modelshard checkpoint send it through Orbax (``through_orbax``), which
``direct.read_direct`` reads otherwise (tests/checkpoint/test_direct.py)."""

from __future__ import annotations

import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import modelshard as ms
from modelshard._checkpoint import arrival, read
from modelshard._checkpoint import checksum as cs
from modelshard._checkpoint.sources import locate


@pytest.fixture
def through_orbax(monkeypatch):
    """Local modelshard checkpoints read through Orbax, as remote and plain Orbax ones are."""
    monkeypatch.setattr(read, "readable", lambda source: False)


def _state(mesh, n=6):
    rows = NamedSharding(mesh, P("data"))
    return {
        f"layer{i}": {
            "w": jax.device_put(jnp.arange(64 * 8, dtype=jnp.float32).reshape(64, 8) + i, rows)
        }
        for i in range(n)
    }


# ---- FairLimiter ---------------------------------------------------------------------------


def test_fair_limiter_grants_first_come_first_served_within_the_cap():
    held, order, peak = [0], [], [0]

    async def read(limiter, i, n):
        await limiter.wait_for_bytes(n)
        held[0] += n
        peak[0] = max(peak[0], held[0])
        order.append(i)
        await asyncio.sleep(0.001 * (5 - i % 5))
        held[0] -= n
        await limiter.release_bytes(n)

    async def main():
        limiter = arrival.FairLimiter(10)
        sizes = [4, 4, 4, 1, 6, 2, 9, 3]
        await asyncio.gather(*(read(limiter, i, n) for i, n in enumerate(sizes)))
        return limiter

    limiter = asyncio.run(main())
    assert order == list(range(8))  # nothing overtakes a waiting read, not even a small one
    assert peak[0] < 10  # a grant leaves some bytes to spare, as Orbax's limiter does
    assert held[0] == 0 and limiter._free == 10


def test_fair_limiter_refuses_what_orbax_refuses():
    limiter = arrival.FairLimiter(8)
    with pytest.raises(ValueError) as e:
        asyncio.run(limiter.wait_for_bytes(8))
    assert str(e.value) == "Requested more bytes than we reserved space for: 8 > 8"
    with pytest.raises(ValueError) as e:
        arrival.FairLimiter(0)
    assert str(e.value) == "Must provide positive `num_bytes`. Found: 0"


def test_a_cancelled_read_gives_back_its_place_and_its_bytes():
    async def main():
        limiter = arrival.FairLimiter(10)
        await limiter.wait_for_bytes(8)  # granted at once
        big = asyncio.ensure_future(limiter.wait_for_bytes(5))  # must wait
        small = asyncio.ensure_future(limiter.wait_for_bytes(1))  # queued behind it
        await asyncio.sleep(0)
        assert not big.done() and not small.done()
        big.cancel()
        await asyncio.wait_for(small, timeout=5)  # no longer behind a cancelled read
        assert big.cancelled()
        granted = asyncio.ensure_future(limiter.wait_for_bytes(1))
        await asyncio.sleep(0)
        granted.cancel()  # cancelled after the grant: its byte comes back
        await asyncio.gather(granted, return_exceptions=True)
        await limiter.release_bytes(8)
        await limiter.release_bytes(1)
        return limiter._free

    assert asyncio.run(main()) == 10


# ---- reads hand over each array ------------------------------------------------------------


def test_each_array_is_handed_over_before_the_read_returns(tmp_path, mesh8):
    state = _state(mesh8)
    ms.save(tmp_path / "c", state)
    source = locate(tmp_path / "c")
    targets = {
        f"layer{i}/w": jax.ShapeDtypeStruct(
            (64, 8), jnp.float32, sharding=state["layer0"]["w"].sharding
        )
        for i in range(6)
    }
    seen = {}
    out = read.read_checked(source, targets, lambda p, x: seen.setdefault(p, x))
    assert set(seen) == set(targets)
    for p, x in out.items():
        assert seen[p] is x
        np.testing.assert_array_equal(np.asarray(x), np.asarray(state[p.split("/")[0]]["w"]))


def test_restore_starts_each_checksum_while_orbax_is_still_reading(
    tmp_path, mesh8, monkeypatch, through_orbax
):
    state = _state(mesh8)
    ms.save(tmp_path / "c", state)
    reading = [False]
    started = []
    restore = ocp.Checkpointer.restore

    def restore_spy(self, *a, **k):
        reading[0] = True
        try:
            return restore(self, *a, **k)
        finally:
            reading[0] = False

    add = cs.Checksums.add

    def add_spy(self, key, x):
        started.append((key, reading[0]))
        return add(self, key, x)

    monkeypatch.setattr(ocp.Checkpointer, "restore", restore_spy)
    monkeypatch.setattr(cs.Checksums, "add", add_spy)
    monkeypatch.setattr(cs, "HOST_MAX_ELEMENTS", 0)  # every leaf reduced on the devices
    out = ms.restore(tmp_path / "c", like=state)
    assert sorted(started) == sorted((f"layer{i}/w", True) for i in range(6))
    for name, leaf in state.items():
        np.testing.assert_array_equal(np.asarray(out[name]["w"]), np.asarray(leaf["w"]))


def test_reads_queue_under_the_fair_limiter_within_the_cap(
    tmp_path, mesh8, monkeypatch, through_orbax
):
    state = _state(mesh8, n=8)
    ms.save(tmp_path / "c", state)
    shard = 64 * 8 * 4 // 8  # bytes of one device's rows of one leaf
    monkeypatch.setattr(read, "RESTORE_CONCURRENT_BYTES", 3 * shard + 1)
    held, peak, waits = [0], [0], [0]
    wait, release = arrival.FairLimiter.wait_for_bytes, arrival.FairLimiter.release_bytes

    async def wait_spy(self, n):
        waits[0] += 1
        await wait(self, n)
        held[0] += n
        peak[0] = max(peak[0], held[0])

    async def release_spy(self, n):
        held[0] -= n
        await release(self, n)

    monkeypatch.setattr(arrival.FairLimiter, "wait_for_bytes", wait_spy)
    monkeypatch.setattr(arrival.FairLimiter, "release_bytes", release_spy)
    out = ms.restore(tmp_path / "c", like=state)
    assert waits[0] == 8 * 8  # every shard of every leaf went through it
    assert 0 < peak[0] <= 3 * shard and held[0] == 0
    for name, leaf in state.items():
        np.testing.assert_array_equal(np.asarray(out[name]["w"]), np.asarray(leaf["w"]))


def test_a_failing_checksum_is_raised_after_the_read_not_as_a_read_error(
    tmp_path, mesh8, monkeypatch
):
    state = _state(mesh8, n=2)
    ms.save(tmp_path / "c", state)

    def broken(*args):
        raise RuntimeError("checksum program failed")

    # device programs and host sums alike (small leaves, and every leaf on an accelerator)
    monkeypatch.setattr(cs.Checksums, "_sum", broken)
    monkeypatch.setattr(cs, "host_checksum", broken)
    with pytest.raises(RuntimeError, match=r"^checksum program failed$"):
        ms.restore(tmp_path / "c", like=state)


def test_checksums_of_arrays_added_one_by_one_match_checksums(mesh8):
    xs = {
        "a": jax.device_put(
            jnp.arange(4096, dtype=jnp.int32).reshape(64, 64), NamedSharding(mesh8, P("data"))
        ),
        "b": jnp.ones((3, 5), jnp.bfloat16),
        "c": jnp.arange(10, dtype=jnp.uint8),
    }
    want = dict(zip(xs, cs.checksums(list(xs.values()), host_max_elements=100), strict=True))
    batch = cs.Checksums(xs, host_max_elements=100)
    batch.add("c", xs["c"])
    batch.add("a", xs["a"])
    batch.add("not checked", xs["a"])
    got = batch.collect({"b": xs["b"]})  # "b" was never added: summed from the mapping
    assert list(got) == ["a", "b", "c"] and got == want


def test_a_restore_onto_another_layout_keeps_as_many_reads_in_flight(
    tmp_path, monkeypatch, through_orbax
):
    """Orbax counts a read as the stored chunks it touches: a column block of row-chunked
    data touches every row chunk, 4x the buffer it fills here. The cap is scaled by that
    overcount, so the relayout reads three buffers at once, as the saved layout does, where
    the unscaled cap let one read run at a time (3.2x raw Orbax's time at 256 MiB)."""
    mesh8 = ms.make_mesh({"data": 8})
    rows = NamedSharding(mesh8, P("data"))
    state = {
        f"layer{i}": {"w": jax.device_put(jnp.arange(64 * 32.0).reshape(64, 32) + i, rows)}
        for i in range(8)
    }
    ms.save(tmp_path / "c", state)
    mesh24 = ms.make_mesh({"data": 2, "model": 4})
    cols = NamedSharding(mesh24, P(None, "model"))
    buffer = 64 * 8 * 4  # one device's column block
    target = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=cols)
    assert read.largest_read(target, (8, 32)) == 4 * buffer  # all eight row chunks
    monkeypatch.setattr(read, "RESTORE_CONCURRENT_BYTES", 3 * buffer + 1)
    assert read.read_cap([(target, (8, 32))]) == 4 * (3 * buffer + 1) + 1
    assert read.read_cap([(target, (64, 8))]) == 3 * buffer + 2  # chunks = blocks: as is
    reading, peak, grants = [0], [0], [0]
    wait, release = arrival.FairLimiter.wait_for_bytes, arrival.FairLimiter.release_bytes

    async def wait_spy(self, n):
        await wait(self, n)
        grants[0] += 1
        reading[0] += 1
        peak[0] = max(peak[0], reading[0])

    async def release_spy(self, n):
        reading[0] -= 1
        await release(self, n)

    monkeypatch.setattr(arrival.FairLimiter, "wait_for_bytes", wait_spy)
    monkeypatch.setattr(arrival.FairLimiter, "release_bytes", release_spy)
    like = {k: {"w": jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=cols)} for k in state}
    out = ms.restore(tmp_path / "c", like=like)
    assert grants[0] == 8 * 4  # each leaf's four column blocks (replicated over "data")
    assert peak[0] == 3 and reading[0] == 0
    for name, leaf in state.items():
        assert out[name]["w"].sharding == cols
        np.testing.assert_array_equal(np.asarray(out[name]["w"]), np.asarray(leaf["w"]))


def test_the_reads_of_an_array_that_fits_under_the_cap_run_together(
    tmp_path, monkeypatch, through_orbax
):
    """Each column block of row-chunked data touches every row chunk: an array whose reads
    fit under the cap is reserved whole and its four blocks are read at once, so
    TensorStore decodes each chunk once for all four (queued one after another, each block
    decoded all of them again: 2x Orbax's CPU time on zstd chunks)."""
    mesh8 = ms.make_mesh({"data": 8})
    rows = NamedSharding(mesh8, P("data"))
    state = {
        f"layer{i}": {"w": jax.device_put(jnp.arange(64 * 32.0).reshape(64, 32) - i, rows)}
        for i in range(5)
    }
    ms.save(tmp_path / "c", state, compression="zstd")
    cols = NamedSharding(ms.make_mesh({"data": 2, "model": 4}), P(None, "model"))
    buffer = 64 * 8 * 4  # one device's column block; each read counts 4x that (all chunks)
    monkeypatch.setattr(read, "RESTORE_CONCURRENT_BYTES", 4 * buffer)  # one array's blocks
    requests, together, peak = [], [0], [0]
    wait = arrival.FairLimiter.wait_for_bytes
    read_box = arrival.read_box

    async def wait_spy(self, n):
        requests.append(n)
        await wait(self, n)

    async def read_spy(store, bounds):
        together[0] += 1
        peak[0] = max(peak[0], together[0])
        await asyncio.sleep(0)  # every read of the array started before any finishes
        try:
            return await read_box(store, bounds)
        finally:
            together[0] -= 1

    monkeypatch.setattr(arrival.FairLimiter, "wait_for_bytes", wait_spy)
    monkeypatch.setattr(arrival, "read_box", read_spy)
    like = {k: {"w": jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=cols)} for k in state}
    out = ms.restore(tmp_path / "c", like=like)
    assert requests == [4 * 4 * buffer] * 5  # one reservation per array: its four reads
    assert peak[0] == 4 and together[0] == 0  # one array at a time, its blocks together
    for name, leaf in state.items():
        np.testing.assert_array_equal(np.asarray(out[name]["w"]), np.asarray(leaf["w"]))


def test_the_array_metadata_file_is_read_once_per_restore(
    tmp_path, mesh8, monkeypatch, through_orbax
):
    """Orbax reads and parses the array metadata file (every array's entry) at each
    deserialize call: once per restore in its own batch, once per array when each array is
    its own request (a 512-leaf restore took 3.5 s instead of 2.5 s)."""
    from orbax.checkpoint._src.metadata import array_metadata_store

    state = _state(mesh8, n=6)
    ms.save(tmp_path / "c", state)
    reads = []
    real = array_metadata_store.Store._get_array_metadatas

    async def spy(self, path):
        reads.append(path)
        return await real(self, path)

    monkeypatch.setattr(array_metadata_store.Store, "_get_array_metadatas", spy)
    out = ms.restore(tmp_path / "c", like=state)
    assert len(reads) == 1
    for name, leaf in state.items():
        np.testing.assert_array_equal(np.asarray(out[name]["w"]), np.asarray(leaf["w"]))


# ---- read_placed: each shard read once into the buffer its device keeps ---------------------


def _orbax_shard_reads(monkeypatch):
    """A list that grows by one for each shard Orbax's own read path reads."""
    from orbax.checkpoint._src.serialization import serialization

    calls = []
    real = serialization._read_shard

    async def spy(*args, **kwargs):
        calls.append(1)
        return await real(*args, **kwargs)

    monkeypatch.setattr(serialization, "_read_shard", spy)
    return calls


def test_a_restore_reads_each_shard_into_the_buffer_its_device_keeps(
    tmp_path, mesh24, monkeypatch, through_orbax
):
    """``read_placed`` reads every distinct shard once, into a host buffer aligned so that a
    CPU device adopts it instead of copying it again; a shard held by two devices (replicas
    over ``data``) is copied for the second one, so that no two device buffers share memory
    and a donated replica is overwritten alone."""
    cols = NamedSharding(mesh24, P(None, "model"))
    state = {
        f"layer{i}": {"w": jax.device_put(jnp.arange(64 * 32.0).reshape(64, 32) - i, cols)}
        for i in range(3)
    }
    ms.save(tmp_path / "c", state)
    orbax_reads = _orbax_shard_reads(monkeypatch)
    out = ms.restore(
        tmp_path / "c",
        like=jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
        ),
    )
    assert orbax_reads == []  # none went through Orbax's per-shard read
    for name, leaf in state.items():
        x = out[name]["w"]
        assert x.sharding == cols
        np.testing.assert_array_equal(np.asarray(x), np.asarray(leaf["w"]))
        pointers = [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]
        assert len(set(pointers)) == len(pointers) == 8  # replicas do not share buffers
        if jax.default_backend() == "cpu":
            assert all(p % arrival.HOST_ALIGN == 0 for p in pointers)
    x = out["layer0"]["w"]
    twice = jax.jit(lambda a: a * 2, donate_argnums=0)(x)
    np.testing.assert_array_equal(np.asarray(twice), 2 * np.asarray(state["layer0"]["w"]))
    np.testing.assert_array_equal(np.asarray(out["layer1"]["w"]), np.asarray(state["layer1"]["w"]))


def test_a_checkpoint_outside_ocdbt_is_read_by_orbax(tmp_path, mesh8, monkeypatch):
    """What ``read_placed`` does not handle (here a plain Orbax checkpoint without OCDBT)
    is read by Orbax's own path, with the same result."""
    state = _state(mesh8, n=3)
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False)
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(tmp_path / "c", args=ocp.args.PyTreeSave(state))
    orbax_reads = _orbax_shard_reads(monkeypatch)
    like = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    out = ms.restore(tmp_path / "c", like=like)
    assert len(orbax_reads) == 3 * 8
    for name, leaf in state.items():
        np.testing.assert_array_equal(np.asarray(out[name]["w"]), np.asarray(leaf["w"]))
