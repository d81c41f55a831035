"""A rule's ordered operations (``ops``: ``Rearrange``, ``Transpose``, ``Reshape``, ``Add``,
``Scale``) forwards and backwards, what their arithmetic round-trips exactly, their TOML
form and validation; ``also`` rules (tied embeddings into a head of its own) and their
export; keep patterns and abstract ``like`` on export and import."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

import modelshard as ms
from modelshard._weights import parse_weight_map

ROOT = Path(__file__).parents[2]
BF16 = ml_dtypes.bfloat16
RNG = np.random.default_rng(7)


def _save(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def _llama_example() -> Any:
    """examples/llama_weights.py (its NNX Llama, checkpoint writer and NumPy reference)."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        spec = importlib.util.spec_from_file_location(
            "llama_weights", ROOT / "examples" / "llama_weights.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "examples"))
    return module


def _recipe(path: Path, wm: ms.WeightMap, leaf: str, **kw: Any) -> str:
    res = ms.load_safetensors(path, mapping=wm, dry_run=True, **kw)
    return res.recipes[leaf].describe()


# ---- layout operations ------------------------------------------------------------------


def test_rearrange_heads_out_of_rows_is_a_reshape_then_a_transpose(tmp_path: Path) -> None:
    H, D, E = 4, 6, 8
    w = RNG.standard_normal((H * D, E)).astype(BF16)
    path = _save(tmp_path / "m.safetensors", {"q.weight": w})
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
    path = _save(tmp_path / "m.safetensors", {"w": w})
    forms = [
        ms.MapRule("w", "k", ops=[ms.Rearrange("o i -> i o")]),
        ms.MapRule("w", "k", ops=[ms.Transpose((1, 0))]),
        ms.MapRule("w", "k", transpose=(1, 0)),
    ]
    for rule in forms:
        wm = ms.WeightMap([rule])
        res = ms.load_safetensors(path, mapping=wm, dry_run=True)
        assert res.recipes["k"].describe() == "transpose(1, 0) of w"
        assert res.recipes["k"].sliceable

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
    path = _save(tmp_path / "m.safetensors", {"q": w})
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
    path = _save(tmp_path / "m.safetensors", {"wq": w})
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
    path = _save(tmp_path / "m.safetensors", t)
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


# ---- value operations: what round-trips exactly ----------------------------------------


def _every_bf16() -> np.ndarray:
    """Every finite bfloat16 value (65280 of the 65536 bit patterns)."""
    x = np.arange(1 << 16, dtype=np.uint16).view(BF16)
    return x[np.isfinite(x.astype(np.float32))]


def test_add_round_trips_every_bf16_value_it_promises_through_float32(tmp_path: Path) -> None:
    """``Add(1.0)`` (MaxText's Gemma norm = HF's + 1) on a bf16 file loaded as float32:
    the export gives back every value with ``|x| >= 2**-16`` and +0 bit for bit; only
    values below that lose bits to ``x + 1`` in float32, and -0 comes back as +0."""
    x = _every_bf16()
    path = _save(tmp_path / "m.safetensors", {"norm.weight": x})
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
    path = _save(tmp_path / "m.safetensors", {"w": x})
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
    path = _save(tmp_path / "m.safetensors", {"w": x})
    wm = ms.WeightMap([ms.MapRule("w", "w", ops=[ms.Add(1.0)])])
    out = ms.load_safetensors(path, mapping=wm)
    y = (x.astype(np.float32) + 1).astype(BF16)
    assert np.asarray(out["w"]).tobytes() == y.tobytes()
    back = ms.unmap(out, reference=path, mapping=wm)["w"]
    assert back.tobytes() == (y.astype(np.float32) - 1).astype(BF16).tobytes()
    assert back.tobytes() != x.tobytes()


# ---- validation -----------------------------------------------------------------------


def test_malformed_ops_are_listed_all_at_once() -> None:
    with pytest.raises(ms.MappingError) as info:
        ms.WeightMap(
            [
                ms.MapRule("a", "a", ops=[ms.Rearrange("(h d) e -> h d")]),
                ms.MapRule("b", "b", ops=[ms.Rearrange("h e -> e h", h=4)]),
                ms.MapRule("c", "c", ops=[ms.Transpose((0, 0)), ms.Scale(0.0)]),
                ms.MapRule("d", "d", transpose=(1, 0), ops=[ms.Add(1.0)]),
                ms.MapRule("e", "e", ops=["transpose"]),  # type: ignore[list-item]
                ms.MapRule("f", "f", untied="lm_head.weight"),
                ms.MapRule("g", None, also=True),
            ]
        )
    assert str(info.value).splitlines() == [
        "8 mapping problems found (every offending tensor, leaf and rule is listed; paths are "
        "source:NAME, target:PATH, mapping:rules[i]):",
        "  mapping:rules[0].ops[0]",
        "    problem: rearrange '(h d) e -> h d': every axis must be on both sides: e only in "
        "the input",
        '    hint: einops notation: "(h d) e -> h e d"',
        "  mapping:rules[1].ops[0]",
        "    problem: rearrange 'h e -> e h': size h=4 is not an axis inside a group",
        "    hint: sizes are given for the axes inside parentheses",
        "  mapping:rules[2].ops[0]",
        "    problem: transpose (0, 0) is not a permutation of 0..1",
        "  mapping:rules[2].ops[1]",
        "    problem: scale(0): multiplying by zero cannot be undone on export",
        "  mapping:rules[3]",
        "    problem: a rule takes ops or transpose/reshape, not both",
        "    hint: write Transpose(...) and Reshape(...) into ops",
        "  mapping:rules[4].ops[0]",
        "    problem: 'transpose' is not an operation",
        "    hint: use Rearrange, Transpose, Reshape, Add or Scale",
        "  mapping:rules[5]",
        "    problem: untied 'lm_head.weight' needs also=True",
        "    hint: untied names the stored tensor an untied export writes an also leaf as",
        "  mapping:rules[6]",
        "    problem: an also rule needs a target (it fills another leaf)",
    ]


def test_ops_that_do_not_fit_the_tensors_are_listed_all_at_once(tmp_path: Path) -> None:
    path = _save(
        tmp_path / "m.safetensors",
        {
            "a": np.zeros((12, 5), np.float32),
            "b": np.zeros((6, 5), np.float32),
            "c": np.zeros(3, np.int32),
            "d": np.zeros((4, 4), np.float32),
        },
    )
    wm = ms.WeightMap(
        [
            ms.MapRule("a", "a", ops=[ms.Rearrange("(h d) e -> h e d", h=5)]),
            ms.MapRule("b", "b", ops=[ms.Rearrange("(h d) e f -> h e d f", h=2)]),
            ms.MapRule("c", "c", ops=[ms.Add(1.0)]),
            ms.MapRule("d", "d", ops=[ms.Rearrange("(h d) e -> h e d", h="heads")]),
        ]
    )
    with pytest.raises(ms.MappingError) as info:
        ms.load_safetensors(path, mapping=wm, dry_run=True)
    assert str(info.value).splitlines() == [
        "4 mapping problems found (every offending tensor, leaf and rule is listed; paths are "
        "source:NAME, target:PATH, mapping:rules[i]):",
        "  source:a float32[12, 5]",
        "    problem: rearrange((h d) e -> h e d): axis of size 12 does not divide by 5 (rules[0])",
        "  source:b float32[6, 5]",
        "    problem: rearrange((h d) e f -> h e d f) expects 3 axes, the tensor has 2 (rules[1])",
        "  source:d float32[4, 4]",
        "    problem: rearrange size 'heads' is not in the mapping's config (empty) (rules[3])",
        "    hint: add heads = <size> to the config",
        "  source:c int32[3]",  # the file's order: save_file puts 4-byte floats first
        "    problem: add(1.0) needs a floating-point tensor, not int32 (rules[2])",
        "    hint: add applies to float tensors only",
    ]


# ---- TOML -----------------------------------------------------------------------------

TOML = r"""
[config]
heads = 4

[[rules]]
source = 'q'
target = "q"
ops = [{ rearrange = "(h d) e -> h e d", h = "heads" }, { scale = 0.5 }]

[[rules]]
source = 'n'
target = "n"
ops = [{ add = 1.0 }, { transpose = [0] }, { reshape = [1, -1] }]

[[rules]]
source = 'e'
target = "e"

[[rules]]
source = 'e'
target = "head"
transpose = [1, 0]
also = true
untied = "lm_head.weight"
"""


def test_toml_ops_and_also_read_as_the_python_form() -> None:
    import tomllib

    wm = parse_weight_map(tomllib.loads(TOML))
    assert wm.rules[0].ops == (ms.Rearrange("(h d) e -> h e d", h="heads"), ms.Scale(0.5))
    assert wm.rules[1].ops == (ms.Add(1.0), ms.Transpose((0,)), ms.Reshape((1, -1)))
    assert wm.rules[3] == ms.MapRule(
        "e", "head", transpose=(1, 0), also=True, untied="lm_head.weight"
    )


def test_toml_op_errors_line_by_line() -> None:
    data = {
        "rules": [
            {"source": "a", "target": "a", "ops": [{"rearrange": "a b -> b a", "h": 1.5}]},
            {"source": "b", "target": "b", "ops": [{"add": 1.0, "scale": 2.0}, {}]},
            {"source": "c", "target": "c", "ops": {"add": 1.0}},
            {"source": "d", "target": "d", "ops": [{"add": "one"}], "also": "yes"},
        ]
    }
    hint = '    hint: e.g. ops = [{ rearrange = "(h d) e -> h e d", h = "heads" }, { add = 1.0 }]'
    with pytest.raises(ms.MappingError) as info:
        parse_weight_map(data, "m.toml")
    assert str(info.value).splitlines() == [
        "invalid mapping file m.toml:",
        "  m.toml:rules[0].ops[0].h",
        "    problem: size 1.5 is not an integer or a name",
        "  m.toml:rules[1].ops[0]",
        "    problem: 2 operations (add, scale): give exactly one of rearrange, transpose, "
        "reshape, add, scale",
        hint,
        "  m.toml:rules[1].ops[1]",
        "    problem: no operation: give exactly one of rearrange, transpose, reshape, add, scale",
        hint,
        "  m.toml:rules[2].ops",
        "    problem: {'add': 1.0} is not an array of tables",
        hint,
        "  m.toml:rules[3].ops[0].add",
        "    problem: 'one' is not a number",
        "  m.toml:rules[3].also",
        "    problem: also must be true or false, got 'yes'",
    ]


# ---- also: one stored tensor into several leaves -------------------------------------


def _tied(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray], ms.WeightMap]:
    t = {
        "embed.weight": RNG.standard_normal((32, 8)).astype(BF16),
        "norm.weight": RNG.standard_normal(8).astype(BF16),
    }
    path = _save(tmp_path / "tied.safetensors", t)
    wm = ms.WeightMap(
        [
            ms.MapRule(r"embed\.weight", "embed/embedding"),
            ms.MapRule(r"norm\.weight", "norm/scale"),
            ms.MapRule(
                r"embed\.weight",
                "head/kernel",
                transpose=(1, 0),
                also=True,
                untied="lm_head.weight",
            ),
        ]
    )
    return path, t, wm


def test_also_fills_a_second_leaf_and_the_export_writes_the_tensor_once(tmp_path: Path) -> None:
    path, t, wm = _tied(tmp_path)
    out = ms.load_safetensors(path, mapping=wm, dtype="float32")
    emb = t["embed.weight"].astype(np.float32)
    assert np.asarray(out["head"]["kernel"]).tobytes() == emb.T.copy().tobytes()
    assert np.asarray(out["embed"]["embedding"]).tobytes() == emb.tobytes()
    back = ms.save_safetensors(
        tmp_path / "b.safetensors", out, reference=path, mapping=wm, dtype="float32"
    )
    assert back.read_bytes() == path.read_bytes()  # two tensors, as stored; no lm_head


def test_an_also_leaf_changed_apart_is_refused_naming_it_and_nothing_is_written(
    tmp_path: Path,
) -> None:
    path, t, wm = _tied(tmp_path)
    out = ms.load_safetensors(path, mapping=wm, dtype="float32")
    out["head"]["kernel"] = out["head"]["kernel"].at[0, :3].add(1.0)  # fine-tuned apart
    dest = tmp_path / "b.safetensors"
    with pytest.raises(ms.MappingError) as info:
        ms.save_safetensors(dest, out, reference=path, mapping=wm, dtype="float32")
    assert str(info.value).splitlines() == [
        "1 mapping problem found (every offending leaf is listed; paths are arg:path):",
        "  target:head/kernel",
        "    problem: filled from embed.weight by rules[2] (also=True), but no longer equals "
        "it: 3 of 256 elements of embed.weight differ; the export writes embed.weight once, "
        "from its first rule's leaf",
        "    hint: tie the two in training, or export untied (untie=True and the rule's "
        "untied= name)",
    ]
    assert not dest.exists() and not list(tmp_path.glob("b.safetensors*"))
    with pytest.raises(ms.MappingError, match="no longer equals"):
        ms.unmap(out, reference=path, mapping=wm, dtype="float32")

    untied = ms.save_safetensors(dest, out, reference=path, mapping=wm, dtype="float32", untie=True)
    got = load_file(str(untied))
    assert sorted(got) == ["embed.weight", "lm_head.weight", "norm.weight"]
    assert got["embed.weight"].tobytes() == t["embed.weight"].tobytes()
    head = np.asarray(out["head"]["kernel"]).T.astype(BF16)
    assert got["lm_head.weight"].tobytes() == head.tobytes()


def test_untie_needs_the_rules_untied_name(tmp_path: Path) -> None:
    path, _, wm = _tied(tmp_path)
    out = ms.load_safetensors(path, mapping=wm)
    rules = [
        *wm.rules[:2],
        ms.MapRule(r"embed\.weight", "head/kernel", transpose=(1, 0), also=True),
    ]
    with pytest.raises(ms.MappingError) as info:
        ms.save_safetensors(
            tmp_path / "b.safetensors", out, reference=path, mapping=ms.WeightMap(rules), untie=True
        )
    assert str(info.value).splitlines()[1:] == [
        "  mapping:rules[2]",
        "    problem: untie=True, but this also rule names no untied tensor to write "
        "head/kernel as",
        '    hint: give the rule untied="..." (lm_head.weight)',
    ]


def test_llama_with_tied_embeddings_into_the_nnx_example(tmp_path: Path) -> None:
    """``examples/mappings/hf_llama_tied.toml``: a checkpoint without ``lm_head.weight``
    into the example's NNX Llama (a head kernel of its own): logits as the NumPy reference
    computes them with the head tied, and exported back to the original bytes."""
    from flax import nnx

    ex = _llama_example()
    t = ex.hf_checkpoint(tmp_path / "full.safetensors", layers=1)
    del t["lm_head.weight"]
    src = _save(tmp_path / "model.safetensors", t)
    mapping = ROOT / "examples" / "mappings" / "hf_llama_tied.toml"
    mesh = ms.make_mesh({"data": 2, "model": 4})
    model = ms.load_safetensors(
        src,
        like=ex.Llama(1, nnx.Rngs(0)),
        mapping=mapping,
        specs=ex.RULES,
        mesh=mesh,
        dtype="float32",
    )
    assert model.head.kernel[...].sharding.spec == P("data", "model")
    ids = np.random.default_rng(1).integers(0, ex.VOCAB, (2, 6))
    logits = np.asarray(jax.jit(lambda m, i: m(i))(model, ids))
    want = ex.reference_logits({**t, "lm_head.weight": t["model.embed_tokens.weight"]}, ids, 1)
    assert float(np.abs(logits - want).max()) < 1e-4
    back = ms.save_safetensors(
        tmp_path / "b.safetensors", model, reference=src, mapping=mapping, dtype="float32"
    )
    kept = {k: v for k, v in t.items() if "inv_freq" not in k}
    got = load_file(str(back))
    assert sorted(got) == sorted(kept)
    assert all(got[k].tobytes() == v.tobytes() and got[k].dtype == v.dtype for k, v in kept.items())


# ---- keep on export, abstract like on import -------------------------------------------


def test_export_with_a_keep_pattern_the_state_does_not_have(tmp_path: Path) -> None:
    """The convert round trip of the shipped hf_llama.toml: forwards without ``like`` the
    checkpoint has no LoRA leaves; backwards the keep pattern matching nothing is fine."""
    ex = _llama_example()
    src = tmp_path / "model.safetensors"
    t = ex.hf_checkpoint(src, layers=1)
    mapping = ROOT / "examples" / "mappings" / "hf_llama.toml"
    from modelshard.cli import main as cli_main

    ckpt, out = tmp_path / "ckpt", tmp_path / "exported.safetensors"
    assert cli_main(["convert", str(src), str(ckpt), "--mapping", str(mapping)]) == 0
    rc = cli_main(
        [
            "convert",
            str(ckpt),
            str(out),
            "--to",
            "safetensors",
            "--mapping",
            str(mapping),
            "--reference",
            str(src),
        ]
    )
    assert rc == 0
    got = load_file(str(out))
    assert all(got[k].tobytes() == v.tobytes() for k, v in t.items() if "inv_freq" not in k)


def test_an_abstract_like_lists_every_kept_leaf_without_a_value(tmp_path: Path) -> None:
    path = _save(tmp_path / "m.safetensors", {"w": np.zeros((4, 4), np.float32)})
    s = jax.ShapeDtypeStruct((4, 4), np.float32)
    like = {"w": s, "lora_a": s, "lora_b": s, "x": {"lora_a": s, "lora_b": s}}
    wm = ms.WeightMap([ms.MapRule("w", "w")], keep=["lora_"])
    with pytest.raises(ms.MappingError) as info:
        ms.load_safetensors(path, like=like, mapping=wm)
    lines = str(info.value).splitlines()
    assert lines[0] == (
        "4 mapping problems found (every offending leaf is listed; paths are arg:path):"
    )
    assert [ln for ln in lines if ln.startswith("  target:")] == [
        "  target:lora_a",
        "  target:lora_b",
        "  target:x/lora_a",
        "  target:x/lora_b",
    ]
    assert lines[1:4] == [
        "  target:lora_a",
        "    problem: kept (no stored tensor) but like holds no value for it",
        "    hint: pass a concrete like for kept leaves (a freshly initialised model)",
    ]


def test_rearrange_sizes_that_do_not_fit_are_named(tmp_path: Path) -> None:
    path = _save(tmp_path / "m.safetensors", {"a": np.zeros((12, 5), np.float32)})
    cases = {
        ms.Rearrange("(h d) e -> h e d", h=5, d=3): "axis of size 12 is not h=5 * d=3",
        ms.Rearrange("(h d t) e -> h e d t", h=2): "give the size of all but one of d, t",
        ms.Rearrange("() (h d) e -> h e d", h=3): "expects 3 axes, the tensor has 2",
    }
    for op, what in cases.items():
        wm = ms.WeightMap([ms.MapRule("a", "a", ops=[op])])
        with pytest.raises(ms.MappingError) as info:
            ms.load_safetensors(path, mapping=wm, dry_run=True)
        assert str(info.value).splitlines()[2] == (
            f"    problem: rearrange({op.pattern}): {what} (rules[0])"
            if "expects" not in what
            else f"    problem: rearrange({op.pattern}) {what} (rules[0])"
        )


def test_a_unit_axis_and_a_merge_load_and_export(tmp_path: Path) -> None:
    w = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    path = _save(tmp_path / "m.safetensors", {"w": w})
    wm = ms.WeightMap([ms.MapRule("w", "w", ops=[ms.Rearrange("a b c -> () c (a b)")])])
    out = ms.load_safetensors(path, mapping=wm)
    assert np.asarray(out["w"]).tobytes() == w.transpose(2, 0, 1).reshape(1, 4, 6).tobytes()
    back = ms.save_safetensors(tmp_path / "b.safetensors", out, reference=path, mapping=wm)
    assert back.read_bytes() == path.read_bytes()


def test_the_mapping_table_shows_names_and_templates_as_written(tmp_path: Path) -> None:
    path = _save(tmp_path / "m.safetensors", {"w[qkv]": np.zeros((2, 2), np.float32)})
    wm = ms.WeightMap([ms.MapRule(r"w\[qkv\]", "attn/[bold]/w", ops=[ms.Scale(2.0)])])
    table = str(ms.load_safetensors(path, mapping=wm, dry_run=True))
    assert "attn/[bold]/w" in table and "w[qkv]" in table and "scale(2.0)" in table


def test_untie_into_a_container_reference_names_the_tensor_without_a_leaf(
    tmp_path: Path,
) -> None:
    path, t, wm = _tied(tmp_path)
    out = ms.load_safetensors(path, mapping=wm)
    ref = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in t.items()}
    wm_flat = ms.WeightMap(wm.rules)  # the container's paths are the stored names
    with pytest.raises(ms.MappingError) as info:
        ms.unmap(out, reference=ref, mapping=wm_flat, untie=True)
    assert str(info.value).splitlines()[1:3] == [
        "  source:lm_head.weight",
        "    problem: untie=True writes this tensor, but the reference container has no such leaf",
    ]
    back = ms.unmap(out, reference=ref, mapping=wm_flat)  # tied: one tensor, checked equal
    assert back["embed.weight"].tobytes() == t["embed.weight"].tobytes()


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


# ---- what a first user of the shipped mapping files trips on -------------------------------


def _llama_of_size(
    root: Path, embed: int, heads: int, kv: int, head_dim: int, *, inv_freq: bool = False
) -> dict[str, np.ndarray]:
    """A one-layer Llama checkpoint in Hugging Face's names and layout, with its
    config.json (written as current transformers does: no rotary_emb.inv_freq)."""
    import json

    mlp, vocab = 3 * embed, 40

    def w(*shape: int) -> np.ndarray:
        return RNG.standard_normal(shape).astype(BF16)

    p = "model.layers.0."
    t = {
        "model.embed_tokens.weight": w(vocab, embed),
        p + "self_attn.q_proj.weight": w(heads * head_dim, embed),
        p + "self_attn.k_proj.weight": w(kv * head_dim, embed),
        p + "self_attn.v_proj.weight": w(kv * head_dim, embed),
        p + "self_attn.o_proj.weight": w(embed, heads * head_dim),
        p + "mlp.gate_proj.weight": w(mlp, embed),
        p + "mlp.up_proj.weight": w(mlp, embed),
        p + "mlp.down_proj.weight": w(embed, mlp),
        p + "input_layernorm.weight": w(embed),
        p + "post_attention_layernorm.weight": w(embed),
        "model.norm.weight": w(embed),
        "lm_head.weight": w(vocab, embed),
    }
    if inv_freq:
        t[p + "self_attn.rotary_emb.inv_freq"] = np.ones(head_dim // 2, np.float32)
    root.mkdir(parents=True, exist_ok=True)
    _save(root / "model.safetensors", t)
    config = {
        "model_type": "llama",
        "hidden_size": embed,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
    }
    (root / "config.json").write_text(json.dumps(config))
    return t


def test_a_skip_rule_that_matches_nothing_is_no_error_under_strict(tmp_path: Path) -> None:
    """skip means "ignore if present": current checkpoints store no rotary_emb.inv_freq;
    a rule with a target that matches nothing is still an error."""
    path = _save(tmp_path / "m.safetensors", {"w": np.zeros((2, 2), np.float32)})
    wm = ms.WeightMap([ms.MapRule("w", "w"), ms.MapRule(r".*\.rotary_emb\.inv_freq", None)])
    assert wm.strict
    res = ms.load_safetensors(path, mapping=wm, dry_run=True)
    assert list(res.recipes) == ["w"] and res.skipped == []
    wm = ms.WeightMap([ms.MapRule("w", "w"), ms.MapRule("v", "v")])
    with pytest.raises(ms.MappingError) as info:
        ms.load_safetensors(path, mapping=wm, dry_run=True)
    assert str(info.value).splitlines()[1:3] == [
        "  mapping:rules[1]",
        "    problem: source 'v' matched no stored tensor",
    ]


@pytest.mark.parametrize("name", ["hf_llama.toml", "hf_llama_tied.toml"])
def test_the_llama_files_load_a_checkpoint_without_inv_freq_and_reload_their_export(
    tmp_path: Path, name: str
) -> None:
    """A checkpoint as current transformers writes it (no inv_freq) loads with the shipped
    files; an older one's export drops inv_freq, and that export loads back too."""
    mapping = ROOT / "examples" / "mappings" / name
    t = _llama_of_size(tmp_path, 32, 8, 2, 4, inv_freq=True)
    if name == "hf_llama_tied.toml":
        del t["lm_head.weight"]
        _save(tmp_path / "model.safetensors", t)
    src = tmp_path / "model.safetensors"
    params = ms.load_safetensors(src, mapping=mapping)
    out = ms.save_safetensors(
        tmp_path / "exported.safetensors", params, reference=src, mapping=mapping
    )
    exported = load_file(str(out))
    assert sorted(exported) == sorted(k for k in t if "inv_freq" not in k)
    again = ms.load_safetensors(out, mapping=mapping)  # no inv_freq now: still loads
    assert _same_leaves(again, params)
    if name == "hf_llama_tied.toml":  # untied: lm_head.weight written, read by hf_llama.toml
        untied = ms.save_safetensors(
            tmp_path / "untied.safetensors", params, reference=src, mapping=mapping, untie=True
        )
        assert "lm_head.weight" in load_file(str(untied))
        plain = ROOT / "examples" / "mappings" / "hf_llama.toml"
        assert _same_leaves(ms.load_safetensors(untied, mapping=plain), params)


def _same_leaves(a: Any, b: Any) -> bool:
    """The same paths, each leaf bit for bit."""
    fa, fb = (dict(jax.tree_util.tree_flatten_with_path(t)[0]) for t in (a, b))
    return (
        len(fa) > 0
        and fa.keys() == fb.keys()
        and all(np.asarray(fa[k]).tobytes() == np.asarray(fb[k]).tobytes() for k in fa)
    )


def test_one_llama_file_serves_every_size_from_config_json(tmp_path: Path) -> None:
    """hf_llama.toml takes its sizes from config.json: a [32, 32] q_proj of 8 heads is
    [embed 32, heads 8, head_dim 4], not the example's [64, 4, 16]; without a config.json
    the missing size is said once per rule."""
    mapping = ROOT / "examples" / "mappings" / "hf_llama.toml"
    for embed, heads, kv, hd in ((32, 8, 2, 4), (48, 4, 4, 16)):
        t = _llama_of_size(tmp_path / f"e{embed}", embed, heads, kv, hd)
        out = ms.load_safetensors(tmp_path / f"e{embed}", mapping=mapping)
        attn = out["layers"]["0"]["attn"]
        assert attn["q"]["kernel"].shape == (embed, heads, hd)
        assert attn["k"]["kernel"].shape == (embed, kv, hd)
        assert attn["o"]["kernel"].shape == (heads, hd, embed)
        q = t["model.layers.0.self_attn.q_proj.weight"]
        assert np.asarray(attn["q"]["kernel"]).tobytes() == q.T.reshape(embed, heads, hd).tobytes()
    (tmp_path / "e32" / "config.json").unlink()
    with pytest.raises(ms.MappingError) as info:
        ms.load_safetensors(tmp_path / "e32", mapping=mapping, dry_run=True)
    lines = str(info.value).splitlines()
    assert lines[0].startswith("3 mapping problems found")  # q, k|v, o: once per rule
    assert lines[1:] == [
        "  source:model.layers.0.self_attn.k_proj.weight bfloat16[32, 8]",  # transposed
        "    problem: reshape size 'hidden_size' is not in the mapping's config (empty) (rules[2])",
        "    hint: add hidden_size = <size> to the config (the rule needs it for 1 more stored "
        "tensor)",
        "  source:model.layers.0.self_attn.o_proj.weight bfloat16[32, 32]",
        "    problem: reshape size 'num_attention_heads' is not in the mapping's config (empty) "
        "(rules[3])",
        "    hint: add num_attention_heads = <size> to the config",
        "  source:model.layers.0.self_attn.q_proj.weight bfloat16[32, 32]",
        "    problem: reshape size 'hidden_size' is not in the mapping's config (empty) (rules[1])",
        "    hint: add hidden_size = <size> to the config",
    ]


def test_a_mapping_config_contradicting_config_json_warns_naming_both(tmp_path: Path) -> None:
    _llama_of_size(tmp_path, 32, 8, 2, 4)
    wm = ms.WeightMap(
        [
            ms.MapRule(
                r".*q_proj\.weight",
                "q",
                ops=[ms.Rearrange("(h d) e -> h e d", h="num_attention_heads")],
            ),
            ms.MapRule(r".*", None),
        ],
        config={"num_attention_heads": 4, "hidden_size": 32},  # agrees: no warning for it
    )
    with pytest.warns(UserWarning) as caught:
        out = ms.load_safetensors(tmp_path, mapping=wm)
    assert [str(w.message) for w in caught] == [
        "the mapping's config sets num_attention_heads = 4, but config.json has "
        "num_attention_heads = 8; using the mapping's 4 (remove num_attention_heads from the "
        "mapping's config to take config.json's)"
    ]
    assert caught[0].filename == __file__  # points at the caller's line
    assert out["q"].shape == (4, 32, 8)  # the mapping's value, as documented


def test_a_rule_shadowed_by_an_earlier_one_says_so(tmp_path: Path) -> None:
    t = {f"l.{i}.{n}": np.zeros((2, 2), np.float32) for i in range(2) for n in ("gate", "up")}
    path = _save(tmp_path / "m.safetensors", t)
    wm = ms.WeightMap(
        [
            ms.MapRule(r"l\.(\d+)\.(\w+)", "mlp/{1}/{2}"),
            ms.MapRule(r"l\.(\d+)\.(gate|up)", "wi/{1}", stack=ms.Stack(2, order=("gate", "up"))),
            ms.MapRule(r"l\.0\.up", "up0"),
        ]
    )
    with pytest.raises(ms.MappingError) as info:
        ms.load_safetensors(path, mapping=wm, dry_run=True)
    assert str(info.value).splitlines()[1:] == [
        "  mapping:rules[1]",
        "    problem: source 'l\\\\.(\\\\d+)\\\\.(gate|up)' matches 4 stored tensors, but all were "
        "taken by an earlier rule: rules[0] ('l\\\\.(\\\\d+)\\\\.(\\\\w+)') (first match wins)",
        "    hint: move rules[1] before it, narrow the earlier regex, or give this rule "
        "also=True to fill its leaf in addition",
        "  mapping:rules[2]",
        "    problem: source 'l\\\\.0\\\\.up' matches 1 stored tensor, but it was taken by an "
        "earlier rule: rules[0] ('l\\\\.(\\\\d+)\\\\.(\\\\w+)') (first match wins)",
        "    hint: move rules[2] before it, narrow the earlier regex, or give this rule "
        "also=True to fill its leaf in addition",
    ]


def test_a_misspelled_toml_key_is_named_with_a_suggestion() -> None:
    data = {
        "rulez": [],
        "rules": [
            {"source": "a", "target": "a", "ops": [{"rearange": "(h d) e -> h e d", "h": 2}]},
            {"source": "b", "target": "b", "transpsoe": [1, 0]},
            {"source": "c", "target": "c", "stack": {"group": 1, "oder": ["x"]}},
        ],
    }
    with pytest.raises(ms.MappingError) as info:
        parse_weight_map(data, "m.toml")
    assert str(info.value).splitlines() == [
        "invalid mapping file m.toml:",
        "  m.toml:rulez",
        "    problem: unknown top-level key 'rulez' (did you mean 'rules'?)",
        "    hint: allowed: config, keep, rules, strict",
        "  m.toml:rules[0].ops[0].rearange",
        "    problem: unknown key 'rearange' (did you mean 'rearrange'?)",
        "    hint: operations: rearrange, transpose, reshape, add, scale",
        "  m.toml:rules[1].transpsoe",
        "    problem: unknown key 'transpsoe' (did you mean 'transpose'?)",
        "    hint: allowed: also, cast, concat, ops, reshape, skip, source, split, stack, target, "
        "transpose, unstack, untied",
        "  m.toml:rules[2].stack.oder",
        "    problem: unknown key 'oder' (did you mean 'order'?)",
        "    hint: allowed: group, axis, order",
    ]


def test_a_config_typo_is_reported_once_per_rule(tmp_path: Path) -> None:
    t = {f"l.{i}.q": np.zeros((8, 3), np.float32) for i in range(5)}
    path = _save(tmp_path / "m.safetensors", t)
    wm = ms.WeightMap(
        [ms.MapRule(r"l\.(\d+)\.q", "q/{1}", ops=[ms.Rearrange("(h d) e -> h e d", h="haeds")])],
        config={"heads": 2},
    )
    with pytest.raises(ms.MappingError) as info:
        ms.load_safetensors(path, mapping=wm, dry_run=True)
    assert str(info.value).splitlines()[1:] == [
        "  source:l.0.q float32[8, 3]",
        "    problem: rearrange size 'haeds' is not in the mapping's config (did you mean "
        "'heads'?) (rules[0])",
        "    hint: add haeds = <size> to the config (the rule needs it for 4 more stored tensors)",
    ]


def test_the_dry_run_table_reads_as_words_in_target_order(tmp_path: Path) -> None:
    t: dict[str, np.ndarray] = {
        f"l.{i}.{n}": np.zeros((4, 2), np.float32) for i in range(11) for n in ("up", "gate")
    }
    t["rot.inv_freq"] = np.zeros(2, np.float32)
    path = _save(tmp_path / "m.safetensors", t)
    wm = ms.WeightMap(
        [
            ms.MapRule(r"l\.(\d+)\.(gate|up)", "wi/{1}", stack=ms.Stack(2, order=("gate", "up"))),
            ms.MapRule(r".*inv_freq", None),
        ]
    )
    res = ms.load_safetensors(path, mapping=wm, dry_run=True)
    assert [r.target for r in res.rows] == [f"wi/{i}" for i in range(11)]  # numbers as numbers
    assert res.summary() == (
        "11 leaves mapped from 22 stored tensors, 0 kept (like's values), 1 stored tensor skipped"
    )
    row = next(ln for ln in str(res).splitlines() if "wi/10" in ln)
    assert [c.strip() for c in row.split("│")[1:-1]] == [
        "wi/10",
        "[2, 4, 2]",
        "float32",
        "l.10.gate and 1 more",
        "stack(group 2 = gate|up, axis 0)",
    ]
    assert "(+1)" not in str(res)
    # with like: its flatten order
    like = {f"wi/{i}": jax.ShapeDtypeStruct((2, 4, 2), np.float32) for i in range(11)}
    res = ms.load_safetensors(path, like=like, mapping=wm, dry_run=True)
    assert [r.target for r in res.rows] == sorted(like)  # jax flattens dicts by sorted key
