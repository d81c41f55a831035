"""A rule's operations as the recipe nodes run them (``_weights/recipe.py``): rearrange,
reshape, transpose and RoPE permutations reading only each device's block, and the arithmetic
ops (``Add``, ``Scale``) round-tripping every value they promise."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

import modelshard as ms
from helpers import save_tensors

BF16 = ml_dtypes.bfloat16


RNG = np.random.default_rng(7)


def _recipe(path: Path, wm: ms.WeightMap, leaf: str, **kw: Any) -> str:
    res = ms.load_safetensors(path, mapping=wm, dry_run=True, **kw)
    return res.recipes[leaf].describe()


def test_rearrange_heads_out_of_rows_is_a_reshape_then_a_transpose(tmp_path: Path) -> None:
    H, D, E = 4, 6, 8
    w = RNG.standard_normal((H * D, E)).astype(BF16)
    path = save_tensors(tmp_path / "m.safetensors", {"q.weight": w})
    wm = ms.WeightMap(
        [ms.MapRule(r"q\.weight", "q/w", ops=[ms.Rearrange("(h d) e -> h e d", h="heads")])],
        config={"heads": H},
    )
    assert _recipe(path, wm, "q/w") == f"transpose(0, 2, 1) of reshape({H}, {D}, {E}) of q.weight"
    mesh = ms.make_mesh({"data": 2, "model": 4})
    out = ms.load_safetensors(path, mapping=wm, specs={"q": {"w": P("model")}}, mesh=mesh)
    q = out["q"]["w"]
    assert q.sharding.spec == P("model") and q.shape == (H, E, D)
    assert np.asarray(q).tobytes() == w.reshape(H, D, E).transpose(0, 2, 1).copy().tobytes()
    back = ms.save_safetensors(tmp_path / "b.safetensors", out, reference=path, mapping=wm)
    assert back.read_bytes() == path.read_bytes()


def test_a_pure_permutation_reads_only_each_devices_slice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``"o i -> i o"`` is one transpose node (a device's block is a strided view of the
    stored tensor), the same recipe as ``transpose=(1, 0)`` and ``Transpose((1, 0))``."""
    w = RNG.standard_normal((16, 8)).astype(np.float32)
    path = save_tensors(tmp_path / "m.safetensors", {"w": w})
    forms = [
        ms.MapRule("w", "k", ops=[ms.Rearrange("o i -> i o")]),
        ms.MapRule("w", "k", ops=[ms.Transpose((1, 0))]),
        ms.MapRule("w", "k", transpose=(1, 0)),
    ]
    for rule in forms:
        wm = ms.WeightMap([rule])
        res = ms.load_safetensors(path, mapping=wm, dry_run=True)
        assert res.recipes["k"].describe() == "transpose(1, 0) of w"

    seen: list[tuple[int, int]] = []
    weights_load = importlib.import_module("modelshard._weights.load")
    real = weights_load.build_leaf

    def spy(node: Any, sharding: Any, fetch_for: Any) -> Any:
        def wrapped(cache: dict[Any, np.ndarray]) -> Any:
            fetch = fetch_for(cache)

            def f(key: str, index: tuple[slice, ...]) -> np.ndarray:
                got = fetch(key, index)
                seen.append(got.shape)
                return got

            return f

        return real(node, sharding, wrapped)

    monkeypatch.setattr(weights_load, "build_leaf", spy)
    out = ms.load_safetensors(
        path, mapping=ms.WeightMap(forms[:1]), specs=P(None, "data"), mesh=ms.make_mesh({"data": 8})
    )
    assert np.asarray(out["k"]).tobytes() == w.T.copy().tobytes()
    assert seen and all(s == (2, 8) for s in seen)  # 8 row bands of 2, never all 16 rows


def test_splitting_heads_still_reads_only_each_devices_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma's q: ``(h d) e -> h e d`` sharded over e (FSDP) or h (tensor parallel): a
    device's block of the leaf is one block of the stored tensor, read alone; sharded
    over d it is not, and the whole tensor is read once for the leaf."""
    H, D, E = 4, 6, 16
    w = RNG.standard_normal((H * D, E)).astype(np.float32)
    path = save_tensors(tmp_path / "m.safetensors", {"q": w})
    wm = ms.WeightMap([ms.MapRule("q", "q", ops=[ms.Rearrange("(h d) e -> h e d", h=H)])])
    want = w.reshape(H, D, E).transpose(0, 2, 1)
    seen: list[tuple[int, ...]] = []
    weights_load = importlib.import_module("modelshard._weights.load")
    real = weights_load.build_leaf

    def spy(node: Any, sharding: Any, fetch_for: Any) -> Any:
        def wrapped(cache: dict[Any, np.ndarray]) -> Any:
            fetch = fetch_for(cache)
            return lambda key, index: seen.append(fetch(key, index).shape) or fetch(key, index)

        return real(node, sharding, wrapped)

    monkeypatch.setattr(weights_load, "build_leaf", spy)
    for spec, block in (
        (P(None, "data"), (H * D, 2)),
        (P("data"), (D, E)),
        (P(None, None, "data"), (H * D, E)),  # a range of d across the heads: no one block
    ):
        seen.clear()
        mesh = ms.make_mesh({"data": {P(None, "data"): 8, P("data"): 4}.get(spec, 2)})
        out = ms.load_safetensors(path, mapping=wm, specs=spec, mesh=mesh)
        assert np.asarray(out["q"]).tobytes() == want.copy().tobytes()
        assert seen and set(seen) == {block}, (spec, set(seen))
        if block == (H * D, E):
            assert len(seen) == 1  # the whole tensor, read once for both devices


def test_a_reshape_reads_the_block_of_its_input_that_holds_the_asked_block() -> None:
    """Every block of every reshape below is read right, through one block of the input
    where there is one (checked against NumPy on random blocks)."""
    from modelshard._weights import recipe

    rng = np.random.default_rng(0)
    cases = [
        ((12, 5), (3, 4, 5)),
        ((12, 5), (3, 20)),
        ((2, 3, 4), (6, 4)),
        ((2, 3, 4), (24,)),
        ((4,), (4, 1)),
        ((1, 4), (4,)),
        ((6, 10), (10, 6)),
        ((8, 6), (2, 4, 3, 2)),
    ]
    by_block = 0
    for a, b in cases:
        x = np.arange(int(np.prod(a))).reshape(a)
        node = recipe.Reshaped(recipe.Read("x", a, x.dtype), b)
        for _ in range(100):
            lo = [int(rng.integers(d)) for d in b]
            idx = tuple(
                slice(0, d) if rng.random() < 0.4 else slice(lo_, int(rng.integers(lo_ + 1, d + 1)))
                for lo_, d in zip(lo, b, strict=True)
            )
            reads: list[tuple[slice, ...]] = []
            got = node.read(idx, lambda k, i, reads=reads, x=x: reads.append(i) or x[i])
            assert got.tobytes() == x.reshape(b)[idx].tobytes(), (a, b, idx)
            by_block += reads != [tuple(slice(0, d) for d in a)]
    assert by_block > 250  # most blocks never touch the rest of the input


def test_rope_permutation_both_ways(tmp_path: Path) -> None:
    """Meta's interleaved rotary layout vs Hugging Face's halves:
    ``(h two half) e -> (h half two) e``, and the export undoes it."""
    H, HALF, E = 2, 3, 4
    w = np.arange(H * 2 * HALF * E, dtype=np.float32).reshape(H * 2 * HALF, E)
    path = save_tensors(tmp_path / "m.safetensors", {"wq": w})
    op = ms.Rearrange("(h two half) e -> (h half two) e", h="n_heads", two=2)
    wm = ms.WeightMap([ms.MapRule("wq", "q", ops=[op])], config={"n_heads": H})
    out = ms.load_safetensors(path, mapping=wm)
    want = w.reshape(H, 2, HALF, E).transpose(0, 2, 1, 3).reshape(H * 2 * HALF, E)
    assert np.asarray(out["q"]).tobytes() == want.tobytes()
    back = ms.save_safetensors(tmp_path / "b.safetensors", out, reference=path, mapping=wm)
    assert back.read_bytes() == path.read_bytes()


def test_ops_run_in_order_between_split_and_stack(tmp_path: Path) -> None:
    """Each layer's k and v: a rearrange per stored piece, then stacked; a fused tensor is
    split first, then each part goes through the ops; both export back bit-exact."""
    K, D, E = 2, 4, 6
    t = {f"l{i}.{n}": RNG.standard_normal((K * D, E)).astype(BF16) for i in range(2) for n in "kv"}
    t["qkv"] = RNG.standard_normal((3 * K * D, E)).astype(BF16)
    path = save_tensors(tmp_path / "m.safetensors", t)
    kv = ms.Rearrange("(k d) e -> k e d", k=K)
    wm = ms.WeightMap(
        [
            ms.MapRule(r"l(\d)\.(k|v)", "l{1}/kv", ops=[kv], stack=ms.Stack(2, order=("k", "v"))),
            ms.MapRule(
                "qkv", "fused/{p}", split=ms.Split("p", ("q", "k", "v")), ops=[kv, ms.Scale(2.0)]
            ),
        ]
    )
    out = ms.load_safetensors(path, mapping=wm)
    got = np.asarray(out["l1"]["kv"])
    assert got.shape == (2, K, E, D)
    assert got[1].tobytes() == t["l1.v"].reshape(K, D, E).transpose(0, 2, 1).copy().tobytes()
    part = t["qkv"][K * D : 2 * K * D].astype(np.float32) * 2
    assert (
        np.asarray(out["fused"]["k"], np.float32) == part.reshape(K, D, E).transpose(0, 2, 1)
    ).all()
    back = ms.save_safetensors(tmp_path / "b.safetensors", out, reference=path, mapping=wm)
    assert back.read_bytes() == path.read_bytes()


def _every_bf16() -> np.ndarray:
    """Every finite bfloat16 value (65280 of the 65536 bit patterns)."""
    x = np.arange(1 << 16, dtype=np.uint16).view(BF16)
    return x[np.isfinite(x.astype(np.float32))]


def test_add_round_trips_every_bf16_value_it_promises_through_float32(tmp_path: Path) -> None:
    """``Add(1.0)`` (MaxText's Gemma norm = HF's + 1) on a bf16 file loaded as float32:
    the export gives back every value with ``|x| >= 2**-16`` and +0 bit for bit; only
    values below that lose bits to ``x + 1`` in float32, and -0 comes back as +0."""
    x = _every_bf16()
    path = save_tensors(tmp_path / "m.safetensors", {"norm.weight": x})
    wm = ms.WeightMap([ms.MapRule(r"norm\.weight", "norm/scale", ops=[ms.Add(1.0)])])
    out = ms.load_safetensors(path, mapping=wm, dtype="float32")
    assert np.asarray(out["norm"]["scale"]).tobytes() == (x.astype(np.float32) + 1).tobytes()
    back = load_file(
        str(
            ms.save_safetensors(
                tmp_path / "b.safetensors", out, reference=path, mapping=wm, dtype="float32"
            )
        )
    )["norm.weight"]
    same = back.view(np.uint16) == x.view(np.uint16)
    mag = np.abs(x.astype(np.float32))
    bits = x.view(np.uint16)
    assert same[(mag >= 2.0**-16) | (bits == 0)].all()
    assert back[bits == 0x8000].view(np.uint16).tolist() == [0]  # -0 + 1 - 1 is +0
    assert not same[(mag > 0) & (mag < 2.0**-16)].all()  # the documented exception is real
    assert int((~same).sum()) < 0.45 * x.size


def test_scale_round_trips_every_bf16_value_whose_product_is_finite(tmp_path: Path) -> None:
    x = _every_bf16()
    path = save_tensors(tmp_path / "m.safetensors", {"w": x})
    wm = ms.WeightMap([ms.MapRule("w", "w", ops=[ms.Scale(3.0)])])
    out = ms.load_safetensors(path, mapping=wm, dtype="float32")
    back = ms.unmap(out, reference=path, mapping=wm, dtype="float32")["w"]
    same = back.view(np.uint16) == x.view(np.uint16)
    with np.errstate(over="ignore"):
        finite = np.isfinite(x.astype(np.float32) * np.float32(3.0))
    assert same[finite].all() and not same[~finite].any()


def test_add_in_a_bf16_leaf_rounds_and_the_export_is_the_rounded_difference(
    tmp_path: Path,
) -> None:
    """Without a wider leaf, ``x + 1`` rounds to bf16: computed in float32 and rounded
    once each way (what the export gives is defined, and not the original)."""
    x = _every_bf16()
    path = save_tensors(tmp_path / "m.safetensors", {"w": x})
    wm = ms.WeightMap([ms.MapRule("w", "w", ops=[ms.Add(1.0)])])
    out = ms.load_safetensors(path, mapping=wm)
    y = (x.astype(np.float32) + 1).astype(BF16)
    assert np.asarray(out["w"]).tobytes() == y.tobytes()
    back = ms.unmap(out, reference=path, mapping=wm)["w"]
    assert back.tobytes() == (y.astype(np.float32) - 1).astype(BF16).tobytes()
    assert back.tobytes() != x.tobytes()
