"""Loading and exporting through ops (``_weights/load.py``): ``also`` rules (tied embeddings),
keep patterns and abstract ``like``, the shipped Llama files, the dry-run table."""

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
from safetensors.numpy import load_file

import modelshard as ms
from helpers import llama_of_size, save_tensors, tied_checkpoint

ROOT = Path(__file__).parents[2]


BF16 = ml_dtypes.bfloat16


RNG = np.random.default_rng(7)


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


def test_also_fills_a_second_leaf_and_the_export_writes_the_tensor_once(tmp_path: Path) -> None:
    path, t, wm = tied_checkpoint(tmp_path)
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
    path, t, wm = tied_checkpoint(tmp_path)
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


def test_llama_with_tied_embeddings_into_the_nnx_example(tmp_path: Path) -> None:
    """``examples/mappings/hf_llama_tied.toml``: a checkpoint without ``lm_head.weight``
    into the example's NNX Llama (a head kernel of its own): logits as the NumPy reference
    computes them with the head tied, and exported back to the original bytes."""
    from flax import nnx

    ex = _llama_example()
    t = ex.hf_checkpoint(tmp_path / "full.safetensors", layers=1)
    del t["lm_head.weight"]
    src = save_tensors(tmp_path / "model.safetensors", t)
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
    path = save_tensors(tmp_path / "m.safetensors", {"w": np.zeros((4, 4), np.float32)})
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


def test_a_unit_axis_and_a_merge_load_and_export(tmp_path: Path) -> None:
    w = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    path = save_tensors(tmp_path / "m.safetensors", {"w": w})
    wm = ms.WeightMap([ms.MapRule("w", "w", ops=[ms.Rearrange("a b c -> () c (a b)")])])
    out = ms.load_safetensors(path, mapping=wm)
    assert np.asarray(out["w"]).tobytes() == w.transpose(2, 0, 1).reshape(1, 4, 6).tobytes()
    back = ms.save_safetensors(tmp_path / "b.safetensors", out, reference=path, mapping=wm)
    assert back.read_bytes() == path.read_bytes()


def test_untie_into_a_container_reference_names_the_tensor_without_a_leaf(
    tmp_path: Path,
) -> None:
    path, t, wm = tied_checkpoint(tmp_path)
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


@pytest.mark.parametrize("name", ["hf_llama.toml", "hf_llama_tied.toml"])
def test_the_llama_files_load_a_checkpoint_without_inv_freq_and_reload_their_export(
    tmp_path: Path, name: str
) -> None:
    """A checkpoint as current transformers writes it (no inv_freq) loads with the shipped
    files; an older one's export drops inv_freq, and that export loads back too."""
    mapping = ROOT / "examples" / "mappings" / name
    t = llama_of_size(tmp_path, 32, 8, 2, 4, inv_freq=True)
    if name == "hf_llama_tied.toml":
        del t["lm_head.weight"]
        save_tensors(tmp_path / "model.safetensors", t)
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


def test_the_dry_run_table_reads_as_words_in_target_order(tmp_path: Path) -> None:
    t: dict[str, np.ndarray] = {
        f"l.{i}.{n}": np.zeros((4, 2), np.float32) for i in range(11) for n in ("up", "gate")
    }
    t["rot.inv_freq"] = np.zeros(2, np.float32)
    path = save_tensors(tmp_path / "m.safetensors", t)
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
