"""Fused weights: ``Concat`` (several stored tensors along an existing axis) and ``Split``
(one stored tensor into parts), forwards, backwards and validated; transposed loads of
every dtype."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

import modelshard as ms
from helpers import rand
from modelshard._weights import parse_weight_map, write_safetensors

RNG = np.random.default_rng(1)
D, H, KV, HD, FF, LAYERS = 16, 4, 2, 4, 24, 2  # grouped-query: q 16 rows, k and v 8 each
BF16 = ml_dtypes.bfloat16


def _hf(path: Path) -> dict[str, np.ndarray]:
    """Separate q, k, v and gate, up projections, PyTorch [out, in], by safetensors.numpy."""
    t = {}
    for i in range(LAYERS):
        pre = f"model.layers.{i}."
        t[pre + "self_attn.q_proj.weight"] = rand((H * HD, D))
        t[pre + "self_attn.k_proj.weight"] = rand((KV * HD, D))
        t[pre + "self_attn.v_proj.weight"] = rand((KV * HD, D))
        t[pre + "mlp.gate_proj.weight"] = rand((FF, D))
        t[pre + "mlp.up_proj.weight"] = rand((FF, D))
    save_file(t, str(path))
    return t


FUSED = ms.WeightMap(
    [
        ms.MapRule(
            r"model\.layers\.(\d+)\.self_attn\.(q|k|v)_proj\.weight",
            "layers/{1}/attn/qkv/kernel",
            transpose=(1, 0),
            concat=ms.Concat(2, axis=1, order=("q", "k", "v")),
        ),
        ms.MapRule(
            r"model\.layers\.(\d+)\.mlp\.(gate|up)_proj\.weight",
            "layers/{1}/mlp/gate_up/kernel",
            transpose=(1, 0),
            concat=ms.Concat(2, axis=1, order=("gate", "up")),
        ),
    ]
)


def _fused_like() -> dict[str, Any]:
    return {
        "layers": {
            str(i): {
                "attn": {"qkv": {"kernel": jax.ShapeDtypeStruct((D, (H + 2 * KV) * HD), BF16)}},
                "mlp": {"gate_up": {"kernel": jax.ShapeDtypeStruct((D, 2 * FF), BF16)}},
            }
            for i in range(LAYERS)
        }
    }


def test_concat_fuses_q_k_v_and_gate_up_and_exports_back_bit_exact(tmp_path, mesh24):
    src = _hf(tmp_path / "model.safetensors")
    # the fused axis sharded 4 ways: device blocks straddle the q|k and k|v boundaries
    rules = ms.Rules([("kernel", P("data", "model"))])
    out = ms.load_safetensors(
        tmp_path / "model.safetensors", like=_fused_like(), mapping=FUSED, specs=rules, mesh=mesh24
    )
    for i in range(LAYERS):
        pre = f"model.layers.{i}."
        qkv = out["layers"][str(i)]["attn"]["qkv"]["kernel"]
        assert qkv.sharding.spec == P("data", "model")
        want = np.concatenate([src[pre + f"self_attn.{n}_proj.weight"].T for n in "qkv"], axis=1)
        assert np.asarray(qkv).tobytes() == want.tobytes()
        gu = np.asarray(out["layers"][str(i)]["mlp"]["gate_up"]["kernel"])
        assert gu[:, :FF].tobytes() == src[pre + "mlp.gate_proj.weight"].T.tobytes()
        assert gu[:, FF:].tobytes() == src[pre + "mlp.up_proj.weight"].T.tobytes()
    back = ms.save_safetensors(
        tmp_path / "back.safetensors", out, reference=tmp_path / "model.safetensors", mapping=FUSED
    )
    got = load_file(str(back))  # the safetensors package reads the export
    assert sorted(got) == sorted(src)
    for k, v in src.items():
        assert (
            got[k].dtype == v.dtype and got[k].shape == v.shape and got[k].tobytes() == v.tobytes()
        )


def test_split_cuts_a_fused_tensor_into_unequal_parts_and_back(tmp_path, mesh8):
    # GPT-2's Conv1D layout [in, out]: q, k, v side by side along axis 1
    fused = {f"h.{i}.attn.c_attn.weight": rand((D, (H + 2 * KV) * HD)) for i in range(LAYERS)}
    save_file(fused, str(tmp_path / "gpt.safetensors"))
    wm = ms.WeightMap(
        [
            ms.MapRule(
                r"h\.(\d+)\.attn\.c_attn\.weight",
                "blocks/{1}/{part}/kernel",
                split=ms.Split("part", ("q", "k", "v"), axis=1, sizes=("q", "kv", "kv")),
                reshape=(D, -1, HD),
            )
        ],
        config={"q": H * HD, "kv": KV * HD},
    )
    like = {
        "blocks": {
            str(i): {
                n: {"kernel": jax.ShapeDtypeStruct((D, h, HD), BF16)}
                for n, h in (("q", H), ("k", KV), ("v", KV))
            }
            for i in range(LAYERS)
        }
    }
    out = ms.load_safetensors(
        tmp_path / "gpt.safetensors", like=like, mapping=wm, specs=P("data"), mesh=mesh8
    )
    for i in range(LAYERS):
        w = fused[f"h.{i}.attn.c_attn.weight"]
        q, k, v = np.split(w, [H * HD, (H + KV) * HD], axis=1)
        for name, want in (("q", q), ("k", k), ("v", v)):
            leaf = out["blocks"][str(i)][name]["kernel"]
            assert leaf.sharding.spec == P("data")
            assert np.asarray(leaf).tobytes() == want.reshape(D, -1, HD).tobytes(), (i, name)
    back = ms.save_safetensors(
        tmp_path / "back.safetensors", out, reference=tmp_path / "gpt.safetensors", mapping=wm
    )
    got = load_file(str(back))
    assert {k: v.tobytes() for k, v in got.items()} == {k: v.tobytes() for k, v in fused.items()}


def test_split_into_equal_parts_reads_each_part_as_rows(tmp_path, mesh8):
    w = rand((3 * 8, 4), np.float32)  # PyTorch's fused [3*out, in]
    save_file({"qkv.weight": w}, str(tmp_path / "m.safetensors"))
    wm = ms.WeightMap(
        [ms.MapRule(r"qkv\.weight", "{n}/kernel", split=ms.Split("n", ("q", "k", "v")))]
    )
    out = ms.load_safetensors(
        tmp_path / "m.safetensors", mapping=wm, specs=ms.fsdp("data", min_size=0), mesh=mesh8
    )
    for j, n in enumerate("qkv"):
        np.testing.assert_array_equal(np.asarray(out[n]["kernel"]), w[8 * j : 8 * (j + 1)])
    assert wm.target_of("qkv.weight") == "q/kernel"


def test_fused_rules_problems_are_listed_at_once_path_first(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file(
        {
            "a.q": rand((4, 8), np.float32),
            "a.k": rand((4, 6), np.float32),  # axis 1 differs: fine for axis 1, not axis 0
            "b.q": rand((4, 8), np.float32),
            "b.k": rand((4, 8), BF16),  # another dtype
            "c": rand((10, 3), np.float32),  # 10 rows do not cut into 3 equal parts
            "d": rand((10, 3), np.float32),  # sizes sum to 9
            "e": rand((2, 3), np.float32),
        },
        str(path),
    )
    wm = ms.WeightMap(
        [
            ms.MapRule(r"a\.(q|k)", "a", concat=ms.Concat(1, axis=0, order=("q", "k"))),
            ms.MapRule(r"b\.(q|k)", "b", concat=ms.Concat(1, axis=1, order=("q", "k"))),
            ms.MapRule("c", "c/{p}", split=ms.Split("p", ("x", "y", "z"))),
            ms.MapRule("d", "d/{p}", split=ms.Split("p", ("x", "y"), sizes=(4, "five"))),
            ms.MapRule("e", "e/{p}", split=ms.Split("p", ("x", "y"), axis=2)),
        ],
        config={"five": 5},
    )
    with pytest.raises(ms.MappingError) as e:
        ms.load_safetensors(path, mapping=wm)
    text = str(e.value)
    assert text.splitlines()[0].startswith("5 mapping problems found")
    for line in [
        "  target:a\n    problem: the concatenated tensors differ in dtype or shape outside "
        "axis 0: a.q float32[4, 8], a.k float32[4, 6]",
        "    hint: only tensors of one dtype, equal in every axis but 0, concatenate",
        "  target:b\n    problem: the concatenated tensors differ in dtype or shape outside "
        "axis 1: b.q float32[4, 8], b.k bfloat16[4, 8]",
        "  source:c float32[10, 3]\n    problem: axis 0 of size 10 does not split into 3 equal "
        "parts ('x', 'y', 'z') (rules[2])",
        "  source:d float32[10, 3]\n    problem: split sizes (4, 5) (sum 9) do not cut axis 0 of "
        "size 10 (rules[3])",
        "  source:e float32[2, 3]\n    problem: split axis 2 is out of range (rules[4])",
    ]:
        assert line in text


def test_malformed_fused_rules_are_refused_when_built():
    with pytest.raises(ms.MappingError) as e:
        ms.WeightMap(
            [
                ms.MapRule(r"a\.(q|k)", "a/{1}", concat=ms.Concat(1)),
                ms.MapRule(r"a\.(q|k)", "a", concat=ms.Concat(2)),
                ms.MapRule(r"a", "a", split=ms.Split("part", ("q", "k"))),
                ms.MapRule(r"a", "a/{p}", split=ms.Split("p", ("q", "q"))),
                ms.MapRule(r"a", "a/{p}", split=ms.Split("p", ("q", "k"), sizes=(1, 2, 3))),
                ms.MapRule(r"a\.(q)", "a", stack=ms.Stack(1), concat=ms.Concat(1)),
                ms.MapRule(r"a", None, split=ms.Split("p", ("q",))),
            ]
        )
    text = str(e.value)
    for line in [
        "mapping:rules[0]\n    problem: the target 'a/{1}' uses the concatenated group {1}",
        "mapping:rules[1]\n    problem: concat group 2 is not a group of 'a\\\\.(q|k)'",
        "mapping:rules[2]\n    problem: split key {part} is not in the target 'a'",
        "mapping:rules[3]\n    problem: split names ('q', 'q') must be distinct and at least one",
        "mapping:rules[4]\n    problem: split has 2 names ('q', 'k') but 3 sizes (1, 2, 3)",
        "mapping:rules[5]\n    problem: a rule cannot both stack and concat",
        "mapping:rules[6]\n    problem: a skip rule (target None) takes no transforms",
    ]:
        assert line in text


def test_fused_rules_from_toml_equal_python():
    wm = parse_weight_map(
        {
            "config": {"q": 16, "kv": 8},
            "rules": [
                {
                    "source": r"l\.(\d+)\.(q|k|v)",
                    "target": "l/{1}/qkv",
                    "transpose": [1, 0],
                    "concat": {"group": 2, "axis": 1, "order": ["q", "k", "v"]},
                },
                {
                    "source": r"f\.(\d+)",
                    "target": "f/{1}/{part}",
                    "split": {
                        "key": "part",
                        "names": ["q", "k", "v"],
                        "axis": 1,
                        "sizes": ["q", "kv", "kv"],
                    },
                },
            ],
        }
    )
    assert wm.rules == (
        ms.MapRule(
            r"l\.(\d+)\.(q|k|v)",
            "l/{1}/qkv",
            transpose=(1, 0),
            concat=ms.Concat(2, axis=1, order=("q", "k", "v")),
        ),
        ms.MapRule(
            r"f\.(\d+)",
            "f/{1}/{part}",
            split=ms.Split("part", ("q", "k", "v"), axis=1, sizes=("q", "kv", "kv")),
        ),
    )
    with pytest.raises(ms.MappingError) as e:
        parse_weight_map(
            {
                "rules": [
                    {"source": "a", "target": "{p}", "split": {"key": "p"}},
                    {"source": "a", "target": "{p}", "split": {"key": "p", "names": [1]}},
                    {"source": "a", "target": "b", "concat": {"axis": 1}},
                    {
                        "source": "a",
                        "target": "{p}",
                        "split": {"key": "p", "names": ["x"], "sizes": [1.5]},
                    },
                ]
            },
            "map.toml",
        )
    text = str(e.value)
    for line in [
        "map.toml:rules[0].split\n    problem: names is required",
        "map.toml:rules[1].split.names\n    problem: [1] is not an array of strings",
        "map.toml:rules[2].concat\n    problem: group is required",
        "map.toml:rules[3].split.sizes\n    problem: [1.5] is not an array of integers or "
        "config names",
    ]:
        assert line in text


def test_dry_run_table_names_the_fused_sources(tmp_path):
    _hf(tmp_path / "model.safetensors")
    res = ms.load_safetensors(
        tmp_path / "model.safetensors", like=_fused_like(), mapping=FUSED, dry_run=True
    )
    row = next(r for r in res.rows if r.target == "layers/0/attn/qkv/kernel")
    assert row.sources == tuple(f"model.layers.0.self_attn.{n}_proj.weight" for n in "qkv")
    assert row.how == "transpose(1, 0), concat(group 2 = q|k|v, axis 1)"
    assert row.shape == (D, (H + 2 * KV) * HD)


@pytest.mark.parametrize(
    "dtype",
    [np.float32, BF16, np.float16, ml_dtypes.float8_e4m3fn, np.int8],
    ids=lambda d: np.dtype(d).name,
)
def test_transposed_load_of_every_dtype_is_bit_exact(tmp_path, dtype, mesh24):
    if dtype is np.int8:
        w = RNG.integers(-128, 128, (12, 32)).astype(np.int8)
    else:
        w = rand((12, 32), dtype)
    path = tmp_path / "m.safetensors"
    if "float8" in np.dtype(dtype).name:  # safetensors.numpy cannot write fp8
        write_safetensors(path, [("w", w.shape, w.dtype)], lambda name: w)
    else:
        save_file({"w": w}, str(path))
    wm = ms.WeightMap([ms.MapRule("w", "kernel", transpose=(1, 0))])
    for spec in (P("data", "model"), P("model", "data"), P(None, "data"), P()):
        out = ms.load_safetensors(path, mapping=wm, specs=spec, mesh=mesh24)
        assert out["kernel"].dtype == w.dtype and out["kernel"].sharding.spec == spec
        assert np.asarray(out["kernel"]).tobytes() == np.ascontiguousarray(w.T).tobytes(), spec
