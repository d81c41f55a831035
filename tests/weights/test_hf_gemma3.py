"""Gemma 3 against transformers, onto the tree Google's ``gemma`` models take:
``Gemma3ForCausalLM.save_pretrained`` loads through the shipped ``mapping="gemma3"`` into
``model.init(...)["params"]`` of a ``gm.nn`` Gemma 3 transformer, gemma's forward pass on it
gives torch's logits, and a changed model exports as a directory that ``from_pretrained``
loads with no missing or unexpected keys and the same logits, still tied.

The ``gemma`` package is not a test dependency: it pulls TensorFlow (kauldron imports it
unconditionally; loading it beside torch aborts the process on a clash of LLVM options) and
its import costs minutes of a loaded CI machine. So the tree and the forward pass below are
written from gemma's source (gemma 4.0.1, ``gemma/gm/nn``), line for line:

- ``_modules.Embedder``: ``embedder/input_embedding`` [vocab, embed]; ``encode`` multiplies
  by ``sqrt(embed)``, ``decode`` is ``x @ table.T`` (always tied).
- ``_modules.Attention`` (``use_qk_norm``, no ``qkv_einsum`` when kv heads != heads):
  ``attn/q_einsum/w`` [heads, embed, head_dim] (``BTD,NDH->BTNH``), ``attn/kv_einsum/w``
  [2, kv_heads, embed, head_dim] (``BSD,CKDH->CBSKH``), ``attn/attn_vec_einsum/w``
  [heads, head_dim, embed] (``BTNH,NHD->BTD``), ``attn/{_query,_key}_norm/scale`` [head_dim];
  q/k norm, then RoPE (local or global base frequency), then q scaled by
  ``query_pre_attn_scalar``; a sliding layer also masks ``|q - k| >= window``.
- ``_modules.FeedForward`` with ``transpose_gating_einsum`` (every Gemma 3): its einsums
  share the module's scope, so ``mlp/gating_einsum`` [2, ffw, embed] (``...F,NHF->...NH``)
  and ``mlp/linear`` [ffw, embed], no ``/w``; ``gelu(gate) * up`` (tanh approximation).
- ``_modules.Block``: ``{pre,post}_attention_norm``, ``{pre,post}_ffw_norm``;
  ``_transformer.Transformer``: ``final_norm``. ``_layers.RMSNorm``: ``x * rsqrt(mean(x²) +
  1e-6) * (1 + scale)``.

Checked once beside this suite against gemma 4.0.1 itself (its ``Transformer`` with this
test's sizes, float32): ``gemma_params`` is ``model.init``'s tree leaf for leaf, and on the
tree loaded here ``gemma_logits`` is within 9.6e-7 of gemma's ``model.apply``, whose logits
are within 1.2e-6 of torch's.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import modelshard as ms
from hf_family import (
    TOL,
    assert_clean,
    reload,
    stored_names,
    torch,
    torch_model,
    transformers,
    write_pretrained,
)

# no token 0: gemma reads it as padding (masked, positions skip it), transformers does not
IDS = np.array([[1, 5, 9, 2, 7, 3, 11, 4], [8, 6, 13, 12, 3, 3, 10, 1]], np.int32)


def torch_logits(model: Any) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(IDS, dtype=torch.long)).logits.float().numpy()


@dataclasses.dataclass(frozen=True)
class Gemma3:
    """The ``gm.nn`` ``TransformerConfig`` fields a Gemma 3 text model uses."""

    num_embed: int
    embed_dim: int
    hidden_dim: int
    num_heads: int
    head_dim: int
    num_kv_heads: int
    sliding: tuple[bool, ...]  # per layer: LOCAL_SLIDING (True) or GLOBAL
    sliding_window_size: int
    local_base_frequency: float
    global_base_frequency: float
    query_pre_attn_scalar: float

    @classmethod
    def of(cls, config: Any) -> Gemma3:
        rope = config.rope_parameters
        return cls(
            num_embed=config.vocab_size,
            embed_dim=config.hidden_size,
            hidden_dim=config.intermediate_size,
            num_heads=config.num_attention_heads,
            head_dim=config.head_dim,
            num_kv_heads=config.num_key_value_heads,
            sliding=tuple(t == "sliding_attention" for t in config.layer_types),
            sliding_window_size=config.sliding_window,
            local_base_frequency=rope["sliding_attention"]["rope_theta"],
            global_base_frequency=rope["full_attention"]["rope_theta"],
            query_pre_attn_scalar=config.query_pre_attn_scalar**-0.5,
        )


def gemma_params(c: Gemma3) -> dict[str, Any]:
    """``model.init(...)["params"]`` of a ``gm.nn`` Gemma 3 transformer, as shapes (float32)."""

    def s(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    e, h, k, d, f = c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_dim
    tree: dict[str, Any] = {"embedder": {"input_embedding": s(c.num_embed, e)}}
    for i in range(len(c.sliding)):
        tree[f"layer_{i}"] = {
            "attn": {
                "q_einsum": {"w": s(h, e, d)},
                "kv_einsum": {"w": s(2, k, e, d)},
                "attn_vec_einsum": {"w": s(h, d, e)},
                "_query_norm": {"scale": s(d)},
                "_key_norm": {"scale": s(d)},
            },
            "mlp": {"gating_einsum": s(2, f, e), "linear": s(f, e)},
            **{
                f"{n}_norm": {"scale": s(e)}
                for n in ("pre_attention", "post_attention", "pre_ffw", "post_ffw")
            },
        }
    tree["final_norm"] = {"scale": s(e)}
    return tree


def _norm(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + 1e-6) * (1 + p["scale"])


def _rope(x: jax.Array, base: float) -> jax.Array:
    d = x.shape[-1]
    timescale = base ** ((2.0 / d) * jnp.arange(d // 2, dtype=jnp.float32))
    angle = (jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] / timescale)[None, :, None, :]
    first, second = jnp.split(x, 2, axis=-1)
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def gemma_logits(params: dict[str, Any], c: Gemma3, ids: np.ndarray) -> np.ndarray:
    """gemma's ``Transformer.__call__`` without cache, images or padding, on ``params``."""
    table = params["embedder"]["input_embedding"]
    x = table[jnp.asarray(ids)] * jnp.sqrt(c.embed_dim).astype(table.dtype)
    seq = ids.shape[1]
    pos = jnp.arange(seq)
    causal = pos[None, :] <= pos[:, None]
    window = jnp.abs(pos[None, :] - pos[:, None]) < c.sliding_window_size
    groups = c.num_heads // c.num_kv_heads
    for i, sliding in enumerate(c.sliding):
        p = params[f"layer_{i}"]
        a = p["attn"]
        h = _norm(x, p["pre_attention_norm"])
        q = jnp.einsum("BTD,NDH->BTNH", h, a["q_einsum"]["w"])
        k, v = jnp.einsum("BSD,CKDH->CBSKH", h, a["kv_einsum"]["w"])
        q, k = _norm(q, a["_query_norm"]), _norm(k, a["_key_norm"])
        base = c.local_base_frequency if sliding else c.global_base_frequency
        q = _rope(q, base) * c.query_pre_attn_scalar
        k = _rope(k, base)
        b = q.shape[0]
        q = q.reshape(b, seq, c.num_kv_heads, groups, c.head_dim)
        logits = jnp.einsum("BTKGH,BSKH->BTKGS", q, k).reshape(b, seq, c.num_heads, seq)
        mask = causal & window if sliding else causal
        probs = jax.nn.softmax(jnp.where(mask[None, :, None, :], logits, -2.3819763e38), -1)
        probs = probs.reshape(b, seq, c.num_kv_heads, groups, seq)
        encoded = jnp.einsum("BTKGS,BSKH->BTKGH", probs, v).reshape(b, seq, -1, c.head_dim)
        out = jnp.einsum("BTNH,NHD->BTD", encoded, a["attn_vec_einsum"]["w"])
        x = x + _norm(out, p["post_attention_norm"])
        h = _norm(x, p["pre_ffw_norm"])
        gate = jnp.einsum("...F,NHF->...NH", h, p["mlp"]["gating_einsum"])
        h = jax.nn.gelu(gate[..., 0, :]) * gate[..., 1, :]
        h = jnp.einsum("...H,HF->...F", h, p["mlp"]["linear"])
        x = x + _norm(h, p["post_ffw_norm"])
    return np.asarray(jnp.dot(_norm(x, params["final_norm"]), table.T), np.float32)


def test_gemma3_round_trips_through_transformers_onto_the_gemma_model_tree(tmp_path) -> None:
    config = transformers.Gemma3TextConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=4,  # shorter than IDS: the local layer's mask matters
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    model = torch_model(transformers.Gemma3ForCausalLM, config)
    d = write_pretrained(model, tmp_path / "hf")
    assert "lm_head.weight" not in stored_names(d)  # tied, as every Gemma 3
    c = Gemma3.of(config)

    params = ms.load_safetensors(d, like=gemma_params(c), mapping="gemma3")
    want = jax.tree.map(lambda x: (x.shape, x.dtype), gemma_params(c))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), params) == want
    np.testing.assert_allclose(gemma_logits(params, c, IDS), torch_logits(model), atol=TOL, rtol=0)

    changed = jax.tree.map(lambda x: x * 1.05 + 0.01, params)  # a fine-tuning step
    out = tmp_path / "out"
    written = ms.save_safetensors(out, changed, reference=d, mapping="gemma3")
    assert written == out / "model.safetensors"
    assert stored_names(out) == stored_names(d)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (d / name).read_bytes()
    back, info = reload(out, transformers.AutoModelForCausalLM)
    assert_clean(info)
    np.testing.assert_allclose(torch_logits(back), gemma_logits(changed, c, IDS), atol=TOL, rtol=0)
    assert back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()
