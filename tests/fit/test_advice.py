"""``ms.fit_advice`` (``_fit/advice.py``, ``_fit/candidates.py``): a step that fits gets no
suggestion; one that does not gets changes, each checked by one compile, and the one it
names, applied, compiles within the budget."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms

MESH = {"data": 4, "model": 2}


def _compiled_total(s: ms.Suggestion, mesh) -> int:
    """The suggestion applied by hand, as a user would: its step, specs, donation and
    arguments through ``shard_jit``, compiled again."""
    jitted = ms.shard_jit(s.step, mesh=mesh, in_specs=s.in_specs, donate_argnums=s.donate_argnums)
    m = jitted.lower(*s.args).compile().memory_analysis()
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


@pytest.fixture
def compiles():
    """Backend compiles counted while a test runs."""
    seen: list[str] = []

    def listen(event: str, duration: float, **kw: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(str(kw.get("fun_name")))

    jax.monitoring.register_event_duration_secs_listener(listen)
    yield seen
    jax.monitoring.unregister_event_duration_listener(listen)


def test_a_step_that_fits_gets_no_suggestion(dict_decoder, dict_base, compiles):
    d, m = dict_decoder, dict_base
    kw = dict(mesh=ms.make_mesh(MESH), in_specs=(P(), P("data")), donate_argnums=0)
    compiles.clear()
    advice = ms.fit_advice(d.step, d.state, d.batch, budget=m.total, **kw)
    assert (advice.fits, advice.suggestions, advice.best) == (True, [], None)
    assert advice.memory.total == m.total and advice.compiles == 1 == len(compiles)
    assert "fits the budget" in str(advice)


def test_the_suggestion_applied_compiles_within_the_budget(decoder, compiles, tmp_path):
    d = decoder
    mesh = ms.make_mesh(MESH)
    kw = dict(mesh=mesh, in_specs=(P(), P("data")), donate_argnums=0)
    gc.collect()  # arrays earlier tests dropped must not vanish mid-test
    before = {id(a) for a in jax.live_arrays()}
    budget = ms.step_memory(d.step, d.state, d.batch, **kw).total - 1
    compiles.clear()
    advice = ms.fit_advice(d.step, d.state, d.batch, budget=budget, first=True, **kw)
    assert [a for a in jax.live_arrays() if id(a) not in before] == []  # abstract inputs only
    assert not advice.fits and advice.best is advice.suggestions[-1]
    best = advice.best
    # the least invasive change comes first: the optimizer state sharded over 'data'
    assert (best.kind, best.fits) == ("shard_optimizer", True)
    assert best.description == "shard the optimizer state over 'data' (ZeRO-1)"
    assert best.memory.total <= budget and best.saves == advice.memory.total - best.memory.total
    assert advice.compiles == 2 == len(compiles)  # the step, then one per candidate
    assert _compiled_total(best, mesh) == best.memory.total <= budget
    assert advice.compile_seconds > 0
    # the rules, pasted or saved as a rules file, place the state as checked
    (name,) = best.rules
    (tmp_path / "rules.toml").write_text(best.toml())
    rules = ms.load_rules(tmp_path / "rules.toml")
    placed = ms.plan(d.state, rules, mesh)
    assert [leaf.spec for leaf in placed] == [leaf.spec for leaf in best.memory.plan.args[0].leaves]
    assert f"{name}_rules = ms.Rules([" in best.code
    assert best.memory.plan[f"{name}:params/embed/embedding"].spec == P()
    mu = best.memory.plan[f"{name}:opt_state/0/mu/embed/embedding"]
    assert mu.spec == P("data")
    assert "smallest change that fits: shard the optimizer state over 'data'" in str(advice)


def test_the_batch_is_halved_to_the_largest_that_fits(dict_decoder):
    d = dict_decoder
    kw = dict(mesh=ms.make_mesh(MESH), in_specs=(P(), P("data")), donate_argnums=0)
    small = ms.step_memory(d.step, d.state, jax.ShapeDtypeStruct((8, 32), jnp.int32), **kw)
    advice = ms.fit_advice(d.step, d.state, d.batch, budget=small.total, kinds=("batch",), **kw)
    best = advice.best
    assert best is not None and best.kind == "batch"
    assert best.description == "batch per device 4 -> 2 (global 16 -> 8)"
    assert best.code == "a global batch of 8 (2 per device)"
    assert best.memory.total == small.total and best.args[1].shape == (8, 32)
    assert [s.description for s in advice.suggestions] == [best.description]


def test_changes_combine_when_none_fits_alone(dict_decoder):
    d = dict_decoder
    mesh = ms.make_mesh(MESH)
    kw = dict(mesh=mesh, in_specs=(P(), P("data")), donate_argnums=0)
    # FSDP over 'model' alone, the better of the two axes, is one byte too many
    model = ms.step_memory(
        d.step, d.state, d.batch, **{**kw, "in_specs": (ms.fsdp("model"), P("data"))}
    )
    budget = model.total - 1
    advice = ms.fit_advice(d.step, d.state, d.batch, budget=budget, kinds=("fsdp",), **kw)
    singles = advice.suggestions[:2]
    assert [s.kind for s in singles] == ["fsdp", "fsdp"]
    assert not any(s.fits for s in singles) and all(s.saves > 0 for s in singles)
    best = advice.best
    assert best is not None and best.kind == "fsdp+fsdp" and best.fits
    assert _compiled_total(best, mesh) == best.memory.total <= budget
    up = best.memory.plan["state:params/layers_0/mlp/up/kernel"].spec
    assert up == P(None, ("model", "data"))  # both axes, largest saving first


def test_the_batch_is_cut_only_when_no_combination_keeps_it(dict_decoder, compiles):
    d = dict_decoder
    kw = dict(mesh=ms.make_mesh(MESH), in_specs=(P(), P("data")), donate_argnums=0)
    batch = jax.ShapeDtypeStruct((64, 32), jnp.int32)  # activations dominate
    model = ms.step_memory(
        d.step, d.state, batch, **{**kw, "in_specs": (ms.fsdp("model"), P("data"))}
    )
    halved = ms.step_memory(d.step, d.state, jax.ShapeDtypeStruct((32, 32), jnp.int32), **kw)
    budget = model.total - 1
    assert halved.total <= budget  # half the batch alone would fit too
    compiles.clear()
    advice = ms.fit_advice(d.step, d.state, batch, budget=budget, kinds=("fsdp", "batch"), **kw)
    assert [s.kind for s in advice.suggestions] == ["fsdp", "fsdp", "fsdp+fsdp"]
    best = advice.best
    assert best is not None and best.fits and best.args[1].shape == (64, 32)
    assert advice.compiles == len(compiles) == 4  # the step, then one per candidate
    # with nothing else that saves, the batch is cut
    only = ms.fit_advice(d.step, d.state, batch, budget=budget, kinds=("batch",), **kw)
    assert only.best is not None and only.best.description == (
        "batch per device 16 -> 8 (global 64 -> 32)"
    )


def test_tensor_parallel_rules_for_known_names_and_narrower_moments(dict_decoder, dict_base):
    d, base = dict_decoder, dict_base
    kw = dict(mesh=ms.make_mesh(MESH), in_specs=(P(), P("data")), donate_argnums=0)
    advice = ms.fit_advice(
        d.step,
        d.state,
        d.batch,
        budget=base.total - 1,
        kinds=("moments_dtype", "tensor_parallel"),
        **kw,
    )
    moments, tp = advice.suggestions
    assert moments.code == "optax.adamw(learning_rate, mu_dtype=jnp.bfloat16)"
    assert moments.saves > 0
    mu = moments.args[0]["opt_state"][0].mu["embed"]["embedding"]
    assert mu.dtype == jnp.bfloat16  # the first moments only, as optax's mu_dtype keeps them
    assert moments.args[0]["opt_state"][0].nu["embed"]["embedding"].dtype == jnp.float32
    # tensor parallelism over 'model' (the batch's axis is 'data'): columns, rows, vocab
    assert tp.description == "tensor-parallel rules over 'model' for known parameter names"
    plan = tp.memory.plan
    assert plan["state:params/layers_0/attn/q/kernel"].spec == P(None, "model")
    assert plan["state:params/layers_0/attn/o/kernel"].spec == P("model")
    assert plan["state:params/layers_0/mlp/down/kernel"].spec == P("model")
    assert plan["state:params/embed/embedding"].spec == P("model")
    assert plan["state:opt_state/0/mu/layers_1/mlp/up/kernel"].spec == P(None, "model")
    assert plan["state:params/layers_0/norm/scale"].spec == P()
    assert tp.saves > moments.saves and advice.best is moments  # least invasive first


def test_no_tensor_parallel_rules_over_the_batchs_axis(dict_decoder):
    d = dict_decoder
    kw = dict(mesh=ms.make_mesh({"data": 8}), in_specs=(P(), P("data")), donate_argnums=0)
    base = ms.step_memory(d.step, d.state, d.batch, **kw)
    advice = ms.fit_advice(
        d.step, d.state, d.batch, budget=base.total - 1, kinds=("tensor_parallel",), **kw
    )
    assert advice.suggestions == [] and advice.best is None and advice.compiles == 1


def test_bad_kinds_and_budgets_are_refused(dict_decoder):
    d = dict_decoder
    kw = dict(mesh=ms.make_mesh(MESH), in_specs=(P(), P("data")))
    with pytest.raises(ms.SpecError) as e:
        ms.fit_advice(d.step, d.state, d.batch, budget="1GiB", kinds=("zero3",), **kw)
    assert str(e.value).splitlines() == [
        "invalid kinds:",
        "  kinds:zero3",
        "    problem: 'zero3' is not a kind of change",
        "    hint: kinds are 'donate', 'shard_optimizer', 'moments_dtype', 'fsdp', "
        "'tensor_parallel', 'remat', 'batch'",
    ]
    with pytest.raises(ms.SpecError, match="'lots' is not a size"):
        ms.fit_advice(d.step, d.state, d.batch, budget="lots", **kw)


@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
def test_auto_and_explicit_meshes(axis_types):
    """On an Explicit mesh a change the model code cannot take (a product whose operands
    are both split over 'data') is reported with JAX's error, not raised."""
    import optax

    tx = optax.sgd(0.1, momentum=0.9)

    def loss(p, x):
        return ((jnp.tanh(x @ p["up"]) @ p["down"] - x) ** 2).mean()

    def step(state, x):
        grads = jax.grad(loss)(state["params"], x)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}

    def init():
        params = {"up": jnp.zeros((64, 256)), "down": jnp.zeros((256, 64))}
        return {"params": params, "opt_state": tx.init(params)}

    state, x = jax.eval_shape(init), jax.ShapeDtypeStruct((16, 64), jnp.float32)
    kw = dict(
        mesh=ms.make_mesh({"data": 8}, axis_types=axis_types),
        in_specs=(P(), P("data")),
        donate_argnums=0,
    )
    m = ms.step_memory(step, state, x, **kw)
    assert sum(m.parts.values()) == m.total
    assert m.parts["parameters"] == m.parts["optimizer_state"] == 2 * 64 * 256 * 4
    advice = ms.fit_advice(
        step, state, x, budget=m.total - 1, kinds=("shard_optimizer", "fsdp"), **kw
    )
    zero1, fsdp = advice.suggestions
    assert advice.best is zero1 and zero1.fits
    if axis_types == "auto":
        assert fsdp.fits and fsdp.error is None and advice.compiles == 3
    else:
        assert (fsdp.memory, fsdp.fits) == (None, False)
        assert fsdp.error.startswith("ShardingTypeError: dot_general operation with inputs")
        assert advice.compiles == 2  # a candidate that does not compile is not counted
        assert "(FSDP): not compiled (ShardingTypeError:" in str(advice)
