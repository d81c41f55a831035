"""Plain helpers the tests share (fixtures live in ``conftest.py``): real containers of
every kind (``MAKERS``), an abstract Gemma-like state and its rules, and the codec a
checkpoint stored a leaf with. Tests import them with ``from helpers import ...``
(``tests`` is on pytest's ``pythonpath``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import modelshard as ms

KINDS = ("pytree", "optax", "equinox", "nnx", "linen")


def make_pytree() -> Any:
    return {
        "embed": jnp.arange(64 * 16, dtype=jnp.float32).reshape(64, 16),
        "layers": [
            {"kernel": jnp.ones((16, 32)), "bias": jnp.zeros((32,))},
            {"kernel": jnp.ones((32, 16)) * 2, "bias": jnp.zeros((16,))},
        ],
        "step": jnp.array(0, jnp.int32),
    }


def make_optax() -> Any:
    import optax

    params = make_pytree()
    params.pop("step")
    return optax.adamw(1e-3).init(params)


def make_equinox() -> Any:
    import equinox as eqx

    return eqx.nn.MLP(16, 8, 32, 2, key=jax.random.key(0))


def make_nnx() -> Any:
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(64, 16, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(
                num_heads=4, in_features=16, qkv_features=16, decode=False, rngs=rngs
            )
            self.norm = nnx.LayerNorm(16, rngs=rngs)
            self.mlp = nnx.Linear(16, 32, rngs=rngs)
            self.bn = nnx.BatchNorm(32, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, ids):
            x = self.norm(self.attn(self.embed(ids)))
            return self.drop(self.bn(self.mlp(x)))

    return Block(nnx.Rngs(0))


def make_linen() -> Any:
    import flax.linen as nn

    def part(*names):
        return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            x = nn.Dense(16, kernel_init=part("embed", "mlp"))(x)
            return nn.relu(x), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(16, kernel_init=part("embed", "mlp"))(x)
            x = nn.BatchNorm(use_running_average=False)(x)
            x, _ = nn.scan(
                Layer,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=4,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )()(x, None)
            return x

    variables = Model().init(jax.random.key(0), jnp.ones((2, 16)))
    return dict(variables)


MAKERS: dict[str, Callable[[], Any]] = {
    "pytree": make_pytree,
    "optax": make_optax,
    "equinox": make_equinox,
    "nnx": make_nnx,
    "linen": make_linen,
}


def gemma_like(layers: int = 62, vision_blocks: int = 27) -> dict[str, Any]:
    """An abstract Gemma-3-27B-like state (``jax.ShapeDtypeStruct`` leaves, nothing
    allocated): a text decoder of ``layers`` layers and a SigLIP-like vision encoder of
    ``vision_blocks`` blocks (14 leaves each, 5 more around them)."""

    def s(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16)

    d, f, h, hd, v = 5376, 21504, 32, 128, 1152
    text: dict[str, Any] = {"embedder": {"input_embedding": s(262144, d)}}
    text["final_norm"] = {"scale": s(d)}
    for i in range(layers):
        text[f"layer_{i}"] = {
            "attn": {
                "q_einsum": {"w": s(h, d, hd)},
                "kv_einsum": {"w": s(2, 16, d, hd)},
                "attn_vec_einsum": {"w": s(h, hd, d)},
            },
            "mlp": {"gating_einsum": s(2, f, d), "linear": s(f, d)},
            "pre_attention_norm": {"scale": s(d)},
            "pre_ffw_norm": {"scale": s(d)},
        }
    attn: dict[str, Any] = {n: {"kernel": s(v, 16, 72), "bias": s(16, 72)} for n in "qkv"}
    attn = {"query": attn["q"], "key": attn["k"], "value": attn["v"]}
    attn["out"] = {"kernel": s(16, 72, v), "bias": s(v)}
    block = {
        "LayerNorm_0": {"scale": s(v)},
        "LayerNorm_1": {"scale": s(v)},
        "MlpBlock_0": {
            "Dense_0": {"kernel": s(v, 4304), "bias": s(4304)},
            "Dense_1": {"kernel": s(4304, v), "bias": s(v)},
        },
        "MultiHeadDotProductAttention_0": attn,
    }
    vision = {
        "embedding": {"kernel": s(14, 14, 3, v), "bias": s(v)},
        "pos_embedding": s(1, 4096, v),
        "Transformer": {
            "encoder_norm": {"scale": s(v), "bias": s(v)},
            "encoder": {f"encoderblock_{i}": block for i in range(vision_blocks)},
        },
    }
    return {"transformer": text, "vision_encoder": vision}


def gemma_text_rules() -> ms.Rules:
    """Tensor-parallel rules written for the text decoder only (strict)."""
    from jax.sharding import PartitionSpec as P

    return ms.Rules(
        [
            (r"input_embedding$", P("model", None)),
            (r"q_einsum/w$", P("model", None, None)),
            (r"kv_einsum/w$", P(None, "model", None, None)),
            (r"attn_vec_einsum/w$", P("model", None, None)),
            (r"gating_einsum$", P(None, "model", None)),
            (r"mlp/linear$", P("model", None)),
            (r"transformer/.*scale$", P()),
        ]
    )


def stored_codec(path: Any, key: str) -> Any:
    """The codec of the stored array of leaf ``key`` in the checkpoint (or manager step) at
    ``path``, as TensorStore reads its zarr metadata: None for raw chunks."""
    from modelshard._checkpoint.sources import locate
    from modelshard._checkpoint.stored import ArrayReader

    source = locate(path)
    reader = ArrayReader(source, source.record.by_path()[key])
    reader((slice(0, 1),) * len(reader.rec.stored_shape))  # opens the store
    return reader.store.spec().to_json()["metadata"]["compressor"]


# ---- every dtype the library stores and places ----------------------------------------

_FLOATS = ["float32", "float16", "bfloat16"]
_SMALL_FLOATS = [
    "float8_e3m4",
    "float8_e4m3",
    "float8_e4m3b11fnuz",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn",
]
_SUB_BYTE_INTS = ["int2", "uint2", "int4", "uint4"]
_INTS = ["int8", "int16", "int32", "uint8", "uint16", "uint32"]
DTYPES = [
    *_FLOATS,
    *(d for d in _SMALL_FLOATS + _SUB_BYTE_INTS if hasattr(jnp, d)),
    *_INTS,
    "bool",
    "complex64",
]


def values(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random NumPy values of ``dtype`` (its whole range for narrow integers)."""
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(dtype)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype == "complex64":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    if jnp.issubdtype(dt, jnp.integer):
        info = jnp.iinfo(dt)
        return rng.integers(max(int(info.min), -1000), min(int(info.max), 1000) + 1, shape).astype(
            dt
        )
    return (rng.standard_normal(shape) * 4).astype(dt)
