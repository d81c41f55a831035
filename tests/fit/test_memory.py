"""``ms.step_memory`` (``_fit/memory.py``): a compiled step's memory per device from XLA,
split by role so the parts add up to XLA's total, from abstract inputs only."""

from __future__ import annotations

import gc
import math

import jax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import modelshard as ms

MESH = {"data": 4, "model": 2}


def _xla_total(step, state, batch, mesh, state_spec, donate=(0,)):
    """The same program compiled by plain ``jax.jit`` with the plan's shardings."""
    p = ms.plan(state, state_spec, mesh)
    state_in = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, p.shardings
    )
    batch_in = jax.ShapeDtypeStruct(
        batch.shape, batch.dtype, sharding=NamedSharding(mesh, P("data"))
    )
    m = jax.jit(step, donate_argnums=donate).lower(state_in, batch_in).compile().memory_analysis()
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def test_the_parts_add_up_to_xlas_total_and_nothing_is_allocated(decoder):
    mesh = ms.make_mesh(MESH)
    gc.collect()  # arrays earlier tests dropped must not vanish mid-test
    before = {id(a) for a in jax.live_arrays()}
    m = ms.step_memory(
        decoder.step,
        decoder.state,
        decoder.batch,
        mesh=mesh,
        in_specs=(ms.fsdp("data", min_size=0), P("data")),
        donate_argnums=0,
    )
    assert [a for a in jax.live_arrays() if id(a) not in before] == []  # abstract inputs only
    assert sum(m.parts.values()) == m.total == m.argument + m.output + m.temp - m.alias
    assert m.total == _xla_total(
        decoder.step, decoder.state, decoder.batch, mesh, ms.fsdp("data", min_size=0)
    )
    assert m.peak is None and m.platform == "cpu"  # CPU's peak field is not the step's
    # inputs by role, from the plan: parameters and moments sharded 4 ways
    plan = m.plan
    params = sum(plan.bytes_per_device(x) for p, x in plan.named() if "params/" in p)
    opt = sum(plan.bytes_per_device(x) for p, x in plan.named() if "opt_state/" in p)
    assert (m.parts["parameters"], m.parts["optimizer_state"]) == (params, opt)
    assert opt == 2 * params + 4  # mu, nu and adam's count
    assert m.parts["batch"] == 16 * 32 * 4 // 4
    assert m.parts["gradients"] == params and m.parts["temporaries"] > 0
    assert m.parts["layout"] == 0  # CPU: XLA's argument bytes are the plan's
    assert m.parts["outputs"] < 1024  # the state is donated: only the loss and scalars are new
    assert m.compile_seconds > 0 and m.mesh == MESH
    assert plan.memory is m


def test_without_donation_the_new_state_is_counted_as_outputs(dict_decoder, dict_base):
    d, donated = dict_decoder, dict_base
    kw = dict(mesh=ms.make_mesh(MESH), in_specs=(P(), P("data")))
    kept = ms.step_memory(d.step, d.state, d.batch, **kw)
    state_bytes = kept.parts["parameters"] + kept.parts["optimizer_state"] + 4
    assert kept.parts["outputs"] >= state_bytes
    assert donated.parts["outputs"] < 1024 < state_bytes // 4 < kept.total - donated.total
    assert sum(kept.parts.values()) == kept.total


def test_a_shard_jit_step_brings_its_own_specs_and_donation(dict_decoder):
    d = dict_decoder
    mesh = ms.make_mesh(MESH)
    jitted = ms.shard_jit(
        d.step, mesh=mesh, in_specs=(ms.fsdp("data"), P("data")), donate_argnums=0
    )
    m = ms.step_memory(jitted, d.state, d.batch, mesh=mesh)
    assert m.parts["outputs"] < 1024
    assert m.plan["state:params/layers_0/mlp/up/kernel"].spec == P(None, "data")
    assert jitted.cache_size == 0  # measuring compiled a copy, not the user's step
    # no mesh given: the ShardJit's own (no mesh is active here)
    own = ms.step_memory(jitted, d.state, d.batch)
    assert own.mesh == MESH and own.total == m.total
    advice = ms.fit_advice(jitted, d.state, d.batch, budget=m.total)
    assert advice.fits and advice.memory.mesh == MESH


def test_roles_name_leaves_the_default_cannot_tell(dict_decoder):
    d = dict_decoder
    kw = dict(mesh=ms.make_mesh(MESH), in_specs=(P(), P("data")), donate_argnums=0)
    m = ms.step_memory(d.step, d.state, d.batch, roles={"batch": r"^state:params/embed/"}, **kw)
    embed = math.prod((512, 64)) * 4
    assert m.parts["batch"] == embed + 16 * 32 * 4 // 4
    assert dict(m.roles)["state:params/embed/embedding"] == "batch"
    assert dict(m.roles)["state:step"] == "other_inputs"
    with pytest.raises(ms.SpecError) as e:
        ms.step_memory(d.step, d.state, d.batch, roles={"weights": "embed"}, **kw)
    assert str(e.value).splitlines() == [
        "invalid roles:",
        "  roles:weights",
        "    problem: 'weights' is not a role",
        "    hint: roles are 'parameters', 'optimizer_state', 'batch', 'other_inputs'",
    ]


def test_a_mesh_larger_than_the_machine_is_refused_with_the_ways_to_get_one(dict_decoder):
    d = dict_decoder
    with pytest.raises(ms.MeshError) as e:
        ms.step_memory(d.step, d.state, d.batch, mesh={"data": 16}, in_specs=(P(), P("data")))
    assert str(e.value) == (
        "mesh (data=16) needs 16 devices to compile for, this machine has 8; pass "
        "topology='v5e:4x4' (TPU) to compile for a slice it does not have, or simulate CPU "
        "devices: jax.config.update('jax_num_cpu_devices', 16) before JAX starts"
    )


def test_the_plan_table_html_and_json_show_the_step(dict_base):
    m = dict_base
    text = str(m.plan.table())
    assert "step memory per device (XLA)" in text
    assert "gradients (estimated)" in text and "total per device" in text
    html = m.plan.html()
    assert f'class="ms-step-memory" data-total="{m.total}"' in html
    assert f'data-part="parameters" data-bytes="{m.parts["parameters"]}"' in html
    data = m.to_json()
    assert sum(data["parts"].values()) == data["total"]
    assert data["xla"]["alias"] == m.alias and data["platform"] == "cpu"
    assert m.fits(m.total) and not m.fits(m.total - 1)


def test_an_nnx_model_and_its_optimizer_are_split_by_role():
    """NNX: the model and ``nnx.Optimizer`` as two arguments, abstract (``nnx.eval_shape``),
    updated in place by the step."""
    import optax
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.up = nnx.Linear(64, 256, rngs=rngs)
            self.down = nnx.Linear(256, 64, rngs=rngs)

        def __call__(self, x):
            return self.down(jax.nn.gelu(self.up(x)))

    def make():
        model = MLP(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    def step(model, opt, x):
        loss, grads = nnx.value_and_grad(lambda m: ((m(x) - x) ** 2).mean())(model)
        opt.update(model, grads)
        return loss

    model, opt = nnx.eval_shape(make)
    x = jax.ShapeDtypeStruct((16, 64), jax.numpy.float32)
    m = ms.step_memory(
        step,
        model,
        opt,
        x,
        mesh={"data": 8},
        in_specs=(ms.fsdp("data"), P(), P("data")),
        donate_argnums=(0, 1),
    )
    assert sum(m.parts.values()) == m.total
    params = (64 * 256 * 2 // 8 + 256 + 64) * 4  # kernels over 'data', biases whole
    assert m.parts["parameters"] == params
    assert m.parts["optimizer_state"] == 2 * (64 * 256 * 2 + 256 + 64) * 4 + 4 + 4
    roles = dict(m.roles)
    assert roles["model:up/kernel"] == "parameters" and roles["x:"] == "batch"
    assert roles["opt:opt_state/0/mu/up/kernel"] == "optimizer_state"


def test_concrete_arrays_are_read_for_their_shapes_only(dict_decoder, dict_base):
    d = dict_decoder
    state = jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), d.state)
    batch = jax.numpy.zeros(d.batch.shape, d.batch.dtype)
    before = {id(a) for a in jax.live_arrays()}
    with jax.transfer_guard("disallow"):  # no array is moved or copied to be placed
        m = ms.step_memory(
            d.step,
            state,
            batch,
            mesh=ms.make_mesh(MESH),
            in_specs=(P(), P("data")),
            donate_argnums=0,
        )
    assert {id(a) for a in jax.live_arrays()} <= before  # nothing placed
    assert not any(a.is_deleted() for a in jax.tree.leaves((state, batch)))  # nor donated
    assert m.total == dict_base.total  # as from abstract inputs
    assert not batch.is_deleted()


TPU_REFUSAL = (
    "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
    "temporaries (16.03G) exceeds available HBM (15.75G)."
)


def test_a_step_xla_refuses_is_estimated_from_its_message(dict_decoder):
    """TPU's compiler refuses a program larger than the chip before anything runs (no
    memory analysis then): the temporaries its message names and the planned inputs are
    the estimate, said to be one; any other error is raised as it is."""
    from modelshard._fit.memory import measure

    d = dict_decoder
    real = ms.shard_jit(d.step, mesh=ms.make_mesh(MESH), in_specs=(P(), P("data")))

    class Refusing:
        def __init__(self, message):
            self.message = message

        def plan(self, *args):
            return real.plan(*args)

        def lower(self, *args):
            return self

        def compile(self):
            raise RuntimeError(self.message + "\n(more lines of XLA's report)")

    args = (d.state, d.batch)
    m = measure(Refusing(TPU_REFUSAL), args, {}, list(args), [1])
    inputs = m.plan.bytes_per_device()
    assert (m.refused, m.temp, m.argument) == (TPU_REFUSAL, int(16.03 * 2**30), inputs)
    assert m.total == inputs + m.temp == sum(m.parts.values()) and m.peak is None
    assert "estimated: XLA refused it, more than the device holds" in m.summary()
    assert m.to_json()["refused"] == TPU_REFUSAL
    with pytest.raises(RuntimeError, match="INTERNAL: something else"):
        measure(Refusing("INTERNAL: something else"), args, {}, list(args), [1])


def test_no_tpu_slice_is_offered_for_a_mesh_no_slice_matches(dict_decoder):
    d = dict_decoder
    with pytest.raises(ms.MeshError) as e:
        ms.step_memory(d.step, d.state, d.batch, mesh={"data": 12}, in_specs=(P(), P("data")))
    assert str(e.value) == (
        "mesh (data=12) needs 12 devices to compile for, this machine has 8; simulate CPU "
        "devices: jax.config.update('jax_num_cpu_devices', 12) before JAX starts"
    )
