"""What the tests against Hugging Face transformers share: an NNX model of the Llama family
(the layout of ``examples/llama_weights.py``, with Qwen2's q/k/v biases and Qwen3's q/k
norms), tiny random transformers models written by their own ``save_pretrained``, an
offline Hub cache, and the checks every family runs (load, logits, export, reload).

Each family's test module builds its transformers config and calls these.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import modelshard as ms

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4  # float32 logits, ours against torch's (the bound)
IDS = np.array([[1, 5, 9, 2, 7, 3, 11, 4], [8, 6, 0, 12, 3, 3, 10, 1]], np.int32)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The sizes and switches of one model, read from a transformers config."""

    vocab: int
    embed: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    layers: int
    eps: float
    theta: float
    bias: bool  # q/k/v biases (Qwen2)
    qk_norm: bool  # per-head q/k RMSNorm (Qwen3)
    tied: bool

    @classmethod
    def of(cls, config: Any, *, bias: bool = False, qk_norm: bool = False) -> Sizes:
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return cls(
            vocab=config.vocab_size,
            embed=config.hidden_size,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None)
            or config.hidden_size // config.num_attention_heads,
            mlp=config.intermediate_size,
            layers=config.num_hidden_layers,
            eps=config.rms_norm_eps,
            theta=float(theta),
            bias=bias,
            qk_norm=qk_norm,
            tied=bool(config.tie_word_embeddings),
        )


def rope(x: jax.Array, theta: float) -> jax.Array:
    """Rotary embeddings, transformers' "rotate half" form, on ``[batch, seq, heads, dim]``."""
    seq, dim = x.shape[1], x.shape[-1]
    inv = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    angle = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv[None, :]
    angle = jnp.concatenate([angle, angle], axis=-1)[None, :, None, :]
    half = dim // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * jnp.cos(angle) + rotated * jnp.sin(angle)


class Attention(nnx.Module):
    def __init__(self, s: Sizes, rngs: nnx.Rngs, lora: int | None = None):
        self.s = s

        def proj(n: int) -> nnx.Einsum:
            bias = (n, s.head_dim) if s.bias else None
            return nnx.Einsum("btd,dhk->bthk", (s.embed, n, s.head_dim), bias_shape=bias, rngs=rngs)

        self.q, self.k, self.v = proj(s.heads), proj(s.kv_heads), proj(s.kv_heads)
        self.o = nnx.Einsum("bthk,hkd->btd", (s.heads, s.head_dim, s.embed), rngs=rngs)
        if s.qk_norm:
            self.q_norm = nnx.RMSNorm(s.head_dim, epsilon=s.eps, rngs=rngs)
            self.k_norm = nnx.RMSNorm(s.head_dim, epsilon=s.eps, rngs=rngs)
        if lora is not None:  # flax's LoRALinear layout: P/lora beside P/kernel
            self.q.lora = nnx.LoRA(s.embed, lora, s.heads * s.head_dim, rngs=rngs)
            self.v.lora = nnx.LoRA(s.embed, lora, s.kv_heads * s.head_dim, rngs=rngs)

    def _adapted(self, proj: nnx.Einsum, x: jax.Array) -> jax.Array:
        y = proj(x)
        lora = getattr(proj, "lora", None)
        return y if lora is None else y + lora(x).reshape(y.shape)

    def __call__(self, x: jax.Array) -> jax.Array:
        s = self.s
        q, k, v = self._adapted(self.q, x), self.k(x), self._adapted(self.v, x)
        if s.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, s.theta), rope(k, s.theta)
        k = jnp.repeat(k, s.heads // s.kv_heads, axis=2)
        v = jnp.repeat(v, s.heads // s.kv_heads, axis=2)
        scores = jnp.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(s.head_dim)
        seq = x.shape[1]
        scores = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), scores, -jnp.inf)
        return self.o(jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(scores, axis=-1), v))


class Mlp(nnx.Module):
    def __init__(self, s: Sizes, rngs: nnx.Rngs):
        self.gate_up = nnx.Einsum("btd,cdf->cbtf", (2, s.embed, s.mlp), rngs=rngs)
        self.down = nnx.Linear(s.mlp, s.embed, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = self.gate_up(x)
        return self.down(jax.nn.silu(gate) * up)


class Layer(nnx.Module):
    def __init__(self, s: Sizes, rngs: nnx.Rngs, lora: int | None = None):
        self.input_norm = nnx.RMSNorm(s.embed, epsilon=s.eps, rngs=rngs)
        self.attn = Attention(s, rngs, lora)
        self.post_attention_norm = nnx.RMSNorm(s.embed, epsilon=s.eps, rngs=rngs)
        self.mlp = Mlp(s, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.input_norm(x))
        return x + self.mlp(self.post_attention_norm(x))


class CausalLM(nnx.Module):
    """Llama, Mistral, Qwen2 and Qwen3 in one NNX layout; tied models have no head leaf
    (the logits multiply by the embedding); ``lora``: LoRA adapters of that rank on the q
    and v projections (``attn/{q,v}/lora/lora_{a,b}``), leaves no base checkpoint has."""

    def __init__(self, s: Sizes, rngs: nnx.Rngs, lora: int | None = None):
        self.embed = nnx.Embed(s.vocab, s.embed, rngs=rngs)
        self.layers = nnx.List([Layer(s, rngs, lora) for _ in range(s.layers)])
        self.norm = nnx.RMSNorm(s.embed, epsilon=s.eps, rngs=rngs)
        if not s.tied:
            self.head = nnx.Linear(s.embed, s.vocab, use_bias=False, rngs=rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        return self.embed.attend(x) if not hasattr(self, "head") else self.head(x)


def abstract(s: Sizes, lora: int | None = None) -> CausalLM:
    return nnx.eval_shape(lambda: CausalLM(s, nnx.Rngs(0), lora))


# ---- transformers' side --------------------------------------------------------------------


def torch_model(cls: Any, config: Any, seed: int = 0) -> Any:
    """A transformers model from ``config`` in float32 with random weights: every
    parameter, norms included, drawn anew so that a mapping mixing two up shows."""
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lm_head.weight") and config.tie_word_embeddings:
                continue
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + 0.1 * torch.randn_like(p))
    return model


def torch_logits(model: Any) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(IDS, dtype=torch.long)).logits.float().numpy()


def write_pretrained(model: Any, directory: Path, **kw: Any) -> Path:
    """``save_pretrained`` plus a generation config and a tokenizer file, as a Hub
    repository holds them (the export must carry them unchanged)."""
    model.save_pretrained(directory, **kw)
    (directory / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    (directory / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {}}))
    return directory


def hub_cache(home: Path, repo: str, snapshot: Path, revision: str = "0" * 40) -> None:
    """An offline Hugging Face cache under ``home`` (HF_HOME) holding ``snapshot`` as
    ``repo``'s main revision, laid out as ``huggingface_hub`` lays it out."""
    org, name = repo.split("/")
    root = home / "hub" / f"models--{org}--{name}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(revision)
    shutil.copytree(snapshot, root / "snapshots" / revision)


def jax_logits(model: CausalLM) -> np.ndarray:
    return np.asarray(model(jnp.asarray(IDS)), np.float32)


def nudged(model: CausalLM) -> CausalLM:
    """``model`` with every weight changed (a stand-in for a fine-tuning step)."""
    graph, state = nnx.split(model)
    state = jax.tree.map(lambda x: x * 1.05 + 0.01, state)
    return nnx.merge(graph, state)


def reload(directory: Path, cls: Any) -> tuple[Any, dict[str, Any]]:
    """transformers' ``from_pretrained`` on an export, with its loading report."""
    model, info = cls.from_pretrained(directory, output_loading_info=True, dtype=torch.float32)
    return model.eval(), info


def assert_clean(info: dict[str, Any]) -> None:
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert not info.get("mismatched_keys"), info


def stored_names(d: Path) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for f in d.glob("*.safetensors"):
        with safe_open(f, "np") as g:
            names.update(g.keys())
    return names


def round_trip(d: Path, model: Any, s: Sizes, mapping: str, out: Path) -> CausalLM:
    """The whole path for one family: load ``d`` (transformers' ``save_pretrained``) with
    torch's logits, change every weight, export the directory ``out``, which
    ``from_pretrained`` loads with no missing or unexpected keys and our logits; tied
    stays tied; the tokenizer and generation config come along unchanged. Returns the
    changed model."""
    assert ("lm_head.weight" in stored_names(d)) is not s.tied
    ours = ms.load_safetensors(d, like=abstract(s), mapping=mapping)
    np.testing.assert_allclose(jax_logits(ours), torch_logits(model), atol=TOL, rtol=0)

    changed = nudged(ours)
    written = ms.save_safetensors(out, changed, reference=d, mapping=mapping)
    assert written == out / "model.safetensors"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (d / name).read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32"
    assert stored_names(out) == stored_names(d)
    back, info = reload(out, transformers.AutoModelForCausalLM)
    assert_clean(info)
    np.testing.assert_allclose(torch_logits(back), jax_logits(changed), atol=TOL, rtol=0)
    tied = back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()
    assert tied is s.tied
    return changed
