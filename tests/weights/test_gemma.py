"""The example Hugging Face Gemma 3 mapping (``examples/mappings/hf_gemma3.toml``) into the
layout of Google's official Gemma 3 checkpoint files (``transformer/layer_N/...``), built
from shapes: loaded onto a mesh, checked against the same projections computed from the
stored tensors, and exported back to the original file's bytes; one mapping file for two
sizes (head counts from ``config.json``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

import modelshard as ms

MAPPING = Path(__file__).parents[2] / "examples" / "mappings" / "hf_gemma3.toml"
BF16 = ml_dtypes.bfloat16

# two sizes of one family: (embed, heads, kv_heads, head_dim, ffw, layers, vocab)
SMALL = (32, 4, 1, 8, 48, 2, 64)
WIDER = (48, 6, 2, 16, 64, 1, 96)


def _config(size: tuple[int, ...]) -> dict[str, Any]:
    e, h, k, d, f, n, v = size
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": e,
        "num_attention_heads": h,
        "num_key_value_heads": k,
        "head_dim": d,
        "intermediate_size": f,
        "num_hidden_layers": n,
        "vocab_size": v,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    }


def _hf_checkpoint(root: Path, size: tuple[int, ...], seed: int = 0) -> dict[str, np.ndarray]:
    """A Gemma 3 checkpoint as transformers writes it: bf16, [out, in], no lm_head (tied),
    with its config.json."""
    e, h, k, d, f, n, v = size
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(BF16)

    t = {"model.embed_tokens.weight": w(v, e), "model.norm.weight": w(e)}
    for i in range(n):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = w(h * d, e)
        t[p + "self_attn.k_proj.weight"] = w(k * d, e)
        t[p + "self_attn.v_proj.weight"] = w(k * d, e)
        t[p + "self_attn.o_proj.weight"] = w(e, h * d)
        t[p + "self_attn.q_norm.weight"] = w(d)
        t[p + "self_attn.k_norm.weight"] = w(d)
        t[p + "mlp.gate_proj.weight"] = w(f, e)
        t[p + "mlp.up_proj.weight"] = w(f, e)
        t[p + "mlp.down_proj.weight"] = w(e, f)
        for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            t[p + f"{norm}_layernorm.weight"] = w(e)
    root.mkdir(parents=True, exist_ok=True)
    save_file(t, str(root / "model.safetensors"), metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps(_config(size)))
    return t


def _gemma_layout(size: tuple[int, ...], dtype: Any = BF16) -> dict[str, Any]:
    """The parameter tree of Google's Gemma ``Transformer`` (``transformer/layer_N/...``),
    from shapes alone: q_einsum [H, E, D], kv_einsum [2, K, E, D], attn_vec_einsum
    [H, D, E], gating_einsum [2, F, E], linear [F, E]."""
    e, h, k, d, f, n, v = size

    def s(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype)

    tree: dict[str, Any] = {"embedder": {"input_embedding": s(v, e)}}
    for i in range(n):
        tree[f"layer_{i}"] = {
            "attn": {
                "q_einsum": {"w": s(h, e, d)},
                "kv_einsum": {"w": s(2, k, e, d)},
                "attn_vec_einsum": {"w": s(h, d, e)},
                "_query_norm": {"scale": s(d)},
                "_key_norm": {"scale": s(d)},
            },
            "mlp": {"gating_einsum": {"w": s(2, f, e)}, "linear": {"w": s(f, e)}},
            **{
                f"{norm}_norm": {"scale": s(e)}
                for norm in ("pre_attention", "post_attention", "pre_ffw", "post_ffw")
            },
        }
    tree["final_norm"] = {"scale": s(e)}
    return {"transformer": tree}


# tensor parallel over "model" (heads / ffw), FSDP over "data" (embed)
RULES = ms.Rules(
    [
        (r"q_einsum/w$", P("model", "data", None)),
        (r"kv_einsum/w$", P(None, None, "data", None)),
        (r"attn_vec_einsum/w$", P("model", None, "data")),
        (r"gating_einsum/w$", P(None, "model", "data")),
        (r"linear/w$", P("model", "data")),
        (r"input_embedding$", P("model", "data")),
        (r".*", P()),
    ]
)


@pytest.mark.parametrize("size", [SMALL, WIDER], ids=["small", "wider"])
def test_gemma3_loads_into_googles_layout_and_exports_the_original_bytes(
    tmp_path: Path, size: tuple[int, ...]
) -> None:
    e, h, k, d, f, _, _ = size
    t = _hf_checkpoint(tmp_path / "hf", size)
    src = tmp_path / "hf" / "model.safetensors"
    mesh = ms.make_mesh({"data": 2, "model": 2})
    like = _gemma_layout(size)
    params = ms.load_safetensors(src, like=like, mapping=MAPPING, specs=RULES, mesh=mesh)

    tr = params["transformer"]
    layer = tr["layer_0"]
    assert layer["attn"]["q_einsum"]["w"].shape == (h, e, d)
    assert layer["attn"]["q_einsum"]["w"].sharding.spec == P("model", "data", None)
    assert layer["attn"]["kv_einsum"]["w"].shape == (2, k, e, d)
    assert layer["mlp"]["gating_einsum"]["w"].shape == (2, f, e)

    # the einsums of Google's code on the loaded kernels give what transformers computes
    # from the stored tensors (x @ W.T, heads split off the output features)
    x = np.random.default_rng(1).standard_normal((3, e)).astype(np.float32)
    f32 = {name: a.astype(np.float32) for name, a in t.items()}
    p = "model.layers.0."
    q = np.einsum("te,hed->thd", x, np.asarray(layer["attn"]["q_einsum"]["w"], np.float32))
    np.testing.assert_allclose(
        q, (x @ f32[p + "self_attn.q_proj.weight"].T).reshape(3, h, d), rtol=1e-5, atol=1e-5
    )
    kv = np.einsum("te,cked->ctkd", x, np.asarray(layer["attn"]["kv_einsum"]["w"], np.float32))
    for c, name in enumerate(("k_proj", "v_proj")):
        want = (x @ f32[p + f"self_attn.{name}.weight"].T).reshape(3, k, d)
        np.testing.assert_allclose(kv[c], want, rtol=1e-5, atol=1e-5)
    heads = np.random.default_rng(2).standard_normal((3, h, d)).astype(np.float32)
    o = np.einsum("thd,hde->te", heads, np.asarray(layer["attn"]["attn_vec_einsum"]["w"], "f4"))
    want = heads.reshape(3, h * d) @ f32[p + "self_attn.o_proj.weight"].T
    np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-5)
    gate_up = np.einsum("te,cfe->ctf", x, np.asarray(layer["mlp"]["gating_einsum"]["w"], "f4"))
    np.testing.assert_allclose(gate_up[0], x @ f32[p + "mlp.gate_proj.weight"].T, atol=1e-5)
    np.testing.assert_allclose(gate_up[1], x @ f32[p + "mlp.up_proj.weight"].T, atol=1e-5)
    hidden = np.random.default_rng(3).standard_normal((3, f)).astype(np.float32)
    np.testing.assert_allclose(
        hidden @ np.asarray(layer["mlp"]["linear"]["w"], np.float32),
        hidden @ f32[p + "mlp.down_proj.weight"].T,
        rtol=1e-5,
        atol=1e-5,
    )
    norm = np.asarray(layer["attn"]["_key_norm"]["scale"])
    assert norm.tobytes() == t[p + "self_attn.k_norm.weight"].tobytes()
    assert np.asarray(tr["final_norm"]["scale"]).tobytes() == t["model.norm.weight"].tobytes()

    # import then export gives the original file's bytes
    out = ms.save_safetensors(tmp_path / "out.safetensors", params, reference=src, mapping=MAPPING)
    assert out.read_bytes() == src.read_bytes()


def test_gemma3_through_float32_exports_the_original_bytes(tmp_path: Path) -> None:
    """A bf16 checkpoint into a float32 model (``dtype="float32"``) and back: exact."""
    _hf_checkpoint(tmp_path / "hf", SMALL, seed=5)
    src = tmp_path / "hf" / "model.safetensors"
    like = _gemma_layout(SMALL, np.float32)
    params = ms.load_safetensors(src, like=like, mapping=MAPPING, dtype="float32")
    assert params["transformer"]["layer_1"]["attn"]["q_einsum"]["w"].dtype == np.float32
    out = ms.save_safetensors(
        tmp_path / "out.safetensors", params, reference=src, mapping=MAPPING, dtype="float32"
    )
    assert out.read_bytes() == src.read_bytes()


def test_gemma3_head_counts_come_from_config_json(tmp_path: Path) -> None:
    """Without config.json the mapping cannot split the heads, and says which size is
    missing; a [config] in the mapping wins over config.json."""
    _hf_checkpoint(tmp_path / "hf", SMALL)
    src = tmp_path / "hf" / "model.safetensors"
    (tmp_path / "hf" / "config.json").unlink()
    with pytest.raises(ms.MappingError) as info:
        ms.load_safetensors(src, like=_gemma_layout(SMALL), mapping=MAPPING, dry_run=True)
    text = info.value.report()
    assert (
        "    problem: rearrange size 'num_attention_heads' is not in the mapping's config "
        "(empty) (rules[1])" in text.splitlines()
    )

    (tmp_path / "hf" / "config.json").write_text(json.dumps(_config(SMALL)))
    wrong = ms.load_weight_map(MAPPING)
    wrong = ms.WeightMap(wrong.rules, config={"num_attention_heads": 2})  # explicit wins
    with pytest.raises(ms.MappingError) as info, pytest.warns(UserWarning) as caught:
        ms.load_safetensors(src, like=_gemma_layout(SMALL), mapping=wrong, dry_run=True)
    assert [str(w.message) for w in caught] == [
        "the mapping's config sets num_attention_heads = 2, but config.json has "
        "num_attention_heads = 4; using the mapping's 2 (remove num_attention_heads from the "
        "mapping's config to take config.json's)"
    ]
    lines = info.value.report().splitlines()
    assert (
        "    problem: the mapped value is bfloat16[2, 32, 16] but the target leaf is "
        "bfloat16[4, 32, 8] (from model.layers.0.self_attn.q_proj.weight by rules[1]: "
        "rearrange((h d) e -> h e d, h=num_attention_heads))" in lines
    )


def test_gemma3_through_the_cli_both_ways(tmp_path: Path) -> None:
    """``modelshard convert`` with the shipped mapping (head counts from config.json) into
    a checkpoint laid out for a mesh, and back to the original file's bytes."""
    from modelshard.cli import main

    _hf_checkpoint(tmp_path / "hf", SMALL, seed=3)
    src = tmp_path / "hf" / "model.safetensors"
    ck, back = tmp_path / "ck", tmp_path / "back.safetensors"
    assert main(["convert", str(src), str(ck), "--mapping", str(MAPPING), "--mesh", "data=4"]) == 0
    restored = ms.restore(ck)
    q = np.asarray(restored["transformer"]["layer_1"]["attn"]["q_einsum"]["w"])
    e, h, _, d, _, _, _ = SMALL
    assert q.shape == (h, e, d)
    args = ["convert", str(ck), str(back), "--to", "safetensors", "--mapping", str(MAPPING)]
    assert main([*args, "--reference", str(src)]) == 0
    assert back.read_bytes() == src.read_bytes()


def test_gemma3_multimodal_checkpoint_loads_its_language_model(tmp_path: Path) -> None:
    """Gemma3ForConditionalGeneration (4b and up) stores the language model under
    ``language_model.model.`` with its sizes in ``text_config``, beside a vision tower and
    a projector: the same file loads the language model into the same tree as the text-only
    checkpoint, skips the rest, and exports the language model back in the multimodal names."""
    t = _hf_checkpoint(tmp_path / "text", SMALL, seed=4)
    mm = {f"language_model.{k}": v for k, v in t.items()}
    extra = {
        "vision_tower.vision_model.embeddings.patch_embedding.weight": np.ones((8, 3, 2, 2), BF16),
        "multi_modal_projector.mm_input_projection_weight": np.ones((8, 32), BF16),
    }
    (tmp_path / "mm").mkdir()
    src = tmp_path / "mm" / "model.safetensors"
    save_file({**mm, **extra}, str(src), metadata={"format": "pt"})
    text_config = {k: v for k, v in _config(SMALL).items() if k != "architectures"}
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": text_config,
        "vision_config": {"num_attention_heads": 16, "hidden_size": 1152},
    }
    (tmp_path / "mm" / "config.json").write_text(json.dumps(config))

    like = _gemma_layout(SMALL)
    res = ms.load_safetensors(src, like=like, mapping=MAPPING, dry_run=True)
    assert sorted(res.skipped) == sorted(extra)
    params = ms.load_safetensors(src, like=like, mapping=MAPPING)
    plain = ms.load_safetensors(tmp_path / "text" / "model.safetensors", like=like, mapping=MAPPING)
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    want = dict(jax.tree_util.tree_flatten_with_path(plain)[0])
    assert len(flat) == len(want)
    for path, leaf in flat:
        assert np.asarray(leaf).tobytes() == np.asarray(want[path]).tobytes(), path
    out = ms.save_safetensors(tmp_path / "out.safetensors", params, reference=src, mapping=MAPPING)
    from safetensors.numpy import load_file

    back = load_file(str(out))
    assert sorted(back) == sorted(mm)  # the vision tower and projector are not written
    assert all(back[k].tobytes() == v.tobytes() for k, v in mm.items())
