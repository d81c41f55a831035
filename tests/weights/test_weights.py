"""Pretrained weights: the mapping language, safetensors import/export, validation."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

import modelshard as ms
from helpers import rand
from modelshard._weights import (
    load_weight_map,
    open_safetensors,
    parse_weight_map,
    write_safetensors,
)
from modelshard._weights.safetensors import SafetensorsFiles

RNG = np.random.default_rng(0)


def _st(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    """A safetensors file written by the safetensors package: ``safetensors.numpy`` where
    its NumPy backend knows the dtype, else (fp8) the package's own serializer."""
    if not any("float8" in a.dtype.name for a in tensors.values()):
        save_file(tensors, str(path))
        return path
    import safetensors

    held = {k: np.ascontiguousarray(a) for k, a in tensors.items()}  # alive while written
    specs = {
        k: safetensors.TensorSpec(
            dtype=a.dtype.name, shape=list(a.shape), data_ptr=a.ctypes.data, data_len=a.nbytes
        )
        for k, a in held.items()
    }
    safetensors.serialize_file(specs, str(path), None)
    return path


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


@pytest.fixture
def count_reads(monkeypatch):
    """Bytes read from safetensors files, per tensor name (``map:NAME``: bytes mapped)."""
    counts: dict[str, int] = {}
    real, real_map = SafetensorsFiles.read_rows, SafetensorsFiles.mapped

    def spy(self, name, lo, hi, *into):
        out = real(self, name, lo, hi, *into)
        counts[name] = counts.get(name, 0) + out.nbytes
        return out

    def spy_map(self, name):
        out = real_map(self, name)
        counts[f"map:{name}"] = counts.get(f"map:{name}", 0) + out.nbytes
        return out

    monkeypatch.setattr(SafetensorsFiles, "read_rows", spy)
    monkeypatch.setattr(SafetensorsFiles, "mapped", spy_map)
    return counts


# ---- import ------------------------------------------------------------------------------

DTYPES = [
    np.float32,
    ml_dtypes.bfloat16,
    np.float16,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e4m3fnuz,
    ml_dtypes.float8_e5m2fnuz,
    np.int8,
    np.uint8,
    np.int32,
    np.bool_,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_dtype_loads_bit_exact(tmp_path, dtype, mesh8):
    """Files of the safetensors package's writers (bf16, f16, fp8, int8, ...) load bit-exact."""
    a = rand((16, 4), dtype) if np.dtype(dtype).kind != "b" else RNG.random((16, 4)) > 0.5
    path = _st(tmp_path / "m.safetensors", {"w": a, "s": np.asarray(a[0, 0])})
    out = ms.load_safetensors(path, specs=ms.fsdp("data", min_size=0), mesh=mesh8)
    assert out["w"].dtype == a.dtype and out["w"].sharding.spec == P("data")
    assert np.asarray(out["w"]).tobytes() == a.tobytes()
    assert np.asarray(out["s"]).tobytes() == a[0, 0].tobytes()


def test_fsdp_each_device_reads_only_its_rows(tmp_path, mesh8, count_reads):
    a = rand((64, 32), np.float32)
    path = _st(tmp_path / "m.safetensors", {"w": a})
    out = ms.load_safetensors(path, specs=ms.fsdp("data", min_size=0), mesh=mesh8)
    assert out["w"].sharding.spec == P("data")
    assert count_reads["w"] == a.nbytes  # eight reads of one eighth each, no whole read
    np.testing.assert_array_equal(np.asarray(out["w"]), a)


def test_transposed_load_reads_each_tensor_once(tmp_path, mesh8, count_reads):
    a = rand((32, 64), np.float32)  # PyTorch [out, in]
    path = _st(tmp_path / "m.safetensors", {"fc.weight": a})
    wm = ms.WeightMap([ms.MapRule(r"(\w+)\.weight", "{1}/kernel", transpose=(1, 0))])
    like = {"fc": {"kernel": jax.ShapeDtypeStruct((64, 32), np.float32)}}
    out = ms.load_safetensors(path, like=like, mapping=wm, specs=P("data"), mesh=mesh8)
    np.testing.assert_array_equal(np.asarray(out["fc"]["kernel"]), a.T)
    assert out["fc"]["kernel"].sharding.spec == P("data")
    # the target's rows are the stored tensor's columns: each device copies its block out
    # of one memory map of the tensor; nothing is read into a buffer first
    assert count_reads == {"map:fc.weight": a.nbytes}


def test_sharded_index_of_several_files(tmp_path, mesh24):
    a, b = rand((8, 4), np.float32), rand((4,), ml_dtypes.bfloat16)
    save_file({"a.weight": a}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b.bias": b}, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {
        "metadata": {"total_size": a.nbytes + b.nbytes},
        "weight_map": {
            "a.weight": "model-00001-of-00002.safetensors",
            "b.bias": "model-00002-of-00002.safetensors",
        },
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    for where in (tmp_path, tmp_path / "model.safetensors.index.json"):
        out = ms.load_safetensors(
            where, specs=ms.Rules([("a/", P("data", "model"))], strict=False), mesh=mesh24
        )
        np.testing.assert_array_equal(np.asarray(out["a"]["weight"]), a)
        assert np.asarray(out["b"]["bias"]).tobytes() == b.tobytes()
        assert out["a"]["weight"].sharding.spec == P("data", "model")


def test_dtype_casts_floating_tensors_only(tmp_path):
    path = _st(tmp_path / "m.safetensors", {"w": rand((4,), ml_dtypes.bfloat16), "i": np.arange(3)})
    like = {"w": jax.ShapeDtypeStruct((4,), np.float32), "i": jax.ShapeDtypeStruct((3,), np.int64)}
    out = ms.load_safetensors(path, like=like, dtype="float32")
    assert out["w"].dtype == np.float32 and out["i"].dtype == jnp.int32  # canonical on CPU


# ---- the Llama layout --------------------------------------------------------------------

LAYERS, D, FF = 3, 16, 32


def _llama_tensors() -> dict[str, np.ndarray]:
    t = {"model.embed_tokens.weight": rand((64, D), ml_dtypes.bfloat16)}
    for i in range(LAYERS):
        pre = f"model.layers.{i}."
        for n in "qkvo":
            t[pre + f"self_attn.{n}_proj.weight"] = rand((D, D), ml_dtypes.bfloat16)
        t[pre + "mlp.gate_proj.weight"] = rand((FF, D), ml_dtypes.bfloat16)
        t[pre + "mlp.up_proj.weight"] = rand((FF, D), ml_dtypes.bfloat16)
        t[pre + "mlp.down_proj.weight"] = rand((D, FF), ml_dtypes.bfloat16)
        t[pre + "input_layernorm.weight"] = rand((D,), ml_dtypes.bfloat16)
        t[pre + "self_attn.rotary_emb.inv_freq"] = rand((4,), np.float32)
    t["model.norm.weight"] = rand((D,), ml_dtypes.bfloat16)
    return t


SCANNED = ms.WeightMap(
    [
        ms.MapRule(r"model\.embed_tokens\.weight", "embed/embedding"),
        ms.MapRule(
            r"model\.layers\.(\d+)\.self_attn\.(q|k|v)_proj\.weight",
            "layers/attn/{2}/kernel",
            transpose=(1, 0),
            reshape=("embed", "heads", -1),
            stack=ms.Stack(1),
        ),
        ms.MapRule(
            r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight",
            "layers/attn/o/kernel",
            transpose=(1, 0),
            stack=ms.Stack(1),
        ),
        ms.MapRule(
            r"model\.layers\.(?P<i>\d+)\.mlp\.(gate|up)_proj\.weight",
            "layers/mlp/wi/{i}",
            transpose=(1, 0),
            stack=ms.Stack(2, order=("gate", "up")),
        ),
        ms.MapRule(
            r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", "layers/mlp/wo/{1}", transpose=(1, 0)
        ),
        ms.MapRule(
            r"model\.layers\.(\d+)\.input_layernorm\.weight", "layers/norm/{1}", cast="float32"
        ),
        ms.MapRule(r".*\.rotary_emb\.inv_freq", None),
        ms.MapRule(r"model\.norm\.weight", "final_norm/scale", cast="float32"),
    ],
    config={"embed": D, "heads": 4},
    keep=["^lora/"],
)


def _scanned_like() -> dict[str, Any]:
    bf = ml_dtypes.bfloat16
    like: dict[str, Any] = {
        "embed": {"embedding": jax.ShapeDtypeStruct((64, D), bf)},
        "layers": {
            "attn": {
                n: {"kernel": jax.ShapeDtypeStruct((LAYERS, D, 4, D // 4), bf)} for n in "qkv"
            },
            "mlp": {
                "wi": {str(i): jax.ShapeDtypeStruct((2, D, FF), bf) for i in range(LAYERS)},
                "wo": {str(i): jax.ShapeDtypeStruct((FF, D), bf) for i in range(LAYERS)},
            },
            "norm": {str(i): jax.ShapeDtypeStruct((D,), np.float32) for i in range(LAYERS)},
        },
        "final_norm": {"scale": jax.ShapeDtypeStruct((D,), np.float32)},
        "lora": {"a": jnp.full((D, 2), 0.5)},
    }
    like["layers"]["attn"]["o"] = {"kernel": jax.ShapeDtypeStruct((LAYERS, D, D), bf)}
    return like


def test_llama_layout_into_stacked_einsum_leaves_and_back_bit_exact(tmp_path, mesh24):
    src = _llama_tensors()
    path = _st(tmp_path / "model.safetensors", src)
    rules = ms.Rules(
        [("attn/.*/kernel", P(None, None, "model")), ("wi", P(None, "data"))], strict=False
    )
    out = ms.load_safetensors(path, like=_scanned_like(), mapping=SCANNED, specs=rules, mesh=mesh24)
    q = np.asarray(out["layers"]["attn"]["q"]["kernel"])
    for i in range(LAYERS):
        w = src[f"model.layers.{i}.self_attn.q_proj.weight"]
        assert q[i].tobytes() == w.T.reshape(D, 4, D // 4).tobytes()
    wi = out["layers"]["mlp"]["wi"]["1"]
    assert wi.sharding.spec == P(None, "data")
    assert np.asarray(wi[1]).tobytes() == src["model.layers.1.mlp.up_proj.weight"].T.tobytes()
    assert out["layers"]["attn"]["q"]["kernel"].sharding.spec == P(None, None, "model")
    np.testing.assert_array_equal(np.asarray(out["lora"]["a"]), 0.5)  # kept
    # export: the same mapping backwards, against the original header
    back = ms.save_safetensors(tmp_path / "back.safetensors", out, reference=path, mapping=SCANNED)
    got = load_file(str(back))
    want = {k: v for k, v in src.items() if "inv_freq" not in k}
    assert list(got) == [k for k in src if k in want] or sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert got[k].tobytes() == v.tobytes(), k


def test_dry_run_prints_the_table_and_reads_nothing(tmp_path, count_reads):
    path = _st(tmp_path / "model.safetensors", _llama_tensors())
    res = ms.load_safetensors(path, like=_scanned_like(), mapping=SCANNED, dry_run=True)
    assert count_reads == {}
    text = str(res)
    assert (
        "layers/attn/q/kernel" in text
        and "model.layers.0.self_attn.q_proj.weight and 2 more" in text
    )
    assert "kept (like's value)" in text and "3 stored tensors skipped" in text
    row = next(r for r in res.rows if r.target == "layers/mlp/wi/0")
    assert row.sources == (
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    )


def test_unstack_scanned_checkpoint_into_unscanned_leaves_and_back(tmp_path):
    k = rand((LAYERS, D, FF), np.float32)
    path = _st(tmp_path / "scan.safetensors", {"params/layers/mlp/kernel": k})
    wm = ms.WeightMap(
        [
            ms.MapRule(
                r"params/layers/(.+)", "layers/{n}/{1}", unstack=ms.Unstack("n"), transpose=(1, 0)
            )
        ]
    )
    like = {
        "layers": {
            str(i): {"mlp": {"kernel": jax.ShapeDtypeStruct((FF, D), np.float32)}}
            for i in range(LAYERS)
        }
    }
    out = ms.load_safetensors(path, like=like, mapping=wm)
    for i in range(LAYERS):
        np.testing.assert_array_equal(np.asarray(out["layers"][str(i)]["mlp"]["kernel"]), k[i].T)
    back = ms.save_safetensors(tmp_path / "back.safetensors", out, reference=path, mapping=wm)
    assert load_file(str(back))["params/layers/mlp/kernel"].tobytes() == k.tobytes()


def test_nnx_module_as_like(tmp_path, mesh8):
    from flax import nnx

    model = nnx.eval_shape(lambda: nnx.Linear(16, 8, rngs=nnx.Rngs(0)))
    w, b = rand((8, 16), np.float32), rand((8,), np.float32)
    path = _st(tmp_path / "m.safetensors", {"fc.weight": w, "fc.bias": b})
    wm = ms.WeightMap(
        [ms.MapRule(r"fc\.weight", "kernel", transpose=(1, 0)), ms.MapRule(r"fc\.bias", "bias")]
    )
    out = ms.load_safetensors(
        path, like=model, mapping=wm, specs=ms.fsdp("data", min_size=0), mesh=mesh8
    )
    assert isinstance(out, nnx.Linear)
    np.testing.assert_array_equal(np.asarray(out.kernel[...]), w.T)
    sharding = out.kernel[...].sharding
    assert isinstance(sharding, jax.sharding.NamedSharding) and sharding.spec == P("data")


# ---- validation --------------------------------------------------------------------------


def test_every_problem_is_listed_at_once_path_first(tmp_path):
    path = _st(
        tmp_path / "m.safetensors",
        {
            "a.weight": rand((4, 8), np.float32),
            "b.weight": rand((4, 8), ml_dtypes.bfloat16),
            "stray": rand((3,), np.float32),
        },
    )
    wm = ms.WeightMap(
        [
            ms.MapRule(r"a\.weight", "a/kernel", transpose=(1, 0)),
            ms.MapRule(r"b\.weight", "b/kernel"),
            ms.MapRule(r"never\.(\d+)", "x/{1}"),
        ],
        keep=["^nothing$"],
    )
    like = {
        "a": {"kernel": jax.ShapeDtypeStruct((4, 8), np.float32)},
        "b": {"kernel": jax.ShapeDtypeStruct((4, 8), np.float32)},
        "head": {"w": jax.ShapeDtypeStruct((2,), np.float32)},
    }
    with pytest.raises(ms.MappingError) as e:
        ms.load_safetensors(path, like=like, mapping=wm)
    lines = str(e.value).splitlines()
    assert lines[0].startswith("6 mapping problems found")
    text = "\n".join(lines)
    assert "  source:stray float32[3]\n    problem: no rule maps this stored tensor" in text
    assert (
        "  mapping:rules[2]\n    problem: source 'never\\\\.(\\\\d+)' matched no stored tensor"
        in text
    )
    assert (
        "  target:a/kernel float32[4, 8]\n    problem: the mapped value is float32[8, 4] but the "
        "target leaf is float32[4, 8] (from a.weight by rules[0]: transpose(1, 0))"
    ) in text
    assert "target:b/kernel float32[4, 8]\n    problem: the mapped value is bfloat16[4, 8]" in text
    assert "add cast = 'float32' to rules[1] or pass dtype=" in text
    assert "  target:head/w float32[2]\n    problem: no stored tensor maps to this leaf" in text
    assert (
        "  mapping:keep[0]\n    problem: keep pattern '^nothing$' matched no unmapped target leaf"
        in text
    )
    assert {p.arg for p in e.value.problems} == {"source", "target", "mapping"}
    assert isinstance(e.value, ValueError)


def test_stack_problems_name_missing_layers_and_values(tmp_path):
    path = _st(
        tmp_path / "m.safetensors",
        {
            "l.0.w": rand((2,), np.float32),
            "l.2.w": rand((2,), np.float32),
            "g.up": rand((2,), np.float32),
            "g.extra": rand((2,), np.float32),
            "t.0": rand((2, 2), np.float32),
        },
    )
    wm = ms.WeightMap(
        [
            ms.MapRule(r"l\.(\d+)\.w", "layers/w", stack=ms.Stack(1)),
            ms.MapRule(r"g\.(\w+)", "g", stack=ms.Stack(1, order=("gate", "up"))),
            ms.MapRule(r"t\.0", "t", transpose=(0, 1, 2)),
        ]
    )
    with pytest.raises(ms.MappingError) as e:
        ms.load_safetensors(path, mapping=wm)
    text = str(e.value)
    assert (
        "target:layers/w\n    problem: cannot stack by rules[0]: indices [1] are missing (found 2 tensors, 0..2)"
        in text
    )
    assert (
        "target:g\n    problem: cannot stack by rules[1]: missing 'gate'; not in the order: g.extra ('extra')"
        in text
    )
    assert (
        "source:t.0 float32[2, 2]\n    problem: transpose(0, 1, 2) is not a permutation of this tensor's 2 axes (rules[2])"
        in text
    )


def test_two_sources_to_one_target_and_a_target_the_like_lacks(tmp_path):
    path = _st(
        tmp_path / "m.safetensors", {"x.a": rand((2,), np.float32), "x.b": rand((2,), np.float32)}
    )
    wm = ms.WeightMap([ms.MapRule(r"x\.(a|b)", "x")])
    with pytest.raises(ms.MappingError, match=r"stored tensors x\.a, x\.b all map to this leaf"):
        ms.load_safetensors(path, mapping=wm)
    wm = ms.WeightMap([ms.MapRule(r"x\.(a|b)", "y/{1}")])
    like = {"y": {"a": jax.ShapeDtypeStruct((2,), np.float32)}}
    with pytest.raises(ms.MappingError) as e:
        ms.load_safetensors(path, like=like, mapping=wm)
    assert (
        "target:y/b\n    problem: rules[0] maps x.b here, but the target has no such leaf"
        in str(e.value)
    )


def test_malformed_rules_are_refused_when_built():
    with pytest.raises(ms.MappingError) as e:
        ms.WeightMap(
            [
                ms.MapRule("(", "x"),
                ms.MapRule(r"a\.(\d+)", "b/{2}/{name}"),
                ms.MapRule(r"a\.(\d+)", "b/{1}", stack=ms.Stack(1)),
                ms.MapRule(r"a", "b", unstack=ms.Unstack("layer")),
                ms.MapRule(r"a", None, transpose=(1, 0)),
                ms.MapRule(r"a", "b", cast="float33"),
            ]
        )
    text = str(e.value)
    assert "mapping:rules[0]\n    problem: source '(' is not a regex" in text
    assert "uses {2} but the source regex 'a\\\\.(\\\\d+)' has no group '2'" in text
    assert "uses {name}" in text
    assert "rules[2]\n    problem: the target 'b/{1}' uses the stacked group {1}" in text
    assert "rules[3]\n    problem: unstack key {layer} is not in the target 'b'" in text
    assert "rules[4]\n    problem: a skip rule (target None) takes no transforms" in text
    assert "rules[5]\n    problem: cast 'float33' is not a dtype name" in text


def test_reshape_config_names_and_bad_sizes(tmp_path):
    path = _st(
        tmp_path / "m.safetensors", {"w": rand((4, 6), np.float32), "v": rand((4, 6), np.float32)}
    )
    wm = ms.WeightMap(
        [ms.MapRule("w", "w", reshape=("heads", -1)), ms.MapRule("v", "v", reshape=("nope", 5))],
        config={"heads": 2},
    )
    with pytest.raises(ms.MappingError) as e:
        ms.load_safetensors(path, mapping=wm)
    assert str(e.value).count("problem:") == 1
    assert "reshape size 'nope' is not in the mapping's config (heads) (rules[1])" in str(e.value)
    wm = ms.WeightMap(
        [ms.MapRule("w", "w", reshape=("heads", -1)), ms.MapRule("v", "v", reshape=(5, -1))],
        config={"heads": 2},
    )
    with pytest.raises(ms.MappingError, match=r"cannot reshape \[4, 6\] to \(5, -1\)"):
        ms.load_safetensors(path, mapping=wm)
    wm = ms.WeightMap(
        [ms.MapRule("w", "w", reshape=("heads", -1)), ms.MapRule("v", None)], config={"heads": 2}
    )
    assert ms.load_safetensors(path, mapping=wm)["w"].shape == (2, 12)


def test_abstract_like_for_a_kept_leaf_is_an_error(tmp_path):
    path = _st(tmp_path / "m.safetensors", {"w": rand((2,), np.float32)})
    like = {
        "w": jax.ShapeDtypeStruct((2,), np.float32),
        "lora": jax.ShapeDtypeStruct((2,), np.float32),
    }
    wm = ms.WeightMap([ms.MapRule("w", "w")], keep=["lora"])
    with pytest.raises(
        ms.MappingError, match="kept \\(no stored tensor\\) but like holds no value"
    ):
        ms.load_safetensors(path, like=like, mapping=wm)


def _raw(path: Path, header: bytes, data: bytes = b"") -> Path:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def test_malformed_files_raise_checkpoint_errors(tmp_path):
    with pytest.raises(ms.CheckpointError, match="no such safetensors file"):
        ms.load_safetensors(tmp_path / "missing.safetensors")
    (tmp_path / "short.safetensors").write_bytes(b"abc")
    with pytest.raises(ms.CheckpointError, match="shorter than 8 bytes"):
        ms.load_safetensors(tmp_path / "short.safetensors")
    bad = _raw(tmp_path / "big.safetensors", b"{}")
    bad.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ms.CheckpointError, match="header length 1099511627776 does not fit"):
        ms.load_safetensors(bad)
    with pytest.raises(ms.CheckpointError, match="header is not JSON"):
        ms.load_safetensors(_raw(tmp_path / "j.safetensors", b"{nope"))
    h = {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]},
        "b": {"dtype": "I4", "shape": [2], "data_offsets": [0, 1]},
    }
    with pytest.raises(ms.CheckpointError) as e:
        ms.load_safetensors(_raw(tmp_path / "o.safetensors", json.dumps(h).encode(), b"\0" * 8))
    assert "2 unreadable tensor entries" in str(e.value)
    assert "  a: data_offsets [0, 8] do not hold F32[4]" in str(e.value)
    assert "  b: dtype 'I4' is not supported" in str(e.value)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "gone.safetensors"}})
    )
    with pytest.raises(
        ms.CheckpointError, match=r"gone\.safetensors: listed in the index, no such file"
    ):
        ms.load_safetensors(tmp_path / "model.safetensors.index.json")


def test_index_entries_outside_the_index_directory_are_refused(tmp_path):
    """``..``, absolute paths and links that point out are named, never read."""
    w = np.ones(4, np.float32)
    save_file({"secret": w}, str(tmp_path / "outside.safetensors"))
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file({"ok": w}, str(d / "ok.safetensors"))
    (d / "link.safetensors").symlink_to(tmp_path / "outside.safetensors")
    (d / "inner.safetensors").symlink_to("ok.safetensors")  # a link inside: fine
    index = d / "model.safetensors.index.json"
    absolute = str(tmp_path / "outside.safetensors")
    index.write_text(
        json.dumps(
            {
                "weight_map": {
                    "ok": "inner.safetensors",
                    "up": "../outside.safetensors",
                    "abs": absolute,
                    "linked": "link.safetensors",
                    "linked2": "link.safetensors",
                }
            }
        )
    )
    with pytest.raises(ms.CheckpointError) as e:
        ms.load_safetensors(index)
    assert str(e.value).splitlines() == [
        f"{index}: 3 problems in the index:",
        "  ../outside.safetensors: outside the index's directory (a path through '..'), "
        "named for up; refused",
        f"  {absolute}: outside the index's directory (an absolute path), named for abs; refused",
        "  link.safetensors: outside the index's directory (a link to "
        f"{(tmp_path / 'outside.safetensors').resolve()}), named for linked and 1 more; refused",
    ]
    index.write_text(json.dumps({"weight_map": {"ok": "inner.safetensors"}}))
    assert np.asarray(ms.load_safetensors(index)["ok"]).tolist() == [1.0] * 4


def test_index_and_files_that_disagree_name_the_tensor_and_both_files(tmp_path):
    w = np.ones(4, np.float32)
    save_file({"a": w, "b": w}, str(tmp_path / "m-1.safetensors"))
    save_file({"b": w, "c": w}, str(tmp_path / "m-2.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(
        '{"weight_map": {"a": "m-1.safetensors", "c": "m-1.safetensors", '
        '"b": "m-1.safetensors", "b": "m-2.safetensors"}}'  # one name twice in the JSON
    )
    with pytest.raises(ms.CheckpointError) as e:
        ms.load_safetensors(index)
    assert str(e.value).splitlines() == [
        f"{index}: 2 problems in the index:",
        "  b: the index puts it in two files, m-1.safetensors and m-2.safetensors",
        "  c: the index puts it in m-1.safetensors, which does not hold it",
    ]
    index.write_text(
        json.dumps(
            {"weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors", "c": "m-2.safetensors"}}
        )
    )
    with pytest.raises(ms.CheckpointError) as e:
        ms.load_safetensors(index)
    assert str(e.value).splitlines() == [
        f"{index}: 1 problem in the index:",
        "  b: held by two files, m-1.safetensors and m-2.safetensors",
    ]


def test_specs_without_a_mesh_is_an_error(tmp_path):
    path = _st(tmp_path / "m.safetensors", {"w": rand((2,), np.float32)})
    with pytest.raises(ms.CheckpointError, match=r"specs=\.\.\. needs mesh="):
        ms.load_safetensors(path, specs=P())


# ---- interop and files -------------------------------------------------------------------


def test_our_writer_is_read_by_the_safetensors_package(tmp_path):
    t = {
        "a": rand((3, 5), ml_dtypes.bfloat16),
        "b": np.arange(7, dtype=np.int8),
        "c": np.float32(2.5),
    }
    path = write_safetensors(
        tmp_path / "x.safetensors",
        [(k, np.shape(v), np.asarray(v).dtype) for k, v in t.items()],
        lambda k: np.asarray(t[k]),
        {"format": "np"},
    )
    got = load_file(str(path))
    for k, v in t.items():
        assert got[k].tobytes() == np.asarray(v).tobytes() and got[k].dtype == np.asarray(v).dtype
    assert open_safetensors(path).metadata == {"format": "np"}


def test_mapping_toml_file_equals_python(tmp_path):
    text = r"""
keep = ["^lora/"]
[config]
embed = 16
heads = 4

[[rules]]
source = 'model\.embed_tokens\.weight'
target = "embed/embedding"

[[rules]]
source = 'model\.layers\.(\d+)\.self_attn\.(q|k|v)_proj\.weight'
target = "layers/attn/{2}/kernel"
transpose = [1, 0]
reshape = ["embed", "heads", -1]
stack = { group = 1 }

[[rules]]
source = 'model\.layers\.(\d+)\.self_attn\.o_proj\.weight'
target = "layers/attn/o/kernel"
transpose = [1, 0]
stack = { group = 1 }

[[rules]]
source = 'model\.layers\.(?P<i>\d+)\.mlp\.(gate|up)_proj\.weight'
target = "layers/mlp/wi/{i}"
transpose = [1, 0]
stack = { group = 2, axis = 0, order = ["gate", "up"] }

[[rules]]
source = 'model\.layers\.(\d+)\.mlp\.down_proj\.weight'
target = "layers/mlp/wo/{1}"
transpose = [1, 0]

[[rules]]
source = 'model\.layers\.(\d+)\.input_layernorm\.weight'
target = "layers/norm/{1}"
cast = "float32"

[[rules]]
source = '.*\.rotary_emb\.inv_freq'
skip = true

[[rules]]
source = 'model\.norm\.weight'
target = "final_norm/scale"
cast = "float32"
"""
    (tmp_path / "map.toml").write_text(text)
    wm = load_weight_map(tmp_path / "map.toml")
    assert wm.rules == SCANNED.rules and wm.keep == SCANNED.keep and wm.config == SCANNED.config


def test_mapping_toml_problems_are_listed_at_once(tmp_path):
    with pytest.raises(ms.MappingError) as e:
        parse_weight_map(
            {
                "rulez": [],
                "keep": "lora",
                "rules": [
                    {"source": "a", "target": "b", "transpose": [1, "x"]},
                    {"source": "a", "skip": True, "target": "b"},
                    {"target": "b", "stack": {"axis": 0}},
                    {"source": "a", "target": "b", "unstack": {"key": 3}, "colour": 1},
                ],
            },
            "map.toml",
        )
    text = str(e.value)
    assert text.startswith("invalid mapping file map.toml:")
    for line in [
        "map.toml:rulez\n    problem: unknown top-level key 'rulez'",
        "map.toml:keep\n    problem: keep must be an array of regexes, got 'lora'",
        "map.toml:rules[0].transpose\n    problem: [1, 'x'] is not an array of integers",
        "map.toml:rules[1]\n    problem: a rule cannot have both target and skip = true",
        "map.toml:rules[2].source\n    problem: source must be a regex string, got None",
        "map.toml:rules[2].stack\n    problem: group is required",
        "map.toml:rules[3].colour\n    problem: unknown key 'colour'",
        "map.toml:rules[3].unstack.key\n    problem: 3 has the wrong type",
    ]:
        assert line in text
    (tmp_path / "bad.toml").write_text("rules = [")
    with pytest.raises(ms.MappingError, match="not valid TOML"):
        load_weight_map(tmp_path / "bad.toml")
    with pytest.raises(ms.MappingError, match="cannot read the mapping file"):
        load_weight_map(tmp_path / "none.toml")


def test_import_modelshard_does_not_import_safetensors():
    code = "import sys, modelshard\nprint('safetensors' in sys.modules)"
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:  # subprocess.run kills the child on timeout
        pytest.fail("import modelshard took over 120 s")
    assert out.stdout.strip() == "False", out.stderr


# ---- Orbax checkpoints through a mapping ---------------------------------------------------


def test_restore_with_mapping_renames_transposes_unstacks_and_keeps(tmp_path, mesh8):
    k = rand((3, 8, 16), np.float32)
    w = rand((16, 8), np.float32)
    ms.save(
        tmp_path / "ck",
        {"params": {"layers": {"kernel": jnp.asarray(k)}, "out": {"w": jnp.asarray(w)}}},
    )
    wm = ms.WeightMap(
        [
            ms.MapRule(r"params/layers/kernel", "blocks/{i}/kernel", unstack=ms.Unstack("i")),
            ms.MapRule(r"params/out/w", "head/kernel", transpose=(1, 0)),
        ],
        keep=["^lora$"],
    )
    like = {
        "blocks": {str(i): {"kernel": jax.ShapeDtypeStruct((8, 16), np.float32)} for i in range(3)},
        "head": {"kernel": jax.ShapeDtypeStruct((8, 16), np.float32)},
        "lora": jnp.full((2,), 7.0),
    }
    out = ms.restore(
        tmp_path / "ck", like=like, mapping=wm, specs=ms.fsdp("data", min_size=0), mesh=mesh8
    )
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(out["blocks"][str(i)]["kernel"]), k[i])
        assert out["blocks"][str(i)]["kernel"].sharding.spec == P(None, "data")  # largest dim
    np.testing.assert_array_equal(np.asarray(out["head"]["kernel"]), w.T)
    np.testing.assert_array_equal(np.asarray(out["lora"]), 7.0)
    back = ms.unmap(
        out,
        reference=jax.eval_shape(lambda: {"params": {"layers": {"kernel": k}, "out": {"w": w}}}),
        mapping=wm,
    )
    assert back["params"]["layers"]["kernel"].tobytes() == k.tobytes()
    assert back["params"]["out"]["w"].tobytes() == w.tobytes()


def test_restore_with_mapping_renames_read_straight_into_the_sharding(tmp_path, mesh8, monkeypatch):
    import importlib

    mapped = importlib.import_module("modelshard._checkpoint.mapped")
    ms.save(tmp_path / "ck", {"a": jnp.arange(16.0), "b": jnp.ones((8, 2), jnp.bfloat16)})
    reads: list[list[str]] = []
    real = mapped.read_verified
    monkeypatch.setattr(
        mapped, "read_verified", lambda s, t, verify: reads.append(sorted(t)) or real(s, t, verify)
    )
    wm = ms.WeightMap([ms.MapRule("a", "x/a"), ms.MapRule("b", "x/b", cast="float32")])
    out = ms.restore(tmp_path / "ck", mapping=wm, specs=ms.fsdp("data", min_size=0), mesh=mesh8)
    assert reads == [["a", "b"]]  # one Orbax read of both, into their target shardings
    assert out["x"]["a"].sharding.spec == P("data") and out["x"]["b"].dtype == np.float32


def test_restore_with_mapping_reports_every_problem(tmp_path):
    ms.save(tmp_path / "ck", {"a": jnp.ones(4), "b": jnp.ones(3)})
    like = {
        "a": jax.ShapeDtypeStruct((4,), np.float32),
        "c": jax.ShapeDtypeStruct((3,), np.float32),
    }
    with pytest.raises(ms.MappingError) as e:
        ms.restore(tmp_path / "ck", like=like, mapping=ms.WeightMap([ms.MapRule("a", "a")]))
    text = str(e.value)
    assert "  source:b float32[3]\n    problem: no rule maps this stored tensor" in text
    assert "  target:c float32[3]\n    problem: no stored tensor maps to this leaf" in text


# ---- the command line ----------------------------------------------------------------------


def test_cli_inspect_safetensors_table_and_json(tmp_path, capsys, monkeypatch):
    from modelshard.cli import main

    monkeypatch.setenv("COLUMNS", "200")
    path = _st(tmp_path / "model.safetensors", _llama_tensors())
    assert main(["inspect", str(path), "--max-rows", "3"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0.mlp.up_proj.weight" not in out and "... 26 more tensors" in out
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "│ model.layers.0.mlp.up_proj.weight " in out and "BF16" in out
    assert main(["inspect", str(tmp_path), "--json"]) == 0  # the directory holding it
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["format"] == "safetensors"
    t = next(t for t in data["tensors"] if t["name"] == "model.layers.0.mlp.up_proj.weight")
    assert t == {
        "name": t["name"],
        "shape": [FF, D],
        "dtype": "BF16",
        "bytes": FF * D * 2,
        "file": "model.safetensors",
    }


def test_cli_convert_to_a_checkpoint_and_back(tmp_path, capsys, monkeypatch):
    from modelshard.cli import main

    assert jax.device_count() == 8  # JAX started by the suite, as a convert process would
    monkeypatch.setenv("COLUMNS", "200")
    src = _llama_tensors()
    path = _st(tmp_path / "model.safetensors", src)
    toml = Path(__file__).parents[2] / "examples" / "mappings" / "hf_llama.toml"
    # the shipped mapping does not fit these tensors (no lm_head, other sizes): every
    # problem is listed, exit status 1
    assert main(["convert", str(path), str(tmp_path / "x"), "--mapping", str(toml)]) == 1
    err = capsys.readouterr().err
    assert (
        "mapping:rules[8]" in err and "source 'lm_head\\\\.weight' matched no stored tensor" in err
    )
    assert not (tmp_path / "x").exists()
    # no mapping: every tensor under its own name ('.' read as '/'), FSDP rules from a file
    (tmp_path / "rules.toml").write_text(
        '[[rules]]\npattern = "weight$"\nspec = ["data"]\n[[rules]]\npattern = ".*"\nspec = []\n'
    )
    args = [
        "convert",
        str(path),
        str(tmp_path / "ck"),
        "--mesh",
        "data=8",
        "--rules",
        str(tmp_path / "rules.toml"),
    ]
    assert main([*args, "--dry-run"]) == 0
    assert "model/layers/0/mlp/up_proj/weight" in capsys.readouterr().out
    assert not (tmp_path / "ck").exists()
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["leaves"] == len(src)
    state = ms.restore(tmp_path / "ck")
    assert state["model"]["layers"]["1"]["mlp"]["up_proj"]["weight"].sharding.spec == P("data")
    # and back: the same names, shapes, dtypes and bytes
    assert (
        main(
            [
                "convert",
                str(tmp_path / "ck"),
                str(tmp_path / "back.safetensors"),
                "--to",
                "safetensors",
            ]
        )
        == 0
    )
    back = load_file(str(tmp_path / "back.safetensors"))
    assert sorted(back) == sorted(src)
    assert all(
        back[k].tobytes() == v.tobytes() and back[k].dtype == v.dtype for k, v in src.items()
    )


def test_two_varying_groups_under_one_stack_are_named():
    wm = ms.WeightMap([ms.MapRule(r"l\.(\d+)\.(gate|up)", "mlp/wi", stack=ms.Stack(1))])
    table = {f"l.{i}.{n}": ((2,), np.float32) for i in range(2) for n in ("gate", "up")}
    from modelshard._weights import resolve

    with pytest.raises(ms.MappingError) as e:
        resolve(wm, table, None)
    assert str(e.value).count("problem:") == 2
    assert (
        "target:mlp/wi\n    problem: stored tensors l.0.gate, l.0.up all map to this leaf, both at stack index '0'"
        in str(e.value)
    )
