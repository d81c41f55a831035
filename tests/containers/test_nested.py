"""Nested containers: registered containers at every depth are split by their own adapter
(paths join the outer and inner canonical paths, metadata reaches the rule engine, the
container comes back as itself)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms
from modelshard.adapters import Adapter, LeafInfo


class Annotated:
    """Arrays plus the logical axis names of each (the custom-container guide's example)."""

    def __init__(self, arrays, names):
        self.arrays, self.names = arrays, names


@dataclasses.dataclass(frozen=True)
class AnnotatedAdapter(Adapter):
    kind: str = "Annotated"

    def flatten(self, obj):
        keys = tuple(sorted(obj.arrays))
        return [obj.arrays[k] for k in keys], (keys, tuple(obj.names[k] for k in keys))

    def unflatten(self, aux, leaves):
        keys, names = aux
        return Annotated(dict(zip(keys, leaves, strict=True)), dict(zip(keys, names, strict=True)))

    def describe(self, obj):
        return [LeafInfo(k, names=obj.names[k], box="Annotated") for k in sorted(obj.arrays)]


LOGICAL = ms.Rules([], logical={"vocab": "model", "embed": None}, strict=False)


def annotated() -> Annotated:
    return Annotated(
        {"embed": jnp.arange(128 * 32.0).reshape(128, 32), "head": jnp.ones((32, 128))},
        {"embed": ("vocab", "embed"), "head": ("embed", "vocab")},
    )


@pytest.fixture
def registered_annotated():
    ms.register_container(Annotated, AnnotatedAdapter())


def test_nested_container_is_split_by_its_adapter(registered_annotated, mesh24) -> None:
    state = {"model": annotated(), "step": jnp.zeros((), jnp.int32)}
    plan = ms.plan(state, LOGICAL, mesh24)
    assert [leaf.path for leaf in plan] == ["model/embed", "model/head", "step"]
    assert plan["model/embed"].spec == P("model", None)
    assert plan["model/head"].spec == P(None, "model")
    assert plan["model/head"].rule == "metadata (Annotated)"


def test_nested_at_two_depths_and_in_lists(registered_annotated, mesh24) -> None:
    state = {"run": {"models": [annotated(), annotated()]}}
    plan = ms.plan(state, LOGICAL, mesh24)
    assert [leaf.path for leaf in plan] == [
        "run/models/0/embed",
        "run/models/0/head",
        "run/models/1/embed",
        "run/models/1/head",
    ]
    assert {plan[p].spec for p in [leaf.path for leaf in plan] if p.endswith("embed")} == {
        P("model", None)
    }


def test_nested_shard_rebuilds_the_container(registered_annotated, mesh24) -> None:
    state = {"model": annotated(), "lr": 0.1}
    out = ms.shard(state, LOGICAL, mesh24)
    assert isinstance(out["model"], Annotated) and out["lr"] == 0.1
    assert out["model"].names == state["model"].names
    assert out["model"].arrays["embed"].sharding.spec == P("model", None)
    np.testing.assert_array_equal(out["model"].arrays["embed"], state["model"].arrays["embed"])


def test_nested_container_inside_equinox_and_optax(registered_annotated, mesh24) -> None:
    import equinox as eqx
    import optax

    class Holder(eqx.Module):
        inner: Annotated
        bias: jax.Array

    holder = Holder(annotated(), jnp.zeros(8))
    plan = ms.plan(holder, LOGICAL, mesh24)
    assert [leaf.path for leaf in plan] == ["inner/embed", "inner/head", "bias"]
    assert plan["inner/embed"].spec == P("model", None)
    # optax states repeat the parameter tree: a registered container inside params is
    # split inside the optimizer moments too.
    params = {"w": jnp.ones((8, 8))}
    opt = optax.adam(1e-3).init(params)
    state = {"opt": opt, "extra": annotated()}
    assert "extra/embed" in [leaf.path for leaf in ms.plan(state, LOGICAL, mesh24)]


def test_nested_container_registered_as_pytree_keeps_its_metadata(mesh24) -> None:
    """A container that is also a JAX pytree (so JAX would open it) is still split by its
    adapter, so the axis names it describes reach the rule engine."""

    class Tagged(Annotated):
        pass

    jax.tree_util.register_pytree_node(
        Tagged,
        lambda t: ([t.arrays[k] for k in sorted(t.arrays)], (tuple(sorted(t.arrays)), t.names)),
        lambda aux, ch: Tagged(dict(zip(aux[0], ch, strict=True)), aux[1]),
    )

    @dataclasses.dataclass(frozen=True)
    class TaggedAdapter(AnnotatedAdapter):
        kind: str = "Tagged"

        def unflatten(self, aux, leaves):
            keys, names = aux
            return Tagged(dict(zip(keys, leaves, strict=True)), dict(zip(keys, names, strict=True)))

    ms.register_container(Tagged, TaggedAdapter())
    t = annotated()
    state = {"model": Tagged(t.arrays, t.names)}
    plan = ms.plan(state, LOGICAL, mesh24)
    assert plan["model/embed"].spec == P("model", None)
    out = ms.shard(state, LOGICAL, mesh24)
    assert type(out["model"]) is Tagged


def test_registering_after_a_plan_takes_effect_at_once(registered_annotated, mesh24) -> None:
    """Which types are nested is remembered per type for speed; a registration made after
    a plan has seen the type applies to the next plan."""

    class Late:  # not an Annotated: unknown to modelshard until registered below
        def __init__(self, arrays, names):
            self.arrays, self.names = arrays, names

    jax.tree_util.register_pytree_node(
        Late,
        lambda t: ([t.arrays[k] for k in sorted(t.arrays)], (tuple(sorted(t.arrays)), t.names)),
        lambda aux, ch: Late(dict(zip(aux[0], ch, strict=True)), aux[1]),
    )
    t = annotated()
    state = {"model": Late(t.arrays, t.names), "other": annotated()}
    before = ms.plan(state, LOGICAL, mesh24)  # JAX opens it: no names, pytree paths
    assert [p for p, _ in before.named()][:2] == ["model/0", "model/1"]

    @dataclasses.dataclass(frozen=True)
    class LateAdapter(AnnotatedAdapter):
        kind: str = "Late"

        def unflatten(self, aux, leaves):
            keys, names = aux
            return Late(dict(zip(keys, leaves, strict=True)), dict(zip(keys, names, strict=True)))

    ms.register_container(Late, LateAdapter())
    after = ms.plan(state, LOGICAL, mesh24)
    assert [p for p, _ in after.named()][:2] == ["model/embed", "model/head"]
    assert after["model/embed"].spec == P("model", None)


def test_nested_through_shard_jit_in_and_out(registered_annotated, mesh24) -> None:
    def step(state):
        m = state["model"]
        arrays = {k: v * 2 for k, v in m.arrays.items()}
        return {"model": Annotated(arrays, m.names)}

    f = ms.shard_jit(step, mesh=mesh24, in_specs=(LOGICAL,))
    state = {"model": annotated()}
    out = f(state)
    assert isinstance(out["model"], Annotated)
    assert out["model"].arrays["embed"].sharding.spec == P("model", None)
    np.testing.assert_array_equal(out["model"].arrays["head"], 2 * state["model"].arrays["head"])
    out2 = f(state)  # the second call reuses the compiled step
    np.testing.assert_array_equal(out2["model"].arrays["embed"], out["model"].arrays["embed"])


def test_nested_save_restore_round_trip(registered_annotated, mesh24, tmp_path) -> None:
    state = {"model": annotated(), "step": jnp.array(3)}
    ms.save(tmp_path / "ck", ms.shard(state, LOGICAL, mesh24))
    back = ms.restore(tmp_path / "ck", like=state, specs=LOGICAL, mesh=mesh24)
    assert isinstance(back["model"], Annotated)
    np.testing.assert_array_equal(back["model"].arrays["embed"], state["model"].arrays["embed"])
    assert back["model"].arrays["embed"].sharding.spec == P("model", None)
