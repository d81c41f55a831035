"""Logical rules in layers: a library's declared names and defaults, the user's overrides
on top, nested contexts that merge, names checked on entry; and Flax's own logical API
(``nn.with_logical_constraint``, NNX metadata) seeing ``ms.logical_rules``."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import modelshard as ms
import tinylm
from tinylm import nnx_model

SDS = jax.ShapeDtypeStruct
QKV = {"q": SDS((16, 4, 4), jnp.float32), "up": SDS((16, 32), jnp.float32)}
NAMED = ms.Rules([("q", P("embed", "heads", "kv")), ("up", P("embed", "mlp"))])


def specs(mesh) -> dict[str, P]:
    return {leaf.path: leaf.spec for leaf in ms.plan(QKV, NAMED, mesh)}


def test_defaults_then_overrides_and_nested_contexts_merge(mesh24):
    with ms.logical_rules(tinylm.AXES) as rules:
        assert specs(mesh24) == {"q": P(None, "model", None), "up": P(None, "model")}
        with ms.logical_rules({"heads": None}) as inner:  # one entry overridden
            assert specs(mesh24) == {"q": P(None, None, None), "up": P(None, "model")}
            assert inner.public == dict(rules.public, heads=None)
            assert inner.label("heads") == "rules['heads']"
            assert inner.label("mlp") == "tinylm defaults['mlp']"
        with ms.logical_rules(None, {"embed": "data", "heads": None, "kv": None, "mlp": None}):
            # None drops the layers below: tinylm's declared names are no longer checked
            assert specs(mesh24) == {"q": P("data", None, None), "up": P("data", None)}
        with (
            ms.logical_rules(None),
            pytest.raises(ms.SpecError, match="axis 'embed' \\(dimension 0\\)"),
        ):
            specs(mesh24)
    # user's overrides in one call: the same layering
    with ms.logical_rules(tinylm.AXES, [("heads", None), ("mlp", "data")]) as merged:
        assert specs(mesh24) == {"q": P(None, None, None), "up": P(None, "data")}
        assert merged.ordered  # Flax-style pairs on top make the whole list ordered


def test_equal_rules_entered_again_reuse_the_compiled_step(mesh24, count_compiles):
    step = ms.shard_jit(lambda x: x * 2, mesh=mesh24, in_specs=(P("batch"),))
    with count_compiles() as n:
        for _ in range(3):
            with ms.logical_rules(tinylm.AXES):
                step(jnp.ones((8, 4)))
    assert n["jit(<lambda>)"] == step.cache_size == 1


def test_a_function_jitted_once_follows_the_rules_of_each_call(count_compiles):
    """jax.jit keys on the rules in force, as on the mesh: one function jitted once,
    called under no rules, two users' rules and the first again, constrains by each
    (ms.constrain and Flax's nn.with_logical_constraint alike); equal rules share a trace."""
    mesh = ms.make_mesh({"data": 2, "model": 4})  # Auto: Flax's constraint asserts on Explicit

    def model(x):
        x = nn.with_logical_constraint(x * 2, ("batch", "embed"))
        return ms.constrain(x + 1, P("batch", "embed")), x

    step = jax.jit(model)
    x = jnp.ones((8, 16))
    tp, fsdp = {"batch": "data", "embed": "model"}, {"batch": ("data", "model"), "embed": None}
    got = []
    with jax.set_mesh(mesh), count_compiles() as n:
        got.append(step(x))
        for rules in (tp, fsdp, dict(tp)):
            with ms.logical_rules(rules):
                got.append(step(x))
    specs = [(a.sharding.spec, b.sharding.spec) for a, b in got]
    assert specs == [
        (P(), P()),
        (P("data", "model"), P("data", "model")),
        (P(("data", "model")), P(("data", "model"))),
        (P("data", "model"), P("data", "model")),
    ]
    assert n["jit(model)"] == 3


def test_a_declaration_is_hashable_and_compares_by_its_entries():
    again = ms.LogicalAxes("tinylm", tinylm.AXES.names, dict(tinylm.AXES.defaults))
    assert again == tinylm.AXES and hash(again) == hash(tinylm.AXES)
    assert ms.LogicalAxes("tinylm", tinylm.AXES.names, {"heads": None}) != tinylm.AXES


def test_a_misspelt_name_gets_did_you_mean_on_entry():
    with pytest.raises(ms.SpecError) as e, ms.logical_rules(tinylm.AXES, {"hedas": None}):
        pass
    assert str(e.value).splitlines() == [
        "logical rules that do not fit the names tinylm declares:",
        "  logical_rules:rules['hedas']",
        "    problem: 'hedas' is not a logical name tinylm declares (declared: batch, seq, "
        "embed, heads, kv, mlp, vocab)",
        "    hint: did you mean 'heads'? (or remove the entry, or declare 'hedas' in a "
        "ms.LogicalAxes)",
    ]
    [p] = e.value.problems
    assert (p.logical_name, p.logical_rule) == ("hedas", "rules['hedas']")
    # the same check when the library's defaults are an enclosing context
    with (
        ms.logical_rules(tinylm.AXES),
        pytest.raises(ms.SpecError, match="did you mean 'heads'"),
        ms.logical_rules({"hedas": None}),
    ):
        pass


def test_a_declared_name_nobody_maps_is_reported_before_any_trace():
    """'seq' names only activations: it is still checked on entry, not at the first trace."""
    axes = ms.LogicalAxes("lib", names=("batch", "seq", "embed"), defaults={"batch": "data"})
    traced = []

    def model(x):
        traced.append(1)
        return ms.constrain(x, P("batch", "seq"))

    with pytest.raises(ms.SpecError) as e, ms.logical_rules(axes, {"embed": None}):
        jax.jit(model)(jnp.ones((8, 4)))
    assert traced == []
    assert str(e.value).splitlines() == [
        "logical rules that do not fit the names lib declares:",
        "  logical_rules:names['seq']",
        "    problem: lib declares the logical name 'seq' without a default, and no rule maps it",
        "    hint: add 'seq': <mesh axes or None> to your rules (a mesh axis, a tuple of axes, "
        "or None to replicate)",
    ]


def test_a_bad_declaration_lists_every_problem():
    with pytest.raises(ms.SpecError) as e:
        ms.LogicalAxes("lib", names=("heads", 3), defaults={"haeds": "model", "heads": 4})
    assert str(e.value).splitlines() == [
        "invalid LogicalAxes for lib:",
        "  LogicalAxes:names[1]",
        "    problem: 3 is not a logical name (a string)",
        "    hint: name each logical axis with a string, such as 'embed'",
        "  LogicalAxes:defaults['haeds']",
        "    problem: 'haeds' has a default but is not among the declared names",
        "    hint: did you mean 'heads'? (or add 'haeds' to names)",
        "  LogicalAxes:lib defaults['heads']",
        "    problem: 'heads' -> 4 is not a logical name -> mesh axes mapping",
        "    hint: map to a mesh axis name, a list of names, or None (replicate)",
    ]


# ---- Flax's own logical API ------------------------------------------------------------


def _two_flax_constraints(x):
    x = nn.with_logical_constraint(x * 2, ("batch", "embed"))
    return nn.with_logical_constraint(x + 1, ("batch", None))


def count_constraints(f, x) -> int:
    # a new function each time: jax.jit's trace cache does not key on Flax's context
    return jax.jit(lambda v: f(v)).lower(x).as_text().count("sharding_constraint")


def test_flax_with_logical_constraint_honours_the_context():
    """Counted in the lowered program: 2 constraints under ms.logical_rules (Flax adds 2
    under its own nn.logical_axis_rules), none outside or with flax=False. Auto mesh:
    Flax constrains with with_sharding_constraint, an assertion on Explicit axes."""
    mesh = ms.make_mesh({"data": 2, "model": 4})
    x = jnp.ones((8, 16))
    with jax.set_mesh(mesh):
        assert count_constraints(_two_flax_constraints, x) == 0
        with nn.logical_axis_rules([("batch", "data"), ("embed", "model")]):
            assert count_constraints(_two_flax_constraints, x) == 2
        with ms.logical_rules({"batch": "data", "embed": "model"}):
            assert count_constraints(_two_flax_constraints, x) == 2
            y = jax.jit(lambda v: _two_flax_constraints(v))(x)
        with ms.logical_rules({"batch": "data", "embed": "model"}, flax=False):
            assert count_constraints(_two_flax_constraints, x) == 0
    assert y.sharding.spec == P("data")
    assert nn.get_logical_axis_rules() == ()  # Flax's context restored on exit


@pytest.mark.parametrize(
    "user",
    [
        {"embed": "data", "heads": None},  # a mapping over the defaults
        [("batch", "data"), ("embed", "data"), ("embed", "model"), ("heads", None)],  # pairs
    ],
    ids=["mapping", "pairs"],
)
def test_flax_rules_are_what_flax_logical_to_mesh_axes_takes(user, mesh24):
    """The yielded rules' flax_rules go to Flax's own functions as they are, whether the
    layers were mappings or pairs, and Flax places every leaf where modelshard does."""
    names = {"q": ("embed", "heads", "kv"), "up": ("embed", "mlp")}
    with ms.logical_rules(tinylm.AXES, user) as rules:
        assert rules is not None
        flax_rules = rules.flax_rules
        placed = specs(mesh24)
        assert flax_rules == nn.get_logical_axis_rules()  # what Flax's context holds
    assert all(isinstance(pair, tuple) and len(pair) == 2 for pair in flax_rules)
    for path, logical in names.items():
        flax_spec = list(nn.logical_to_mesh_axes(logical, flax_rules))
        assert P(*flax_spec) == placed[path], path


def test_nnx_metadata_sees_the_context(mesh24):
    """nnx.get_partition_spec reads the same layered rules as modelshard's plan."""
    model = nnx_model.TinyLM(rngs=nnx.Rngs(0))
    with ms.logical_rules(tinylm.AXES, {"embed": "data"}):
        flax_specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
        plan = ms.plan(model, ms.Rules([], strict=False), mesh24)
    flat = dict(nnx.to_flat_state(flax_specs))
    checked = 0
    for leaf in plan:
        want = flat[tuple(int(k) if k.isdigit() else k for k in leaf.path.split("/"))]
        want = want.get_value() if hasattr(want, "get_value") else want
        assert tuple(leaf.spec) == tuple(want) + (None,) * (len(leaf.spec) - len(want)), leaf.path
        checked += 1
    assert checked == 16  # 14 named kernels, 2 norm scales (replicated, P())


class _EagerMLP(nnx.Module):
    """NNX parameters placed as they are created (eager sharding), by logical names."""

    def __init__(self, rngs: nnx.Rngs):
        def init(*names):
            return nnx.with_partitioning(
                nnx.initializers.lecun_normal(), names, eager_sharding=True
            )

        self.up = nnx.Linear(16, 32, use_bias=False, kernel_init=init("embed", "mlp"), rngs=rngs)
        self.down = nnx.Linear(32, 16, use_bias=False, kernel_init=init("mlp", "embed"), rngs=rngs)


def test_nnx_eager_sharding_places_by_the_layered_rules(mesh24):
    """NNX places eagerly-sharded parameters through Flax's context, which ms.logical_rules
    sets to the layered rules: eagerly and under nnx.jit, on Auto and Explicit meshes."""
    axes = ms.LogicalAxes("lib", names=("embed", "mlp"), defaults={"embed": None, "mlp": "model"})
    with jax.set_mesh(mesh24), ms.logical_rules(axes, {"embed": "data"}):
        eager = _EagerMLP(nnx.Rngs(0))
        jitted = nnx.jit(lambda: _EagerMLP(nnx.Rngs(0)))()
    for model in (eager, jitted):
        assert model.up.kernel.get_value().sharding.spec == P("data", "model")
        assert model.down.kernel.get_value().sharding.spec == P("model", "data")
    with jax.set_mesh(mesh24), pytest.raises(ValueError, match="embed of P\\('embed', 'mlp'\\)"):
        _EagerMLP(nnx.Rngs(0))  # without rules NNX takes the names for mesh axes
