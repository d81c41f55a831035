"""Pretrained weights in and out: a Hugging Face Llama-style safetensors checkpoint loaded
into an NNX model laid out for tensor parallelism, checked against a NumPy reference, and
written back in the checkpoint's own names, shapes and dtypes.

1. Write a small checkpoint with ``safetensors.numpy`` in the standard names
   (``model.layers.N.self_attn.q_proj.weight``, PyTorch's ``[out, in]`` linear layout,
   bfloat16) and its ``config.json``, the way ``transformers`` saves one. Nothing is
   downloaded.
2. Load it with the shipped mapping file ``mappings/hf_llama.toml`` (its sizes from the
   ``config.json``: the same file serves every Llama size) into an NNX Llama whose
   attention kernels are ``[embed, heads, head_dim]`` einsum weights and whose gate and up
   projections are one ``[2, embed, mlp]`` weight; every device reads only its slice of
   each stored tensor. The model adds LoRA adapters on its head that the checkpoint does
   not have: the mapping's ``keep`` lets them keep their initial values.
3. Compare the logits with a NumPy implementation of the same architecture that reads the
   checkpoint's tensors as they are.
4. Export the model back to safetensors with the same mapping and compare bytes.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import json
import tempfile
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from _common import console
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

import modelshard as ms

MAPPING = Path(__file__).parent / "mappings" / "hf_llama.toml"
VOCAB, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP, EPS = 128, 64, 4, 2, 16, 128, 1e-5


# ---- the NNX model ---------------------------------------------------------------------


def rope(x: Any, xp: Any = jnp) -> Any:
    """Rotary embeddings, Llama's "rotate half" form, on ``[batch, seq, heads, head_dim]``."""
    seq, half = x.shape[1], x.shape[-1] // 2
    freq = 1.0 / (10000.0 ** (xp.arange(half, dtype=xp.float32) / half))
    angle = xp.arange(seq, dtype=xp.float32)[:, None] * freq[None, :]
    cos = xp.concatenate([xp.cos(angle)] * 2, axis=-1)[None, :, None, :]
    sin = xp.concatenate([xp.sin(angle)] * 2, axis=-1)[None, :, None, :]
    rotated = xp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


class Attention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.q = nnx.Einsum("btd,dhk->bthk", (EMBED, HEADS, HEAD_DIM), rngs=rngs)
        self.k = nnx.Einsum("btd,dhk->bthk", (EMBED, KV_HEADS, HEAD_DIM), rngs=rngs)
        self.v = nnx.Einsum("btd,dhk->bthk", (EMBED, KV_HEADS, HEAD_DIM), rngs=rngs)
        self.o = nnx.Einsum("bthk,hkd->btd", (HEADS, HEAD_DIM, EMBED), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = rope(self.q(x)), rope(self.k(x)), self.v(x)
        k = jnp.repeat(k, HEADS // KV_HEADS, axis=2)
        v = jnp.repeat(v, HEADS // KV_HEADS, axis=2)
        scores = jnp.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(HEAD_DIM)
        seq = x.shape[1]
        scores = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), scores, -1e30)
        return self.o(jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(scores, axis=-1), v))


class Mlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.gate_up = nnx.Einsum("btd,cdf->cbtf", (2, EMBED, MLP), rngs=rngs)
        self.down = nnx.Linear(MLP, EMBED, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = self.gate_up(x)
        return self.down(jax.nn.silu(gate) * up)


class Layer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.input_norm = nnx.RMSNorm(EMBED, epsilon=EPS, rngs=rngs)
        self.attn = Attention(rngs)
        self.post_attention_norm = nnx.RMSNorm(EMBED, epsilon=EPS, rngs=rngs)
        self.mlp = Mlp(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.input_norm(x))
        return x + self.mlp(self.post_attention_norm(x))


class Llama(nnx.Module):
    def __init__(self, layers: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, EMBED, rngs=rngs)
        self.layers = nnx.List([Layer(rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(EMBED, epsilon=EPS, rngs=rngs)
        self.head = nnx.Linear(EMBED, VOCAB, use_bias=False, rngs=rngs)
        self.head_lora = nnx.LoRA(EMBED, 4, VOCAB, rngs=rngs)  # new: not in the checkpoint

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        return self.head(x) + self.head_lora(x)


# Tensor parallel over "model", FSDP over "data"; norms replicated.
RULES = ms.Rules(
    [
        (r"attn/q/kernel$", P("data", "model", None)),
        (r"attn/(k|v)/kernel$", P("data", None, None)),  # 2 kv heads: not over model=4
        (r"attn/o/kernel$", P("model", None, "data")),
        (r"gate_up/kernel$", P(None, "data", "model")),
        (r"down/kernel$", P("model", "data")),
        (r"embed/embedding$", P("model", "data")),
        (r"head/kernel$", P("data", "model")),
        (r".*", P()),
    ]
)


# ---- the checkpoint, as transformers would write it, and a NumPy reference --------------


def hf_checkpoint(path: Path, layers: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def w(*shape: int, scale: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(ml_dtypes.bfloat16)

    t = {"model.embed_tokens.weight": w(VOCAB, EMBED, scale=0.5)}
    for i in range(layers):
        pre = f"model.layers.{i}."
        t[pre + "self_attn.q_proj.weight"] = w(HEADS * HEAD_DIM, EMBED)
        t[pre + "self_attn.k_proj.weight"] = w(KV_HEADS * HEAD_DIM, EMBED)
        t[pre + "self_attn.v_proj.weight"] = w(KV_HEADS * HEAD_DIM, EMBED)
        t[pre + "self_attn.o_proj.weight"] = w(EMBED, HEADS * HEAD_DIM)
        t[pre + "self_attn.rotary_emb.inv_freq"] = np.ones(HEAD_DIM // 2, np.float32)
        t[pre + "mlp.gate_proj.weight"] = w(MLP, EMBED)
        t[pre + "mlp.up_proj.weight"] = w(MLP, EMBED)
        t[pre + "mlp.down_proj.weight"] = w(EMBED, MLP)
        t[pre + "input_layernorm.weight"] = (1 + w(EMBED, scale=0.1)).astype(ml_dtypes.bfloat16)
        t[pre + "post_attention_layernorm.weight"] = (1 + w(EMBED, scale=0.1)).astype(
            ml_dtypes.bfloat16
        )
    t["model.norm.weight"] = np.ones(EMBED, ml_dtypes.bfloat16)
    t["lm_head.weight"] = w(VOCAB, EMBED)
    save_file(t, str(path), metadata={"format": "pt"})
    # the sizes the mapping file names, beside the weights as in every HF checkpoint
    config = {
        "model_type": "llama",
        "hidden_size": EMBED,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "intermediate_size": MLP,
        "num_hidden_layers": layers,
        "vocab_size": VOCAB,
        "rms_norm_eps": EPS,
    }
    (path.parent / "config.json").write_text(json.dumps(config, indent=1))
    return t


def reference_logits(t: dict[str, np.ndarray], ids: np.ndarray, layers: int) -> np.ndarray:
    """The same architecture in NumPy, on the checkpoint's tensors as stored (``x @ W.T``)."""
    f = {k: v.astype(np.float32) for k, v in t.items()}

    def norm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * w

    def heads(x: np.ndarray, n: int) -> np.ndarray:
        return x.reshape(*x.shape[:-1], n, HEAD_DIM)

    x = f["model.embed_tokens.weight"][ids]
    seq = ids.shape[1]
    mask = np.tril(np.ones((seq, seq), bool))
    for i in range(layers):
        p = f"model.layers.{i}."
        h = norm(x, f[p + "input_layernorm.weight"])
        q = rope(heads(h @ f[p + "self_attn.q_proj.weight"].T, HEADS), np)
        k = rope(heads(h @ f[p + "self_attn.k_proj.weight"].T, KV_HEADS), np)
        v = heads(h @ f[p + "self_attn.v_proj.weight"].T, KV_HEADS)
        k, v = (np.repeat(a, HEADS // KV_HEADS, axis=2) for a in (k, v))
        s = np.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(HEAD_DIM)
        s = np.where(mask, s, -1e30)
        s = np.exp(s - s.max(-1, keepdims=True))
        a = np.einsum("bhqs,bshk->bqhk", s / s.sum(-1, keepdims=True), v)
        x = x + a.reshape(*a.shape[:2], -1) @ f[p + "self_attn.o_proj.weight"].T
        h = norm(x, f[p + "post_attention_layernorm.weight"])
        gate, up = h @ f[p + "mlp.gate_proj.weight"].T, h @ f[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ f[p + "mlp.down_proj.weight"].T
    return norm(x, f["model.norm.weight"]) @ f["lm_head.weight"].T


# ---- the flow -----------------------------------------------------------------------------


def main(fast: bool = False, workdir: str | None = None) -> dict[str, Any]:
    layers = 2 if fast else 4
    root = Path(workdir or tempfile.mkdtemp(prefix="modelshard-llama-"))
    path = root / "model.safetensors"
    tensors = hf_checkpoint(path, layers)
    console.print(f"wrote {path.name}: {len(tensors)} tensors in Hugging Face Llama names")

    mesh = ms.make_mesh({"data": 2, "model": 4})
    model = Llama(layers, nnx.Rngs(0))  # concrete: its LoRA adapters keep their init
    table = ms.load_safetensors(
        path, like=model, mapping=MAPPING, specs=RULES, mesh=mesh, dtype="float32", dry_run=True
    )
    console.print(table.table(max_rows=8))
    model = ms.load_safetensors(
        path, like=model, mapping=MAPPING, specs=RULES, mesh=mesh, dtype="float32"
    )
    q = model.layers[0].attn.q.kernel[...]
    console.print(f"layers/0/attn/q/kernel: {q.shape} {q.sharding.spec} on mesh (data=2, model=4)")

    ids = np.random.default_rng(1).integers(0, VOCAB, (2, 12))
    logits = np.asarray(jax.jit(lambda m, i: m(i))(model, ids))
    want = reference_logits(tensors, ids, layers)
    max_err = float(np.abs(logits - want).max())
    console.print(f"logits vs the NumPy reference: max abs difference {max_err:.2e}")

    back = ms.save_safetensors(
        root / "exported.safetensors", model, reference=path, mapping=MAPPING, dtype="float32"
    )
    exported = load_file(str(back))
    same = all(
        exported[k].dtype == v.dtype and exported[k].tobytes() == v.tobytes()
        for k, v in tensors.items()
        if "inv_freq" not in k
    )
    console.print(f"exported {back.name}: {len(exported)} tensors, bit-exact: {same}")
    return {
        "max_err": max_err,
        "bit_exact": same,
        "exported": sorted(exported),
        "q_spec": str(q.sharding.spec),
        "lora_b_zero": bool((np.asarray(model.head_lora.lora_b[...]) == 0).all()),
        "skipped": table.skipped,
    }


if __name__ == "__main__":
    print(json.dumps(main(), indent=1, default=str)[:2000])
