"""The NNX plug-in: a module's Variables as leaves, their metadata names, in-place updates
and RNG state."""

from __future__ import annotations

import operator
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import MAKERS
from helpers import same_container as same
from modelshard.adapters import split


def test_nnx_metadata_names_and_state_kind():
    from flax import nnx

    with nnx.use_eager_sharding(False):
        lin = nnx.Linear(
            4,
            8,
            kernel_init=nnx.with_partitioning(nnx.initializers.ones, (None, "model")),
            rngs=nnx.Rngs(0),
        )
    info = {i.path: i for i in split(lin).infos}
    assert info["kernel"].names == (None, "model")
    assert info["bias"].names is None
    state = nnx.state(lin)
    assert split(state).kind == "nnx.State"
    assert split(state).paths == ["bias", "kernel"]
    assert same(split(state).rebuild(split(state).arrays), state)


def test_nnx_update_inplace_writes_into_module():
    from flax import nnx

    model = MAKERS["nnx"]()
    flat = split(model)
    out = flat.update_inplace(
        [x + 1 if jnp.issubdtype(x.dtype, jnp.floating) else x for x in flat.arrays]
    )
    assert out is model
    np.testing.assert_array_equal(model.mlp.bias[...], np.ones(32, np.float32))
    assert isinstance(flat.rebuild(flat.arrays, mirror=True), nnx.State)


def test_nnx_rng_state_round_trips():
    model = MAKERS["nnx"]()
    flat = split(model)
    key_paths = [
        p
        for p, x in zip(flat.paths, flat.arrays, strict=True)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    ]
    assert "drop/rngs/key" in key_paths
    rebuilt = flat.rebuild(flat.arrays)
    assert same(rebuilt, model)


def test_nnx_call_write_back_sets_values_and_keeps_flax_trace_check():
    import pytest
    from flax import nnx

    from modelshard._containers.nnx import nnx_call_leaves

    lin = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    call = nnx_call_leaves(lin)
    assert call is not None
    new = [jnp.full(x.shape, 7.0, x.dtype) for x in call.leaves]
    call.write_back(range(len(new)), new)
    for x in jax.tree.leaves(nnx.state(lin)):
        np.testing.assert_array_equal(x, np.full(x.shape, 7.0, np.float32))

    # Written from inside a trace the module was not created in: Flax's own error.
    @jax.jit
    def inside(x):
        call.write_back([0], [x])
        return x

    from flax import errors

    with pytest.raises(errors.TraceContextError, match="different trace level"):
        inside(jnp.zeros(3))


def test_nnx_call_sees_metadata_set_in_place():
    from flax import nnx

    from modelshard._containers.nnx import nnx_call_leaves

    lin = nnx.Linear(2, 8, rngs=nnx.Rngs(0))
    first = nnx_call_leaves(lin)
    assert first is not None and nnx_call_leaves(lin).key is first.key  # the snapshot
    lin.kernel.set_metadata(out_sharding=(None, "model"))  # in place: the same dict
    again = nnx_call_leaves(lin)
    assert again is not None and again.key is not first.key
    assert again.aux[0] == nnx.split(lin)[0] != first.aux[0]  # the GraphDef holds metadata
    other = nnx.Linear(2, 8, rngs=nnx.Rngs(1))  # same structure, the first metadata
    assert nnx_call_leaves(other).aux[0] == first.aux[0]


def test_nnx_snapshot_is_dropped_with_its_module():
    import gc
    import weakref

    from flax import nnx

    from modelshard._containers.nnx import nnx_call_leaves

    lin = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    call = nnx_call_leaves(lin)
    assert call is not None and call.again is not None
    kernel = weakref.ref(lin.kernel[...])
    assert call.again(lin) is not None
    del lin, call
    gc.collect()
    assert kernel() is None  # the snapshot held the module's containers, and their arrays


METADATA_EDITS = {
    "set_metadata, in place": lambda v: v.set_metadata(out_sharding=(None, "model")),
    "a new key, in place": lambda v: v.set_metadata(note="x"),
    "the metadata dict replaced": lambda v: v.set_metadata(
        {**v.get_metadata(), "out_sharding": (None, "model")}
    ),
    "edited through the dict": lambda v: v._var_metadata.__setitem__("note", "x"),
}


@pytest.mark.parametrize("edit", list(METADATA_EDITS))
def test_nnx_call_sees_every_metadata_change_however_made(edit):
    from flax import nnx

    from modelshard._containers.nnx import nnx_call_leaves

    lin = nnx.Linear(2, 8, rngs=nnx.Rngs(0))
    first = nnx_call_leaves(lin)
    assert first is not None
    for _ in range(3):  # unchanged: the snapshot's route, call after call
        assert nnx_call_leaves(lin).key is first.key
    METADATA_EDITS[edit](lin.kernel)
    again = nnx_call_leaves(lin)
    assert again is not None and again.key is not first.key
    assert again.aux[0] == nnx.split(lin)[0] != first.aux[0]
    assert nnx_call_leaves(lin).key is again.key  # and the new metadata is kept to


def test_nnx_metadata_replaced_by_an_equal_dict_keeps_the_route_and_its_edits_are_seen():
    from flax import nnx

    from modelshard._containers.nnx import nnx_call_leaves

    lin = nnx.Linear(2, 8, rngs=nnx.Rngs(0))
    first = nnx_call_leaves(lin)
    assert first is not None
    old = lin.kernel._var_metadata
    lin.kernel.set_metadata(dict(old))  # a new dict, equal: no new plan
    assert lin.kernel._var_metadata is not old
    for _ in range(3):  # quiet calls: the new dict is compared with the watched one
        assert nnx_call_leaves(lin).key is first.key
    lin.kernel._var_metadata["note"] = "x"  # an edit of the new dict is still seen
    assert nnx_call_leaves(lin).key is not first.key


def _watched_net():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self):
            self.ps = nnx.List([nnx.Param(jnp.full(2, float(i))) for i in range(3)])
            self.extra = nnx.data({"w": nnx.Param(jnp.full(2, 10.0))})
            self.pair = nnx.data((nnx.Param(jnp.full(2, 20.0)),))
            self.seq = nnx.data([nnx.Param(jnp.full(2, 40.0))])  # a list: never watched
            self.w = nnx.Param(jnp.full(2, 30.0))

    return Net()


CONTAINER_EDITS = {
    "an attribute set": lambda m, p: setattr(m, "w", p),
    "an nnx.List item set": lambda m, p: m.ps.__setitem__(1, p),
    "a plain dict item set": lambda m, p: m.extra.__setitem__("w", p),
    "a tuple replaced": lambda m, p: setattr(m, "pair", (p,)),
    "a plain list item set": lambda m, p: m.seq.__setitem__(0, p),
}


WATCHING = {
    "watched": {},
    # an interpreter whose attribute stores pass the dict's watchers (CPython 3.13.0)
    "attributes compared": {"watches_attributes": lambda: False},
    # no dict watchers at all (Python 3.11)
    "compared": {"watch": lambda dicts: False},
}


@pytest.mark.parametrize("watching", list(WATCHING))
@pytest.mark.parametrize("edit", list(CONTAINER_EDITS))
def test_nnx_call_sees_a_container_edited_after_quiet_calls(edit, watching, monkeypatch):
    # The dict containers are watched: while nothing changed they are not read. An edit
    # after calls that took that shortcut must still reach the next call's leaves; where
    # attributes cannot be watched they are compared, and without dict watchers every
    # container is compared, as before.
    from flax import nnx

    from modelshard._containers import nnx as nnx_adapter

    for name, fake in WATCHING[watching].items():
        monkeypatch.setattr(nnx_adapter, name, fake)
    m = _watched_net()
    first = nnx_adapter.nnx_call_leaves(m)
    assert first is not None
    for _ in range(3):
        assert nnx_adapter.nnx_call_leaves(m).key is first.key
    snap = nnx_adapter._SNAPSHOTS[id(m)]
    assert snap.watching is (watching != "compared" and sys.version_info >= (3, 12))
    if watching == "attributes compared":  # the module's and the nnx.List's vars()
        assert sum(keys is not None for _, keys, _ in snap.always) == 2
    new = nnx.Param(jnp.full(2, 99.0))
    CONTAINER_EDITS[edit](m, new)
    again = nnx_adapter.nnx_call_leaves(m)
    assert again is not None
    assert any(leaf is new[...] for leaf in again.leaves)
    after = nnx_adapter.nnx_call_leaves(m).leaves  # and kept to after
    assert len(after) == len(again.leaves) and all(map(operator.is_, after, again.leaves))
