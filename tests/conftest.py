"""Shared fixtures: meshes (Auto and Explicit), real containers of every kind, and local
object-storage servers (gs:// and s3://) started once per session."""

from __future__ import annotations

import collections
import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import modelshard as ms

KINDS = ("pytree", "optax", "equinox", "nnx", "linen")


@pytest.fixture(autouse=True)
def _restore_registry():
    """Every test sees the registry as it was; registrations made in a test are undone."""
    with ms.adapters.registry_snapshot():
        yield


@pytest.fixture(params=["auto", "explicit"])
def axis_type(request) -> str:
    return request.param


@pytest.fixture
def mesh8(axis_type):
    """A (8,) mesh named ``data``."""
    return ms.make_mesh({"data": 8}, axis_types=axis_type)


@pytest.fixture
def mesh24(axis_type):
    """A (2, 4) mesh named ``data``, ``model``."""
    return ms.make_mesh({"data": 2, "model": 4}, axis_types=axis_type)


# ---- containers of every kind --------------------------------------------------------


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


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture
def container(kind) -> Any:
    """A real container of each kind (pytree, optax, equinox, nnx, linen)."""
    return MAKERS[kind]()


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


# ---- object storage on localhost: gs:// (GCS emulator) and s3:// (moto) -----------------

BUCKET = "modelshard-test"
"""The bucket both servers hold (S3 names need 3+ characters)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_server(argv: list[str], what: str, wait_s: float) -> Iterator[str]:
    """Start ``python *argv`` (a server on 127.0.0.1; ``{port}`` in argv is a free port),
    wait until it answers HTTP, yield its URL, and stop it at the end (SIGKILL if it does
    not stop)."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, *[a.format(port=port) for a in argv]],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + wait_s
    try:
        while True:
            try:
                urllib.request.urlopen(url, timeout=1)
                break
            except urllib.error.HTTPError:
                break  # it answers
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    pytest.fail(f"{what} did not start")
                time.sleep(0.1)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[dict[str, str]]:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def gcs_env() -> Iterator[dict[str, str]]:
    """A GCS emulator (in memory) holding ``BUCKET``; the environment that points
    etils.epath (gcsfs) and TensorStore at it, set for the session and yielded (for
    child processes)."""
    pytest.importorskip("gcsfs")
    pytest.importorskip("gcp_storage_emulator")
    argv = ["-m", "gcp_storage_emulator", "start", "--port", "{port}", "--in-memory"]
    with local_server([*argv, "--default-bucket", BUCKET], "the GCS emulator", 30) as url:
        env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url}
        with _environ(env):
            yield env


@pytest.fixture(scope="session")
def s3_env() -> Iterator[dict[str, str]]:
    """An S3 server (moto, in memory) holding ``BUCKET``; the environment that points
    botocore (so s3fs and etils.epath) and modelshard's TensorStore s3 spec at it, set
    for the session and yielded (for child processes)."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    boto3 = pytest.importorskip("boto3")
    with local_server(["-m", "moto.server", "-p", "{port}"], "the S3 server (moto)", 60) as url:
        env = {
            "AWS_ENDPOINT_URL": url,
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_REGION": "us-east-1",
        }
        with _environ(env):
            boto3.client("s3", endpoint_url=url).create_bucket(Bucket=BUCKET)
            yield env


@pytest.fixture(params=["gs", "s3"])
def bucket_root(request) -> str:
    """A fresh ``gs://`` or ``s3://`` folder on the local servers above."""
    request.getfixturevalue(f"{'gcs' if request.param == 'gs' else 's3'}_env")
    return f"{request.param}://{BUCKET}/{uuid.uuid4().hex[:8]}"


@pytest.fixture
def s3_root(s3_env) -> str:
    """A fresh ``s3://`` folder on the local S3 server."""
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"


# ---- counting XLA compilations --------------------------------------------------------

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def counting_compiles() -> Iterator[collections.Counter[str]]:
    """XLA compilations while the block runs, by function name (``n["jit(step)"]``).

    Counts JAX's own ``/jax/core/compile/backend_compile_duration`` monitoring event, whose
    ``fun_name`` names the compiled function (``jit(step)``, ``jit(<lambda>)``). The listener
    is unregistered on exit where this JAX can (``unregister_event_duration_listener``, or
    the private ``_unregister_event_duration_listener_by_callback`` of older versions);
    where it cannot, it stays registered but counts nothing once the block has ended.
    """
    counts: collections.Counter[str] = collections.Counter()
    active = [True]

    def listener(event: str, duration_secs: float, **kwargs: Any) -> None:
        if active[0] and event == COMPILE_EVENT:
            counts[str(kwargs.get("fun_name"))] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield counts
    finally:
        active[0] = False
        from jax._src import monitoring as _monitoring

        unregister = getattr(jax.monitoring, "unregister_event_duration_listener", None) or getattr(
            _monitoring, "_unregister_event_duration_listener_by_callback", None
        )
        if unregister is not None:
            with contextlib.suppress(AssertionError, ValueError):
                unregister(listener)


@pytest.fixture
def count_compiles() -> Callable[[], contextlib.AbstractContextManager[collections.Counter[str]]]:
    """``counting_compiles``: ``with count_compiles() as n: ...`` then ``n["jit(step)"]``."""
    return counting_compiles


def stored_codec(path: Any, key: str) -> Any:
    """The codec of the stored array of leaf ``key`` in the checkpoint (or manager step) at
    ``path``, as TensorStore reads its zarr metadata: None for raw chunks."""
    from modelshard._checkpoint.locate import locate
    from modelshard._checkpoint.stored import ArrayReader

    source = locate(path)
    reader = ArrayReader(source, source.record.by_path()[key])
    reader((slice(0, 1),) * len(reader.rec.stored_shape))  # opens the store
    return reader.store.spec().to_json()["metadata"]["compressor"]
