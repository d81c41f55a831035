"""A run switched mid-way from Orbax's own ``CheckpointManager`` to modelshard's, as
docs/guides/long-runs.md shows (``_checkpoint/manager.py``, ``listing.py``, ``items.py``):
Orbax's loop saves a linen ``TrainState`` (params boxed by ``nn.with_logical_partitioning``,
optax adamw) with a JSON item up to step 20; modelshard's manager on the same root resumes
from Orbax's latest step onto another mesh and trains to step 40. The result is the
uninterrupted run's, bit for bit; Orbax's steps are left byte for byte; the CLI and
``ms.restore`` read the root and its steps."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import modelshard as ms
from modelshard.cli import main

nn = pytest.importorskip("flax.linen")
optax = pytest.importorskip("optax")
ocp = pytest.importorskip("orbax.checkpoint")
train_state = pytest.importorskip("flax.training.train_state")

ORBAX_KEPT = (10, 15, 20)
RULES = ms.Rules([], logical={"embed": None, "mlp": "model"}, strict=False)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        x = nn.Dense(16, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
        x = nn.relu(x)
        return nn.Dense(4, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(x)


MODEL = MLP()
BATCH = jax.random.normal(jax.random.key(1), (8, 4))


def create():
    params = MODEL.init(jax.random.key(0), BATCH)["params"]
    return train_state.TrainState.create(apply_fn=MODEL.apply, params=params, tx=optax.adamw(1e-2))


@jax.jit
def train_step(state):
    def loss(params):
        return jnp.mean(MODEL.apply({"params": params}, BATCH) ** 2)

    return state.apply_gradients(grads=jax.grad(loss)(state.params))


def train_step_on(state, mesh):
    """``train_step`` on a state laid out over ``mesh``: the maths on a replicated copy, as
    the uninterrupted run did them (a sum split over devices would round differently),
    the result laid out as the state was."""
    layout = jax.tree.map(lambda a: a.sharding, state)
    out = train_step(jax.device_put(state, NamedSharding(mesh, P())))
    return jax.device_put(out, layout)


def arrays(state) -> list[np.ndarray]:
    """Each leaf's values (a PRNG key's data)."""
    out = []
    for a in jax.tree.leaves(state):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a = jax.random.key_data(a)
        out.append(np.asarray(a))
    return out


def by_path(tree) -> dict[str, np.ndarray]:
    """Each array by its path, a linen box's ``/value`` left out."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    out = {jax.tree_util.keystr(k, simple=True, separator="/"): np.asarray(v) for k, v in flat}
    return {k.removesuffix("/value"): v for k, v in out.items()}


def snapshot(root: Path, steps) -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {}
    for s in steps:
        for folder, _, files in os.walk(root / str(s)):
            out[folder] = None
            for f in files:
                out[os.path.join(folder, f)] = Path(folder, f).read_bytes()
    return out


def orbax_loop(root: Path, until: int):
    """Orbax's CheckpointManager loop, as Orbax's guides write it."""
    options = ocp.CheckpointManagerOptions(save_interval_steps=5, max_to_keep=3)
    state = create()
    with ocp.CheckpointManager(root, options=options) as mngr:
        for step in range(1, until + 1):
            state = train_step(state)
            mngr.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    metadata=ocp.args.JsonSave({"step": step, "data": {"position": step * 8}}),
                ),
            )
        mngr.wait_until_finished()
    return state


@pytest.fixture(scope="module")
def orbax_run(tmp_path_factory):
    """Orbax's loop run once for the module to step 20: its root and its state then."""
    root = tmp_path_factory.mktemp("orbax") / "run"
    return root, orbax_loop(root, 20)


def test_a_run_moves_from_orbaxs_manager_to_ours_mid_way(tmp_path, mesh24, capsys, orbax_run):
    root = tmp_path / "run"
    shutil.copytree(orbax_run[0], root)
    at_20 = orbax_run[1]
    assert sorted(int(n) for n in os.listdir(root)) == list(ORBAX_KEPT)
    orbaxs = snapshot(root, ORBAX_KEPT)

    # the root as Orbax left it: ms.restore says to open it with the manager, the CLI
    # reads its latest step
    with pytest.raises(ms.CheckpointError) as e:
        ms.restore(root)
    assert str(e.value).endswith(
        f"pass a step directory such as {root / '20'}, or restore with "
        "modelshard.CheckpointManager(...).restore()."
    )
    assert main(["inspect", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["step"], doc["items"]) == (
        20,
        {"metadata": {"step": 20, "data": {"position": 160}}},
    )

    # the switch, as docs/guides/long-runs.md writes it
    with ms.CheckpointManager(root, save_interval_steps=5, max_to_keep=3) as mngr:
        start = mngr.latest_step()
        state = mngr.restore(like=create(), specs=RULES, mesh=mesh24)
        position = mngr.items()["metadata"]["data"]["position"]
        for step in range(start + 1, 41):
            state = train_step_on(state, mesh24)
            position += 8
            if mngr.should_save(step):
                mngr.save(
                    step, state, items={"metadata": {"step": step, "data": {"position": position}}}
                )
        mngr.wait_until_finished()
        assert mngr.all_steps() == [10, 15, 20, 30, 35, 40]  # 25 rotated, Orbax's kept
    assert start == 20 and position == 320
    kernel = state.params["Dense_0"]["kernel"]
    assert kernel.value.sharding.spec == P(None, "model") and kernel.names == ("embed", "mlp")

    full = at_20
    for _ in range(20):
        full = train_step(full)
    assert all(np.array_equal(a, b) for a, b in zip(arrays(state), arrays(full), strict=True))
    with ms.CheckpointManager(root) as mngr:
        again = mngr.restore(like=create(), specs=RULES, mesh=mesh24)
        assert mngr.items() == {"metadata": {"step": 40, "data": {"position": 320}}}
        assert mngr.items(20) == {"metadata": {"step": 20, "data": {"position": 160}}}
    assert all(np.array_equal(a, b) for a, b in zip(arrays(again), arrays(full), strict=True))
    assert snapshot(root, ORBAX_KEPT) == orbaxs

    # Orbax's step read directly, and the CLI on the root both wrote into
    direct = ms.restore(root / "20", like=create(), specs=RULES, mesh=mesh24)
    assert all(np.array_equal(a, b) for a, b in zip(arrays(direct), arrays(at_20), strict=True))
    assert main(["steps", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["complete"], doc["latest"]) == ([10, 15, 20, 30, 35, 40], 40)
    assert [(e["step"], e["status"], e["owner"]) for e in doc["steps"]] == [
        *[(s, "complete", "orbax") for s in ORBAX_KEPT],
        *[(s, "complete", "modelshard") for s in (30, 35, 40)],
    ]
    assert main(["inspect", str(root / "20")]) == 0
    out = capsys.readouterr().out
    assert "params/Dense_0/kernel" in out and "items: metadata" in out
    dst = tmp_path / "resharded"
    argv = ["reshard", str(root / "20"), str(dst), "--mesh", "data=8", "--drop-items"]
    assert main(argv) == 0
    capsys.readouterr()
    resharded, expected = by_path(ms.restore(dst)), by_path(at_20)
    assert sorted(resharded) == sorted(expected)
    assert all(np.array_equal(resharded[k], expected[k]) for k in expected)
    assert snapshot(root, ORBAX_KEPT) == orbaxs


@pytest.mark.parametrize("kind", ["pytree", "optax", "linen", "nnx"])
def test_orbaxs_state_of_each_kind_is_restored_onto_a_mesh(tmp_path, kind, mesh24):
    """Each container Orbax's ``StandardSave`` takes (an NNX model as ``nnx.state``, linen
    variables with boxed params), saved by Orbax's manager, restored by ours on a mesh."""
    from helpers import MAKERS

    made = MAKERS[kind]()
    if kind == "nnx":
        from flax import nnx as flax_nnx

        made = flax_nnx.state(made)
    root = tmp_path / "run"
    with ocp.CheckpointManager(root) as orbax_mngr:
        orbax_mngr.save(
            5,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(made), metadata=ocp.args.JsonSave({"kind": kind})
            ),
        )
    with ms.CheckpointManager(root) as mngr:
        out = mngr.restore(like=made, specs=ms.fsdp("model", min_size=0), mesh=mesh24)
        assert mngr.items() == {"metadata": {"kind": kind}}
    assert type(out) is type(made)
    assert all(np.array_equal(a, b) for a, b in zip(arrays(out), arrays(made), strict=True))
    assert any(a.sharding.spec != P() for a in jax.tree.leaves(out) if isinstance(a, jax.Array))


LONG_RUNS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "long-runs.md"


def _doc_block(marker: str) -> str:
    """The one ```python block of the long-runs guide that holds ``marker``."""
    text = LONG_RUNS_PAGE.read_text()
    blocks = re.findall(r"^```python\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL)
    (block,) = [b for b in blocks if marker in b]
    return block


def test_an_unchanged_orbax_job_goes_back_to_our_steps(tmp_path, mesh24):
    """Rolling back, as docs/guides/long-runs.md writes it: our manager's steps of a linen
    ``TrainState`` with boxed params and a JSON ``metadata`` item are read by Orbax's own
    manager, the item with ``ocp.args.JsonRestore()`` unchanged and the state by the
    documented lines, bit-exact; Orbax's job then saves its own steps beside ours, and our
    manager reads the root it left."""
    root = tmp_path / "run"
    state = jax.device_put(create(), NamedSharding(mesh24, P()))
    with ms.CheckpointManager(root, save_interval_steps=5) as mngr:
        for step in range(1, 11):
            state = train_step(state)
            if mngr.should_save(step):
                mngr.save(
                    step,
                    ms.shard(state, RULES, mesh24),
                    items={
                        "metadata": {"step": step, "data": {"position": step * 8}},
                        "rng": jax.random.key(step),  # not Orbax's JSON: items.json only
                    },
                )
    assert sorted(os.listdir(root / "10")) == [
        "_CHECKPOINT_METADATA", "commit_success.txt", "items", "metadata", "modelshard", "state",
    ]  # fmt: skip

    ns: dict = {"jax": jax}
    exec(_doc_block("def put_back_boxes("), ns)
    options = ocp.CheckpointManagerOptions(save_interval_steps=5, max_to_keep=3)
    with ocp.CheckpointManager(root, options=options) as orbax_mngr:
        latest = orbax_mngr.latest_step()
        restored = orbax_mngr.restore(
            latest,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(), metadata=ocp.args.JsonRestore()
            ),
        )
        back = ns["put_back_boxes"](restored.state, jax.eval_shape(create))
        assert restored.metadata == {"step": 10, "data": {"position": 80}}
        assert latest == 10 and type(back) is type(state)
        kernel = back.opt_state[0].mu["Dense_0"]["kernel"]
        assert type(kernel) is nn.LogicallyPartitioned and kernel.names == ("embed", "mlp")
        assert all(np.array_equal(a, b) for a, b in zip(arrays(back), arrays(state), strict=True))
        for step in range(latest + 1, 21):  # Orbax's loop carries on beside our steps
            back = train_step(jax.device_put(back, NamedSharding(mesh24, P())))
            orbax_mngr.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(back),
                    metadata=ocp.args.JsonSave({"step": step, "data": {"position": step * 8}}),
                ),
            )
        orbax_mngr.wait_until_finished()
        assert orbax_mngr.all_steps() == [10, 15, 20]  # Orbax's rules rotated our 5 away

    for _ in range(10):
        state = train_step(state)
    assert all(np.array_equal(a, b) for a, b in zip(arrays(back), arrays(state), strict=True))
    with ms.CheckpointManager(root) as mngr:
        assert mngr.all_steps() == [10, 15, 20]
        assert mngr.items(10)["metadata"] == {"step": 10, "data": {"position": 80}}
        assert jax.random.key_data(mngr.items(10)["rng"]).tolist() == (
            jax.random.key_data(jax.random.key(10)).tolist()
        )
        assert mngr.items() == {"metadata": {"step": 20, "data": {"position": 160}}}


def test_orbaxs_manager_reads_our_step_of_an_nnx_model_as_the_flax_guide_does(tmp_path):
    """The NNX line the guide gives: Orbax's manager restores our step's ``state`` without
    a target and ``nnx.replace_by_pure_dict`` puts it into the abstract ``nnx.State``."""
    from flax import nnx

    def make():
        return nnx.Sequential(
            nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.BatchNorm(8, rngs=nnx.Rngs(0))
        )

    model = make()
    with ms.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(3, model, items={"metadata": {"epoch": 1}})
    with ocp.CheckpointManager(tmp_path / "run") as orbax_mngr:
        restored = orbax_mngr.restore(
            orbax_mngr.latest_step(),
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(), metadata=ocp.args.JsonRestore()
            ),
        )
    graphdef, abstract_state = nnx.split(nnx.eval_shape(make))
    nnx.replace_by_pure_dict(abstract_state, restored.state)
    back = nnx.merge(graphdef, abstract_state)
    assert restored.metadata == {"epoch": 1}
    assert all(
        np.array_equal(a, b)
        for a, b in zip(arrays(nnx.state(back)), arrays(nnx.state(model)), strict=True)
    )
