"""tinylm in Flax NNX: the same parameters (same paths) and constraints as the linen one."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from . import Config
from .sharding import constrain


def _init(*names: str, init: Any = None) -> Any:
    # eager_sharding=False: NNX would otherwise place each parameter at creation and need a
    # mesh; tinylm runs without one, and its users place the state with modelshard.
    init = nnx.initializers.lecun_normal() if init is None else init
    return nnx.with_partitioning(init, names, eager_sharding=False)


class Proj(nnx.Module):
    """``einsum(equation, x, kernel)`` with a kernel of logical ``names`` (the linen
    variant's ``Proj``: same parameter path, ``kernel``)."""

    def __init__(self, shape: tuple[int, ...], names: tuple[str, ...], equation: str, rngs):
        self.kernel = nnx.Param(_init(*names)(rngs.params(), shape))
        self.equation = equation

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.einsum(self.equation, x, self.kernel[...])


class Block(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs):
        self.c = c
        self.norm = nnx.LayerNorm(c.embed, use_bias=False, rngs=rngs)
        for n in ("q", "k", "v"):
            shape = (c.embed, c.heads, c.kv)
            setattr(self, n, Proj(shape, ("embed", "heads", "kv"), "bse,ehd->bshd", rngs))
        self.o = Proj((c.heads, c.kv, c.embed), ("heads", "kv", "embed"), "bshd,hde->bse", rngs)
        self.up = nnx.Linear(
            c.embed, c.mlp, use_bias=False, kernel_init=_init("embed", "mlp"), rngs=rngs
        )
        self.down = nnx.Linear(
            c.mlp, c.embed, use_bias=False, kernel_init=_init("mlp", "embed"), rngs=rngs
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.c
        h = self.norm(x)
        q, k, v = (constrain(m(h), "batch", "seq", "heads", "kv") for m in (self.q, self.k, self.v))
        w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / c.kv**0.5, axis=-1)
        a = jnp.einsum("bhqk,bkhd->bqhd", w, v)
        x = constrain(x + self.o(a), "batch", "seq", "embed")
        up = constrain(jax.nn.gelu(self.up(x)), "batch", "seq", "mlp")
        return constrain(x + self.down(up), "batch", "seq", "embed")


_DEFAULT = Config()


class TinyLM(nnx.Module):
    def __init__(self, c: Config = _DEFAULT, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(
            c.vocab,
            c.embed,
            embedding_init=_init("vocab", "embed", init=nnx.initializers.normal(1.0)),
            rngs=rngs,
        )
        for i in range(c.layers):
            setattr(self, f"block_{i}", Block(c, rngs))
        self.head = nnx.Linear(
            c.embed, c.vocab, use_bias=False, kernel_init=_init("embed", "vocab"), rngs=rngs
        )
        self.layers = c.layers

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = constrain(self.embed(ids), "batch", "seq", "embed")
        for i in range(self.layers):
            x = getattr(self, f"block_{i}")(x)
        return constrain(self.head(x), "batch", "seq", "vocab")
