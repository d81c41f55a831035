"""Pretrained Qwen weights in and out: Hugging Face Qwen2 (q/k/v biases, tied embedding)
and Qwen3 (per-head q/k RMSNorms, head_dim apart from hidden_size / heads) checkpoints
loaded with the shipped mappings ``mapping="qwen2"`` and ``mapping="qwen3"`` into one NNX
model laid out for tensor parallelism, checked against a NumPy reference, and exported
back as a model directory in the checkpoint's own names, shapes and dtypes.

1. Write each checkpoint with ``safetensors.numpy`` in the names ``transformers`` uses
   (``model.layers.N.self_attn.q_proj.bias``, ``...q_norm.weight``, PyTorch's
   ``[out, in]`` layout, bfloat16) with its ``config.json``. Nothing is downloaded.
2. Load it by the shipped mapping's name, sizes from ``config.json``: the biases land in
   ``nnx.Einsum``'s own ``attn/{q,k,v}/bias`` ``[heads, head_dim]``, the norms in
   ``attn/{q,k}_norm/scale`` ``[head_dim]``; the tied Qwen2 has no head leaf (its logits
   multiply by the embedding).
3. Compare the logits with a NumPy implementation reading the stored tensors as they are.
4. Export to a directory (``model.safetensors`` and the ``config.json``) and compare bytes.
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

EPS, THETA = 1e-6, 1_000_000.0
# (vocab, embed, heads, kv_heads, head_dim, mlp, tied, biases, q/k norms)
FAMILIES = {
    "qwen2": dict(vocab=128, embed=64, heads=4, kv_heads=2, head_dim=16, mlp=128, tied=True),
    "qwen3": dict(vocab=128, embed=64, heads=4, kv_heads=2, head_dim=32, mlp=128, tied=False),
}


# ---- the NNX model: Llama's layout plus what each family adds ------------------------------


def rope(x: Any, xp: Any = jnp) -> Any:
    """Rotary embeddings, the "rotate half" form, on ``[batch, seq, heads, head_dim]``."""
    seq, half = x.shape[1], x.shape[-1] // 2
    freq = 1.0 / (THETA ** (xp.arange(half, dtype=xp.float32) / half))
    angle = xp.arange(seq, dtype=xp.float32)[:, None] * freq[None, :]
    cos = xp.concatenate([xp.cos(angle)] * 2, axis=-1)[None, :, None, :]
    sin = xp.concatenate([xp.sin(angle)] * 2, axis=-1)[None, :, None, :]
    rotated = xp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


class Attention(nnx.Module):
    def __init__(self, c: dict[str, Any], family: str, rngs: nnx.Rngs):
        e, h, k, d = c["embed"], c["heads"], c["kv_heads"], c["head_dim"]
        bias = family == "qwen2"  # Qwen2's q/k/v biases: nnx.Einsum's own, [heads, head_dim]

        def proj(n: int) -> nnx.Einsum:
            return nnx.Einsum(
                "btd,dhk->bthk", (e, n, d), bias_shape=(n, d) if bias else None, rngs=rngs
            )

        self.q, self.k, self.v = proj(h), proj(k), proj(k)
        self.o = nnx.Einsum("bthk,hkd->btd", (h, d, e), rngs=rngs)
        self.qk_norm = family == "qwen3"  # Qwen3's per-head RMSNorms, [head_dim]
        if self.qk_norm:
            self.q_norm = nnx.RMSNorm(d, epsilon=EPS, rngs=rngs)
            self.k_norm = nnx.RMSNorm(d, epsilon=EPS, rngs=rngs)
        self.groups, self.head_dim = h // k, d

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q), rope(k)
        k, v = jnp.repeat(k, self.groups, axis=2), jnp.repeat(v, self.groups, axis=2)
        scores = jnp.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(self.head_dim)
        seq = x.shape[1]
        scores = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), scores, -1e30)
        return self.o(jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(scores, axis=-1), v))


class Mlp(nnx.Module):
    def __init__(self, c: dict[str, Any], rngs: nnx.Rngs):
        self.gate_up = nnx.Einsum("btd,cdf->cbtf", (2, c["embed"], c["mlp"]), rngs=rngs)
        self.down = nnx.Linear(c["mlp"], c["embed"], use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = self.gate_up(x)
        return self.down(jax.nn.silu(gate) * up)


class Layer(nnx.Module):
    def __init__(self, c: dict[str, Any], family: str, rngs: nnx.Rngs):
        self.input_norm = nnx.RMSNorm(c["embed"], epsilon=EPS, rngs=rngs)
        self.attn = Attention(c, family, rngs)
        self.post_attention_norm = nnx.RMSNorm(c["embed"], epsilon=EPS, rngs=rngs)
        self.mlp = Mlp(c, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.input_norm(x))
        return x + self.mlp(self.post_attention_norm(x))


class Qwen(nnx.Module):
    def __init__(self, family: str, layers: int, rngs: nnx.Rngs):
        c = FAMILIES[family]
        self.embed = nnx.Embed(c["vocab"], c["embed"], rngs=rngs)
        self.layers = nnx.List([Layer(c, family, rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(c["embed"], epsilon=EPS, rngs=rngs)
        if not c["tied"]:  # a tied checkpoint has no lm_head.weight, the model no head
            self.head = nnx.Linear(c["embed"], c["vocab"], use_bias=False, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        return self.head(x) if hasattr(self, "head") else self.embed.attend(x)


def rules(family: str) -> ms.Rules:
    """Tensor parallel over "model", FSDP over "data"; Qwen2's q bias split with its heads;
    norms replicated. Every rule must match a leaf: the tied model has no head."""
    return ms.Rules(
        [
            (r"attn/q/kernel$", P("data", "model", None)),
            *([(r"attn/q/bias$", P("model", None))] if family == "qwen2" else []),
            (r"attn/(k|v)/kernel$", P("data", None, None)),  # 2 kv heads: not over model=4
            (r"attn/o/kernel$", P("model", None, "data")),
            (r"gate_up/kernel$", P(None, "data", "model")),
            (r"down/kernel$", P("model", "data")),
            (r"embed/embedding$", P("model", "data")),
            *([] if FAMILIES[family]["tied"] else [(r"head/kernel$", P("data", "model"))]),
            (r".*", P()),
        ]
    )


# ---- the checkpoint, as transformers would write it, and a NumPy reference --------------


def hf_checkpoint(root: Path, family: str, layers: int, seed: int = 0) -> dict[str, np.ndarray]:
    c = FAMILIES[family]
    e, h, k, d, f, v = c["embed"], c["heads"], c["kv_heads"], c["head_dim"], c["mlp"], c["vocab"]
    rng = np.random.default_rng(seed)

    def w(*shape: int, scale: float = 0.08, base: float = 0.0) -> np.ndarray:
        return (base + rng.standard_normal(shape) * scale).astype(ml_dtypes.bfloat16)

    t = {"model.embed_tokens.weight": w(v, e, scale=0.5)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = w(h * d, e)
        t[p + "self_attn.k_proj.weight"] = w(k * d, e)
        t[p + "self_attn.v_proj.weight"] = w(k * d, e)
        t[p + "self_attn.o_proj.weight"] = w(e, h * d)
        if family == "qwen2":
            t[p + "self_attn.q_proj.bias"] = w(h * d, scale=0.1)
            t[p + "self_attn.k_proj.bias"] = w(k * d, scale=0.1)
            t[p + "self_attn.v_proj.bias"] = w(k * d, scale=0.1)
        else:
            t[p + "self_attn.q_norm.weight"] = w(d, scale=0.1, base=1.0)
            t[p + "self_attn.k_norm.weight"] = w(d, scale=0.1, base=1.0)
        t[p + "mlp.gate_proj.weight"] = w(f, e)
        t[p + "mlp.up_proj.weight"] = w(f, e)
        t[p + "mlp.down_proj.weight"] = w(e, f)
        t[p + "input_layernorm.weight"] = w(e, scale=0.1, base=1.0)
        t[p + "post_attention_layernorm.weight"] = w(e, scale=0.1, base=1.0)
    t["model.norm.weight"] = w(e, scale=0.1, base=1.0)
    if not c["tied"]:
        t["lm_head.weight"] = w(v, e)
    root.mkdir(parents=True, exist_ok=True)
    save_file(t, str(root / "model.safetensors"), metadata={"format": "pt"})
    config = {  # what the mapping reads its sizes from, as every HF checkpoint has it
        "architectures": [f"{family.capitalize()}ForCausalLM"],
        "model_type": family,
        "hidden_size": e,
        "num_attention_heads": h,
        "num_key_value_heads": k,
        "head_dim": d,
        "intermediate_size": f,
        "num_hidden_layers": layers,
        "vocab_size": v,
        "rms_norm_eps": EPS,
        "rope_theta": THETA,
        "tie_word_embeddings": c["tied"],
        "torch_dtype": "bfloat16",
    }
    (root / "config.json").write_text(json.dumps(config, indent=1))
    return t


def reference_logits(
    t: dict[str, np.ndarray], family: str, ids: np.ndarray, layers: int
) -> np.ndarray:
    """The same architecture in NumPy, on the checkpoint's tensors as stored (``x @ W.T``)."""
    c = FAMILIES[family]
    h, k, d = c["heads"], c["kv_heads"], c["head_dim"]
    f = {name: a.astype(np.float32) for name, a in t.items()}

    def norm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * w

    def proj(x: np.ndarray, name: str, n: int) -> np.ndarray:
        y = x @ f[name + ".weight"].T + f.get(name + ".bias", 0.0)
        return y.reshape(*y.shape[:-1], n, d)

    x = f["model.embed_tokens.weight"][ids]
    seq = ids.shape[1]
    mask = np.tril(np.ones((seq, seq), bool))
    for i in range(layers):
        p = f"model.layers.{i}."
        a = norm(x, f[p + "input_layernorm.weight"])
        q = proj(a, p + "self_attn.q_proj", h)
        kk = proj(a, p + "self_attn.k_proj", k)
        v = proj(a, p + "self_attn.v_proj", k)
        if family == "qwen3":
            q, kk = (
                norm(q, f[p + "self_attn.q_norm.weight"]),
                norm(kk, f[p + "self_attn.k_norm.weight"]),
            )
        q, kk = rope(q, np), rope(kk, np)
        kk, v = (np.repeat(z, h // k, axis=2) for z in (kk, v))
        s = np.where(mask, np.einsum("bqhk,bshk->bhqs", q, kk) / np.sqrt(d), -1e30)
        s = np.exp(s - s.max(-1, keepdims=True))
        o = np.einsum("bhqs,bshk->bqhk", s / s.sum(-1, keepdims=True), v)
        x = x + o.reshape(*o.shape[:2], -1) @ f[p + "self_attn.o_proj.weight"].T
        a = norm(x, f[p + "post_attention_layernorm.weight"])
        gate, up = a @ f[p + "mlp.gate_proj.weight"].T, a @ f[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ f[p + "mlp.down_proj.weight"].T
    head = f.get("lm_head.weight", f["model.embed_tokens.weight"])  # tied: the embedding
    return norm(x, f["model.norm.weight"]) @ head.T


# ---- the flow -----------------------------------------------------------------------------


def run_family(family: str, root: Path, layers: int, mesh: Any) -> dict[str, Any]:
    tensors = hf_checkpoint(root / family, family, layers)
    console.print(f"{family}: wrote model.safetensors: {len(tensors)} tensors and config.json")
    like = nnx.eval_shape(lambda: Qwen(family, layers, nnx.Rngs(0)))
    model = ms.load_safetensors(
        root / family, like=like, mapping=family, specs=rules(family), mesh=mesh, dtype="float32"
    )
    attn = model.layers[0].attn
    extra = attn.q.bias if family == "qwen2" else attn.q_norm.scale
    console.print(
        f"{family}: layers/0/attn/q/kernel {attn.q.kernel[...].shape} "
        f"{attn.q.kernel[...].sharding.spec}; "
        + ("q/bias" if family == "qwen2" else "q_norm/scale")
        + f" {extra[...].shape}"
    )

    ids = np.random.default_rng(1).integers(0, FAMILIES[family]["vocab"], (2, 12))
    logits = np.asarray(jax.jit(lambda m, i: m(i))(model, ids))
    max_err = float(np.abs(logits - reference_logits(tensors, family, ids, layers)).max())
    console.print(f"{family}: logits vs the NumPy reference: max abs difference {max_err:.2e}")

    out = ms.save_safetensors(
        root / f"{family}-out", model, reference=root / family, mapping=family, dtype="float32"
    )
    exported = load_file(str(out))
    same = sorted(exported) == sorted(tensors) and all(
        exported[k].dtype == v.dtype and exported[k].tobytes() == v.tobytes()
        for k, v in tensors.items()
    )
    files = sorted(p.name for p in out.parent.iterdir())
    console.print(f"{family}: exported {', '.join(files)}: bit-exact {same}")
    return {
        "max_err": max_err,
        "bit_exact": same,
        "files": files,
        "q_spec": str(attn.q.kernel[...].sharding.spec),
        "extra_shape": list(extra[...].shape),
        "has_head": hasattr(model, "head"),
        "exported": sorted(exported),
    }


def main(fast: bool = False, workdir: str | None = None) -> dict[str, Any]:
    layers = 2 if fast else 4
    root = Path(workdir or tempfile.mkdtemp(prefix="modelshard-qwen-"))
    mesh = ms.make_mesh({"data": 2, "model": 4})
    return {family: run_family(family, root, layers, mesh) for family in FAMILIES}


if __name__ == "__main__":
    print(json.dumps(main(), indent=1, default=str)[:2000])
