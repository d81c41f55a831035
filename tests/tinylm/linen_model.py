"""tinylm in Flax linen: parameters named with logical axes, activations constrained."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from . import Config, sharding


def _init(*names: str) -> Any:
    return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)


class Proj(nn.Module):
    """``einsum(equation, x, kernel)`` with a kernel of logical ``names`` (linen's
    DenseGeneral constrains a reshaped kernel under logical rules, so tinylm has its own)."""

    shape: tuple[int, ...]
    names: tuple[str, ...]
    equation: str

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param("kernel", _init(*self.names), self.shape)
        return jnp.einsum(self.equation, x, kernel)


def _constrainer(c: Config) -> Any:
    return sharding.flax_constrain if c.flax_constraints else sharding.constrain


class Block(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        constrain = _constrainer(c)
        h = nn.LayerNorm(use_bias=False, name="norm")(x)
        q, k, v = (
            constrain(
                Proj((c.embed, c.heads, c.kv), ("embed", "heads", "kv"), "bse,ehd->bshd", name=n)(
                    h
                ),
                "batch",
                "seq",
                "heads",
                "kv",
            )
            for n in ("q", "k", "v")
        )
        w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / c.kv**0.5, axis=-1)
        a = jnp.einsum("bhqk,bkhd->bqhd", w, v)
        o = Proj((c.heads, c.kv, c.embed), ("heads", "kv", "embed"), "bshd,hde->bse", name="o")(a)
        x = constrain(x + o, "batch", "seq", "embed")
        up = nn.Dense(c.mlp, use_bias=False, kernel_init=_init("embed", "mlp"), name="up")(x)
        up = constrain(jax.nn.gelu(up), "batch", "seq", "mlp")
        down = nn.Dense(c.embed, use_bias=False, kernel_init=_init("mlp", "embed"), name="down")
        return constrain(x + down(up), "batch", "seq", "embed")


class TinyLM(nn.Module):
    config: Config = Config()

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        c = self.config
        constrain = _constrainer(c)
        embed = nn.Embed(
            c.vocab,
            c.embed,
            embedding_init=nn.with_logical_partitioning(
                nn.initializers.normal(1.0), ("vocab", "embed")
            ),
            name="embed",
        )
        x = constrain(embed(ids), "batch", "seq", "embed")
        for i in range(c.layers):
            x = Block(c, name=f"block_{i}")(x)
        head = nn.Dense(c.vocab, use_bias=False, kernel_init=_init("embed", "vocab"), name="head")
        return constrain(head(x), "batch", "seq", "vocab")
