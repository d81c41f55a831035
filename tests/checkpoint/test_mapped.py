"""``restore(mapping=)`` through ops (``_checkpoint/mapped.py``): each device reads only the
stored block its leaf needs, ``also`` rules, rearranged leaves sharded as their blocks need."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms

RNG = np.random.default_rng(7)


def test_restore_of_an_orbax_checkpoint_through_ops_and_also(tmp_path: Path) -> None:
    """``restore(mapping=)`` takes the same ops and also rules: each device's block
    computed from its shards, and ``unmap`` back."""
    H, D, E = 4, 8, 16
    state = {
        "q": RNG.standard_normal((H * D, E)).astype(np.float32),
        "norm": RNG.standard_normal(E).astype(np.float32),
        "emb": RNG.standard_normal((32, E)).astype(np.float32),
    }
    ck = ms.save(tmp_path / "ck", state)
    wm = ms.WeightMap(
        [
            ms.MapRule("q", "attn/q", ops=[ms.Rearrange("(h d) e -> h e d", h=H)]),
            ms.MapRule("norm", "norm", ops=[ms.Add(1.0)]),
            ms.MapRule("emb", "embed"),
            ms.MapRule("emb", "head", transpose=(1, 0), also=True),
        ]
    )
    specs = {"attn": {"q": P("model")}, "norm": P(), "embed": P("data"), "head": P(None, "data")}
    out = ms.restore(ck, mapping=wm, specs=specs, mesh=ms.make_mesh({"data": 2, "model": 4}))
    assert out["attn"]["q"].sharding.spec == P("model")
    assert np.asarray(out["attn"]["q"]).tobytes() == (
        state["q"].reshape(H, D, E).transpose(0, 2, 1).copy().tobytes()
    )
    assert np.asarray(out["norm"]).tobytes() == (state["norm"] + np.float32(1)).tobytes()
    assert np.asarray(out["head"]).tobytes() == state["emb"].T.copy().tobytes()
    back = ms.unmap(out, reference=jax.eval_shape(lambda: state), mapping=wm)
    assert back["q"].tobytes() == state["q"].tobytes()
    assert back["emb"].tobytes() == state["emb"].tobytes()
    # float32 + 1 - 1 in float32: rounded, as documented (no wider leaf to hold x + 1)
    assert back["norm"].tobytes() == ((state["norm"] + np.float32(1)) - np.float32(1)).tobytes()


def test_restore_reads_a_rearranged_leaf_sharded_the_way_its_blocks_need(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Heads split off rows (``(h d) e -> h e d``) and sharded over h and e: the stored
    ``[h*d, e]`` leaf is read onto the mesh split the same way, so each device computes
    its block from its own shard; a split of d alone needs it whole."""
    H, D, E = 4, 8, 16
    q = RNG.standard_normal((H * D, E)).astype(np.float32)
    ck = ms.save(tmp_path / "ck", {"q": q})
    wm = ms.WeightMap([ms.MapRule("q", "q", ops=[ms.Rearrange("(h d) e -> h e d", h=H)])])
    mapped = importlib.import_module("modelshard._checkpoint.mapped")
    real = mapped._build_on_devices
    stored_specs: list[Any] = []

    def spy(node: Any, sharding: Any, stored: dict[str, Any]) -> Any:
        stored_specs.append(stored["q"].sharding.spec)
        return real(node, sharding, stored)

    monkeypatch.setattr(mapped, "_build_on_devices", spy)
    mesh = ms.make_mesh({"data": 2, "model": 4})
    want = q.reshape(H, D, E).transpose(0, 2, 1).copy()
    for spec, read_as in (
        (P("model", "data"), P("model", "data")),
        (P(None, "data"), P(None, "data")),
        (P(None, None, "model"), P(None, None)),
    ):
        stored_specs.clear()
        out = ms.restore(ck, mapping=wm, specs={"q": spec}, mesh=mesh)
        assert out["q"].sharding.spec == spec
        assert np.asarray(out["q"]).tobytes() == want.tobytes()
        assert stored_specs == [read_as]
