"""Adapters: every container kind splits into canonical paths and rebuilds exactly."""

from __future__ import annotations

import subprocess
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms
from helpers import MAKERS, make_pytree
from helpers import same_container as same
from modelshard.adapters import LeafInfo, PytreeAdapter, format_path, split


def test_round_trip_every_kind(container):
    flat = split(container)
    rebuilt = flat.rebuild(flat.arrays)
    assert type(rebuilt) is type(container)
    assert same(rebuilt, container)
    assert len(flat.paths) == len(flat.arrays) > 0
    assert not [p for p in flat.paths if p.endswith("/value") or p == "value"]
    assert len(set(flat.paths)) == len(flat.paths)


def test_round_trip_with_new_values_keeps_type(container):
    flat = split(container)
    doubled = [x * 2 if jnp.issubdtype(x.dtype, jnp.floating) else x for x in flat.arrays]
    rebuilt = flat.rebuild(doubled)
    again = split(rebuilt)
    for x, y in zip(again.arrays, doubled, strict=True):
        if jnp.issubdtype(x.dtype, jnp.floating):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


EXPECTED_PATHS = {
    "pytree": ["embed", "layers/0/bias", "layers/0/kernel", "layers/1/bias", "step"],
    "optax": ["0/count", "0/mu/embed", "0/mu/layers/0/kernel", "0/nu/layers/1/bias"],
    "equinox": ["layers/0/weight", "layers/0/bias", "layers/2/weight"],
    "nnx": ["attn/query/kernel", "embed/embedding", "bn/mean", "drop/rngs/key", "mlp/kernel"],
    "linen": [
        "params/Dense_0/kernel",
        "params/ScanLayer_0/Dense_0/kernel",
        "batch_stats/BatchNorm_0/mean",
    ],
}

EXPECTED_KIND = {
    "pytree": "pytree",
    "optax": "pytree",  # optax.chain state is a plain tuple of optax NamedTuples
    "equinox": "equinox.Module",
    "nnx": "nnx.Module",
    "linen": "pytree",
}


def test_canonical_paths(kind, container):
    flat = split(container)
    for path in EXPECTED_PATHS[kind]:
        assert path in flat.paths, (path, flat.paths)
    assert flat.kind == EXPECTED_KIND[kind]


def test_equinox_static_leaves_pass_through():
    mlp = MAKERS["equinox"]()
    flat = split(mlp)
    statics = [x for i, x in enumerate(flat.leaves) if i not in flat.array_index]
    assert mlp.activation in statics
    rebuilt = flat.rebuild([jnp.zeros_like(x) for x in flat.arrays])
    assert rebuilt.activation is mlp.activation
    assert float(jnp.abs(rebuilt.layers[0].weight).sum()) == 0.0


def test_equinox_attention_paths():
    import equinox as eqx

    attn = eqx.nn.MultiheadAttention(2, 8, key=jax.random.key(1))
    flat = split(attn)
    assert flat.paths == [
        "query_proj/weight",
        "key_proj/weight",
        "value_proj/weight",
        "output_proj/weight",
    ]
    assert same(flat.rebuild(flat.arrays), attn)


def test_linen_boxes_give_names_and_no_value_suffix():
    variables = MAKERS["linen"]()
    info = {i.path: i for i in split(variables).infos}
    assert info["params/Dense_0/kernel"] == LeafInfo(
        "params/Dense_0/kernel", ("embed", "mlp"), "LogicallyPartitioned"
    )
    assert info["params/ScanLayer_0/Dense_0/kernel"].names == ("layers", "embed", "mlp")
    assert info["params/Dense_0/bias"].names is None
    # Rebuilding keeps the boxes (same type, same names).
    import flax.linen as nn

    rebuilt = split(variables).rebuild(split(variables).arrays)
    box = rebuilt["params"]["Dense_0"]["kernel"]
    assert isinstance(box, nn.LogicallyPartitioned) and box.names == ("embed", "mlp")


def test_train_state_kind_and_paths():
    import optax
    from flax.training import train_state

    params = {"dense": {"kernel": jnp.ones((4, 8)), "bias": jnp.zeros(8)}}
    ts = train_state.TrainState.create(apply_fn=lambda x: x, params=params, tx=optax.adamw(1e-3))
    flat = split(ts)
    assert flat.kind == "flax.TrainState"
    # TrainState.create sets step to the Python int 0: state all the same, an array leaf.
    assert flat.paths == [
        "step",
        "params/dense/bias",
        "params/dense/kernel",
        "opt_state/0/count",
        "opt_state/0/mu/dense/bias",
        "opt_state/0/mu/dense/kernel",
        "opt_state/0/nu/dense/bias",
        "opt_state/0/nu/dense/kernel",
    ]
    rebuilt = flat.rebuild(flat.arrays)
    assert type(rebuilt) is type(ts) and rebuilt.tx is ts.tx


def test_optax_namedtuple_kind():
    import optax

    state = optax.adam(1e-3).init({"w": jnp.ones(3)})
    assert split(state[0]).kind == "optax"
    assert split(state[0]).paths == ["count", "mu/w", "nu/w"]


class Point(NamedTuple):
    x: jax.Array
    y: jax.Array


def test_plain_pytrees():
    tree = {
        "a": [jnp.ones(2), (jnp.zeros(3), None)],
        "p": Point(jnp.ones(1), jnp.ones(1)),
        "n": None,
        "lr": 0.1,
        "name": "model",
    }
    flat = split(tree)
    assert flat.paths == ["a/0", "a/1/0", "p/x", "p/y"]
    assert same(flat.rebuild(flat.arrays), tree)
    assert split(None).arrays == [] and split(jnp.ones(2)).paths == [""]


def test_describe_matches_jax_key_paths_for_every_kind(container):
    """The fast path walker names leaves exactly as jax's key paths do (minus box artifacts)."""
    flat = split(container)
    if flat.kind == "nnx.Module":
        from flax import nnx

        container = nnx.state(container)
    want = [
        format_path(k, drop_artifacts=True)
        for k, _ in jax.tree_util.tree_flatten_with_path(container)[0]
    ]
    got = [i.path for i in ms.adapters.get_adapter(container).describe(container)]
    assert got == want


# ---- the registry --------------------------------------------------------------------


class Pair:
    def __init__(self, w, b, note="static"):
        self.w, self.b, self.note = w, b, note


def register_pair(**kw):
    ms.register_container(
        Pair,
        flatten=lambda p: {"w": p.w, "b": p.b, "note": p.note},
        unflatten=lambda d: Pair(d["w"], d["b"], d["note"]),
        **kw,
    )


def test_register_user_container_in_a_few_lines():
    register_pair(kind="Pair")
    pair = Pair(jnp.ones((4, 2)), jnp.zeros(2))
    flat = split({"model": pair})
    assert flat.paths == ["model/w", "model/b"]
    assert split(pair).kind == "Pair"
    rebuilt = split(pair).rebuild([jnp.full((4, 2), 3.0), jnp.ones(2)])
    assert isinstance(rebuilt, Pair) and rebuilt.note == "static"
    assert float(rebuilt.w.sum()) == 24.0
    # It became a JAX pytree too, so JAX's tree functions see its children.
    assert jax.tree_util.tree_leaves(pair)[:2] == [pair.w, pair.b]


def test_register_twice_needs_override():
    register_pair()
    with pytest.raises(ms.AdapterError) as e:
        register_pair()
    assert str(e.value) == (
        "tests.containers.test_registry.Pair is already registered as a container; pass override=True to "
        "replace its adapter."
    )
    register_pair(override=True, kind="Pair2")
    assert split(Pair(jnp.ones(1), jnp.ones(1))).kind == "Pair2"


def test_register_errors_are_typed():
    with pytest.raises(ms.AdapterError, match="needs a class"):
        ms.register_container("Pair", PytreeAdapter())  # type: ignore[arg-type]
    with pytest.raises(ms.AdapterError, match="either an adapter or both"):
        ms.register_container(Pair)
    with pytest.raises(ms.AdapterError, match="go together; got only flatten="):
        ms.register_container(Pair, flatten=lambda p: {})
    with pytest.raises(ms.AdapterError, match="is not an Adapter"):
        ms.register_container(Pair, object())  # type: ignore[arg-type]
    with pytest.raises(ms.AdapterError, match="tuple subclass, which JAX already flattens"):
        ms.register_container(Point, flatten=lambda p: {}, unflatten=lambda d: d)
    assert issubclass(ms.AdapterError, TypeError)


def test_register_adapter_for_a_jax_pytree_subclass_wins_over_builtins():
    import equinox as eqx

    class MyMLP(eqx.nn.MLP):
        pass

    mlp = MyMLP(2, 2, 4, 1, key=jax.random.key(0))
    assert split(mlp).kind == "equinox.Module"
    ms.register_container(MyMLP, PytreeAdapter("my-mlp"))
    assert split(mlp).kind == "my-mlp"
    assert (MyMLP, "my-mlp") in ms.adapters.registered()


def test_registry_snapshot_restores():
    with ms.adapters.registry_snapshot():
        register_pair(kind="inside")
        assert split(Pair(jnp.ones(1), jnp.ones(1))).kind == "inside"
    assert split(Pair(jnp.ones(1), jnp.ones(1))).kind == "pytree"


def test_broken_flatten_raises_adapter_error():
    register_pair()
    ms.register_container(Pair, flatten=lambda p: [p.w], unflatten=lambda d: d, override=True)
    with pytest.raises(ms.AdapterError, match="must return a mapping of child name -> child"):
        split(Pair(jnp.ones(1), jnp.ones(1)))


def _python(code: str) -> str:
    """What a fresh interpreter prints running ``code``."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return out.stdout.strip()


def test_import_modelshard_imports_no_optional_dependency():
    code = (
        "import sys, modelshard\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & "
        "{'flax', 'equinox', 'optax', 'orbax', 'tensorstore'})\n"
        "print(heavy)"
    )
    assert _python(code) == "[]"


def test_builtin_adapters_appear_when_their_library_is_imported_later():
    # modelshard is used (and its registry looked up) before Flax is imported: the NNX
    # adapter must still take over once Flax is there.
    code = (
        "import jax.numpy as jnp, modelshard as ms\n"
        "assert ms.adapters.split({'w': jnp.ones(2)}).kind == 'pytree'\n"
        "from flax import nnx\n"
        "m = nnx.Linear(2, 3, rngs=nnx.Rngs(0))\n"
        "flat = ms.adapters.split(m)\n"
        "print(flat.kind, flat.paths)"
    )
    assert _python(code) == "nnx.Module ['bias', 'kernel']"


def test_pytree_fixture_is_plain():
    assert split(make_pytree()).kind == "pytree"


def test_register_plain_dataclass_with_callbacks():
    import dataclasses

    @dataclasses.dataclass
    class Holder:
        w: jax.Array
        tag: str

    ms.register_container(
        Holder, flatten=lambda h: {"w": h.w, "tag": h.tag}, unflatten=lambda d: Holder(**d)
    )
    flat = split(Holder(jnp.ones(3), "x"))
    assert flat.paths == ["w"] and flat.rebuild([jnp.zeros(3)]).tag == "x"


def test_register_jax_dataclass_twice_is_refused():
    import dataclasses

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Registered:
        w: jax.Array

    with pytest.raises(ms.AdapterError, match="is already a JAX pytree"):
        ms.register_container(
            Registered, flatten=lambda h: {"w": h.w}, unflatten=lambda d: Registered(**d)
        )
    ms.register_container(Registered, PytreeAdapter("registered"))
    assert split(Registered(jnp.ones(1))).kind == "registered"


# ---- Python numbers: static leaves, or arrays where the adapter says so ----------------


def _train_state(step=0):
    optax = pytest.importorskip("optax")
    ts = pytest.importorskip("flax.training.train_state")
    return ts.TrainState.create(
        apply_fn=None, params={"w": jnp.ones((8, 2))}, tx=optax.sgd(0.1)
    ).replace(step=step)


def test_train_state_step_is_an_array_leaf_even_as_a_python_int():
    flat = split(_train_state(step=7))
    assert flat.paths[0] == "step" and flat.kind == "flax.TrainState"
    step = flat.arrays[0]
    assert isinstance(step, jax.Array) and step.shape == () and int(step) == 7
    assert step.dtype == jnp.int32 and step.weak_type  # what jax.jit makes of 7


def test_python_numbers_stay_static_in_other_containers():
    eqx = pytest.importorskip("equinox")
    assert split({"w": jnp.ones(2), "lr": 0.1, "n": 3, "flag": True}).paths == ["w"]
    drop = eqx.nn.Dropout(p=0.25)
    assert split(drop).paths == []  # p and inference are configuration


def test_a_registered_container_can_ask_for_numbers_as_arrays():
    class Counter:
        def __init__(self, w, n):
            self.w, self.n = w, n

    ms.register_container(
        Counter,
        ms.adapters.PytreeAdapter("counter", numbers_are_arrays=True),
    )
    jax.tree_util.register_pytree_node(
        Counter, lambda c: ((c.w, c.n), None), lambda _, kids: Counter(*kids)
    )
    flat = split(Counter(jnp.ones(2), 5))
    assert flat.paths == ["0", "1"] and int(flat.arrays[1]) == 5
    assert type(flat.rebuild(flat.arrays).n) is type(flat.arrays[1])


# ---- the capability interface: a user adapter gets what a built-in one gets -------------


class _Weights:
    """A container changed in place: weights in a dict, plus a Python step count."""

    def __init__(self, step=0, **arrays):
        self.arrays, self.step = arrays, step


class _WeightsAdapter(ms.adapters.Adapter):
    kind = "Weights"
    mutable = True
    numbers_are_arrays = True

    def flatten(self, obj):
        keys = tuple(sorted(obj.arrays))
        return [obj.step, *(obj.arrays[k] for k in keys)], keys

    def unflatten(self, aux, leaves):
        return _Weights(leaves[0], **dict(zip(aux, leaves[1:], strict=True)))

    def describe(self, obj):
        return [LeafInfo("step"), *(LeafInfo(k) for k in sorted(obj.arrays))]

    def update(self, obj, aux, leaves):
        obj.step = leaves[0]
        obj.arrays.update(zip(aux, leaves[1:], strict=True))
        return obj


def test_an_adapter_must_subclass_adapter_and_the_error_says_so():
    class DuckAdapter:  # the four members, but not an Adapter
        kind = "duck"

        def flatten(self, obj):
            return [], None

        def unflatten(self, aux, leaves):
            return None

        def describe(self, obj):
            return []

    with pytest.raises(ms.AdapterError, match=r"subclass modelshard\.adapters\.Adapter"):
        ms.register_container(Pair, DuckAdapter())  # type: ignore[arg-type]


def test_capability_defaults_fit_an_immutable_container():
    a = ms.adapters.Adapter()
    assert (a.numbers_are_arrays, a.follows_pytree, a.mutable) == (False, False, False)
    assert ms.adapters.PytreeAdapter().follows_pytree
    assert ms.adapters.NnxModuleAdapter().mutable
    with pytest.raises(NotImplementedError, match=r"Adapter\.flatten"):
        a.flatten(None)


def test_a_user_mutable_adapter_is_written_back_by_shard_and_shard_jit(mesh8, count_compiles):
    ms.register_container(_Weights, _WeightsAdapter())
    w = _Weights(w=jnp.ones((8, 4)))
    rules = ms.Rules([(r"^w$", P("data")), (r".*", P())])
    flat = split(w)
    assert flat.paths == ["step", "w"] and int(flat.arrays[0]) == 0  # numbers_are_arrays
    placed = ms.shard(w, rules, mesh8)
    assert placed is w and w.arrays["w"].sharding.spec == P("data")  # written in place

    @ms.shard_jit(mesh=mesh8, in_specs=(rules,))
    def step(ws):
        ws.arrays["w"] = ws.arrays["w"] * 0.5
        ws.step = ws.step + 1
        return ws.arrays["w"].sum()

    with count_compiles() as compiles:
        for n in (1, 2):
            total = step(w)
            assert float(total) == 32.0 / 2**n and int(w.step) == n
            assert float(np.asarray(w.arrays["w"]).max()) == 0.5**n
            assert w.arrays["w"].sharding.spec == P("data")
    # the Python step became an array: one compile
    assert compiles["jit(step)"] == step.cache_size == 1
