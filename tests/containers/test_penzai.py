"""penzai models: mutable Parameters are split through their values, NamedArray axis names
are logical names, and the layout equals penzai's own ``name_to_name_sharding``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms

pz = pytest.importorskip("penzai.pz")

NAMES = {"embedding": "data", "neurons": "model"}
RULES = ms.Rules([], logical={**NAMES, "features": None})


def model():
    return pz.nn.Sequential(
        [
            pz.nn.Linear.from_config(
                name="up",
                init_base_rng=jax.random.key(0),
                input_axes={"embedding": 8},
                output_axes={"neurons": 16},
            ),
            pz.nn.Linear.from_config(
                name="down",
                init_base_rng=jax.random.key(1),
                input_axes={"neurons": 16},
                output_axes={"features": 8},
            ),
        ]
    )


def test_mutable_parameters_are_array_leaves(mesh24) -> None:
    plan = ms.plan(model(), RULES, mesh24)
    assert [leaf.path for leaf in plan] == ["sublayers/0/weights", "sublayers/1/weights"]
    assert plan["sublayers/0/weights"].shape == (8, 16)
    assert plan["sublayers/0/weights"].rule == "metadata (NamedArray)"


def test_layout_equals_penzais_own(mesh24) -> None:
    from penzai.toolshed import sharding_util

    m = model()
    plan = ms.plan(m, RULES, mesh24)
    frozen = pz.freeze_params(m)
    theirs = sharding_util.name_to_name_sharding(frozen, mesh24, NAMES)
    specs = [
        s.spec
        for s in jax.tree_util.tree_leaves(
            theirs, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
        )
    ]
    ours = [plan[p].spec for p in [leaf.path for leaf in plan]]
    assert [tuple(s) + (None,) * (2 - len(s)) for s in specs] == [
        tuple(s) + (None,) * (2 - len(s)) for s in ours
    ]
    assert ours == [P("data", "model"), P("model", None)]


def test_shard_places_the_parameters_and_keeps_the_model_usable(mesh24) -> None:
    m = model()
    x = pz.nx.wrap(jnp.ones((4, 8))).tag("batch", "embedding")
    before = m(x).unwrap("batch", "features")
    out = ms.shard(m, RULES, mesh24)
    assert type(out) is type(m)
    w = out.sublayers[0].weights
    assert isinstance(w, pz.Parameter) and w.label == m.sublayers[0].weights.label
    assert w.value.data_array.sharding.spec == P("data", "model")
    np.testing.assert_array_equal(w.value.data_array, m.sublayers[0].weights.value.data_array)
    if mesh24.axis_types[0] == jax.sharding.AxisType.Auto:
        # (On an Explicit mesh JAX asks penzai's contraction for an out_sharding.)
        np.testing.assert_allclose(out(x).unwrap("batch", "features"), before, rtol=1e-6)


def test_named_array_views_use_their_data_axes(mesh24) -> None:
    view = pz.nx.wrap(jnp.ones((8, 16))).tag("embedding", "neurons").untag("neurons")
    plan = ms.plan({"v": view}, RULES, mesh24)
    assert plan["v"].spec == P("data", None)


def test_a_penzai_model_saves_and_restores(mesh24, tmp_path) -> None:
    m = ms.shard(model(), RULES, mesh24)
    ms.save(tmp_path / "ck", m)
    back = ms.restore(tmp_path / "ck", like=model(), specs=RULES, mesh=mesh24)
    np.testing.assert_array_equal(
        back.sublayers[1].weights.value.data_array, m.sublayers[1].weights.value.data_array
    )
