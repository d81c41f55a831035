"""Plain helpers the tests share (fixtures live in ``conftest.py``): real containers of
every kind (``MAKERS``), an abstract Gemma-like state and its rules, and the codec a
checkpoint stored a leaf with. Tests import them with ``from helpers import ...``
(``tests`` is on pytest's ``pythonpath``)."""

from __future__ import annotations

import functools
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from safetensors.numpy import save_file

import modelshard as ms

KINDS = ("pytree", "optax", "equinox", "nnx", "linen")


def same_container(a: Any, b: Any) -> bool:
    """Equal structure, type and array values (static leaves compared with ==)."""
    fa, fb = ms.adapters.split(a), ms.adapters.split(b)
    if type(a) is not type(b) or len(fa.leaves) != len(fb.leaves):
        return False
    for x, y in zip(fa.leaves, fb.leaves, strict=True):
        if ms.adapters.is_array(x):
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                x, y = jax.random.key_data(x), jax.random.key_data(y)
            if not np.array_equal(np.asarray(x), np.asarray(y)):
                return False
        elif x is not y and x != y:
            return False
    return True


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
    # Each build traces and compiles the scanned layers again (about half a second, and
    # many tests build one): with no mesh or default device set, a copy of the first
    # build, fresh arrays and containers, the same values.
    if jax.sharding.get_abstract_mesh().empty and jax.config.jax_default_device is None:
        return jax.tree.map(jnp.copy, _first_linen())
    return _build_linen()


@functools.cache
def _first_linen() -> Any:
    return _build_linen()


def _build_linen() -> Any:
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
    from modelshard._checkpoint.reader import ArrayReader
    from modelshard._checkpoint.sources import locate

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


# ---- the command-line tests: a rules file, a weight map, one error line -----------------

RULES = """
[[rules]]
pattern = 'embedding$'
spec = ["vocab", "none"]

[[rules]]
pattern = 'kernel$'
spec = ["none", "model"]

[[rules]]
pattern = ".*"
spec = []

[logical]
vocab = "model"
"""


def one_line(err: str, command: str) -> str:
    """``err`` (stderr of a failed command), checked to be the one ``modelshard CMD: error:`` line."""
    assert err.startswith(f"modelshard {command}: error: "), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


CONVERT_MAP = r"""
[[rules]]
source = 'l\.(\d+)\.up\.weight'
target = "layers/{1}/up/kernel"
transpose = [1, 0]

[[rules]]
source = 'norm\.weight'
target = "norm/scale"
"""


# ---- the weights tests: safetensors files, tied embeddings, Llama checkpoints of any size ----

BF16 = ml_dtypes.bfloat16


RNG = np.random.default_rng(7)


def save_tensors(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def tied_checkpoint(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray], ms.WeightMap]:
    t = {
        "embed.weight": RNG.standard_normal((32, 8)).astype(BF16),
        "norm.weight": RNG.standard_normal(8).astype(BF16),
    }
    path = save_tensors(tmp_path / "tied.safetensors", t)
    wm = ms.WeightMap(
        [
            ms.MapRule(r"embed\.weight", "embed/embedding"),
            ms.MapRule(r"norm\.weight", "norm/scale"),
            ms.MapRule(
                r"embed\.weight",
                "head/kernel",
                transpose=(1, 0),
                also=True,
                untied="lm_head.weight",
            ),
        ]
    )
    return path, t, wm


def llama_of_size(
    root: Path, embed: int, heads: int, kv: int, head_dim: int, *, inv_freq: bool = False
) -> dict[str, np.ndarray]:
    """A one-layer Llama checkpoint in Hugging Face's names and layout, with its
    config.json (written as current transformers does: no rotary_emb.inv_freq)."""
    import json

    mlp, vocab = 3 * embed, 40

    def w(*shape: int) -> np.ndarray:
        return RNG.standard_normal(shape).astype(BF16)

    p = "model.layers.0."
    t = {
        "model.embed_tokens.weight": w(vocab, embed),
        p + "self_attn.q_proj.weight": w(heads * head_dim, embed),
        p + "self_attn.k_proj.weight": w(kv * head_dim, embed),
        p + "self_attn.v_proj.weight": w(kv * head_dim, embed),
        p + "self_attn.o_proj.weight": w(embed, heads * head_dim),
        p + "mlp.gate_proj.weight": w(mlp, embed),
        p + "mlp.up_proj.weight": w(mlp, embed),
        p + "mlp.down_proj.weight": w(embed, mlp),
        p + "input_layernorm.weight": w(embed),
        p + "post_attention_layernorm.weight": w(embed),
        "model.norm.weight": w(embed),
        "lm_head.weight": w(vocab, embed),
    }
    if inv_freq:
        t[p + "self_attn.rotary_emb.inv_freq"] = np.ones(head_dim // 2, np.float32)
    root.mkdir(parents=True, exist_ok=True)
    save_tensors(root / "model.safetensors", t)
    config = {
        "model_type": "llama",
        "hidden_size": embed,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
    }
    (root / "config.json").write_text(json.dumps(config))
    return t


# ---- checkpoints under crashes and damage: bit-exact comparison, the forking saver -------

SCRIPTS = Path(__file__).parent / "checkpoint" / "ckpt_scripts"


def array_bits(x: Any) -> tuple[str, tuple[int, ...], bytes]:
    """dtype, shape and raw bytes: what "bit-exact" compares (typed keys by their data)."""
    dtype = str(x.dtype)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        dtype = f"{dtype}:{jax.random.key_impl(x)}"
        x = jax.random.key_data(x)
    a = np.asarray(x)
    return dtype, a.shape, np.ascontiguousarray(a).tobytes()


def assert_bit_exact(want: Any, got: Any, where: Any = "") -> None:
    flat_want = jax.tree_util.tree_flatten_with_path(want)[0]
    flat_got = jax.tree_util.tree_flatten_with_path(got)[0]
    assert [p for p, _ in flat_got] == [p for p, _ in flat_want], where
    bad = [
        jax.tree_util.keystr(p)
        for (p, a), (_, b) in zip(flat_want, flat_got, strict=True)
        if array_bits(a) != array_bits(b)
    ]
    assert not bad, f"{where}: not bit-exact: {bad}"


class Zygote:
    """``ckpt_scripts/save_loop.py``: imports once, forks a saver per :meth:`start`."""

    def __init__(self, timeout_s: float):
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "save_loop.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.deadline = time.monotonic() + timeout_s
        self.tmp = Path(tempfile.mkdtemp(prefix="zygote"))
        self.saver: int | None = None
        threading.Thread(target=self._read, daemon=True).start()
        self.expect("READY")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def expect(self, prefix: str) -> str:
        while True:
            left = self.deadline - time.monotonic()
            assert left > 0, f"timed out waiting for {prefix!r}"
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if re.match(prefix, line):
                return line

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def x64(self, timeout_s: float) -> str:
        """Fork a child that round-trips 64-bit dtypes; return its ``X64 OK`` line."""
        self.deadline = time.monotonic() + timeout_s
        self.send(f"x64 {self.tmp}")
        pid = self.expect("FORKED ").split()[1]
        line = self.expect(f"X64 OK|{pid} FAILED")
        return line

    def start(self, root: Path) -> int:
        """Fork a saver on ``root``; return the step it resumes at once its backend is up.
        The saver's START may come before the zygote's FORKED line (both write one pipe)."""
        self.send(f"fork {root}")
        first = self.expect(r"FORKED |\d+ START ")
        if first.startswith("FORKED "):
            self.saver = int(first.split()[1])
            return int(self.expect(f"{self.saver} START ").split()[2])
        pid, _, step = first.split()
        self.saver = int(pid)
        self.expect(f"FORKED {pid}$")
        return int(step)

    def kill_saver(self) -> list[str]:
        """SIGKILL the saver, wait until it is gone; return what it printed since START."""
        assert self.saver is not None
        os.kill(self.saver, signal.SIGKILL)
        while os.path.exists(f"/proc/{self.saver}") and pid_alive(self.saver):
            assert time.monotonic() < self.deadline, "the killed saver did not go away"
            time.sleep(0.01)
        self.saver = None
        out = []
        while not self.lines.empty():
            out.append(self.lines.get())
        return out

    def close(self) -> None:
        if self.saver is not None:
            os.kill(self.saver, signal.SIGKILL)
        self.proc.kill()
        self.proc.wait(timeout=30)
        shutil.rmtree(self.tmp, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"
    except OSError:
        return False


DAMAGED_HINT = (
    "hint: a file of the checkpoint is damaged or missing (a copy cut short, a disk fault); "
    "use a complete copy of it, or an earlier checkpoint."
)
"""The last line of every error of a checkpoint whose files cannot be read."""


def largest_data_file(path: Path) -> Path:
    return max((f for f in path.rglob("*") if f.parent.name == "d"), key=lambda f: f.stat().st_size)


def flip_byte(f: Path) -> None:
    """Flip the bits of the middle byte of ``f`` (damage no size check sees)."""
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


def truncate_file(f: Path) -> None:
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 2)


def launch_argv(
    *command: str, n: int = 2, devices: int = 4, timeout: float = 240, grace: float = 1
) -> list[str]:
    """``modelshard launch -n N --devices-per-process D --timeout T --grace G -- COMMAND`` as
    an argv for ``subprocess``: the launcher bounds its processes, so killing it (a test's
    backstop) kills them too."""
    from modelshard._runtime import processes as launch

    return [
        sys.executable, launch.__file__, "-n", str(n), "--devices-per-process", str(devices),
        "--timeout", str(timeout), "--grace", str(grace), "--", *command,
    ]  # fmt: skip


def assert_every_leaf_restored(saved: Any, restored: Any, where: Any = "") -> None:
    """Every leaf of ``saved`` is in ``restored`` at its canonical path, with its value:
    arrays bit for bit (a NumPy one as an array of its dtype), Python values of the same
    type and equal (``repr``: NaN equals NaN, -0.0 is not 0.0). Code among the leaves (an
    activation function) is not state and is not compared."""

    def leaves(tree: Any) -> dict[str, Any]:
        flat = ms.adapters.split(tree)
        out = dict(zip(flat.paths, flat.arrays, strict=True))
        out.update({p: x for _, p, x in flat.statics() if not callable(x)})
        return out

    want, got = leaves(saved), leaves(restored)
    dropped = sorted(set(want) - set(got))
    assert not dropped, f"{where}: leaves dropped by the save or the restore: {dropped}"
    for p, x in want.items():
        y = got[p]
        if ms.adapters.is_array(x):
            assert ms.adapters.is_array(y), f"{where}: {p}: {type(y).__name__}, not an array"
            assert array_bits(np.asarray(x)) == array_bits(np.asarray(y)), f"{where}: {p}"
        else:
            assert (type(y), repr(y)) == (type(x), repr(x)), f"{where}: {p}: {y!r} != {x!r}"


@functools.cache
def _guide_mlp_class() -> type:
    from flax import nnx

    class TwoLayerMLP(nnx.Module):
        def __init__(self, dim: int, rngs: nnx.Rngs):
            self.linear1 = nnx.Linear(dim, dim, rngs=rngs, use_bias=False)
            self.bn = nnx.BatchNorm(dim, rngs=rngs)
            self.linear2 = nnx.Linear(dim, dim, rngs=rngs, use_bias=False)

        def __call__(self, x: Any) -> Any:
            return self.linear2(self.bn(self.linear1(x)))

    return TwoLayerMLP


def guide_mlp(dim: int = 16, seed: int = 0) -> Any:
    """The model of the Flax NNX checkpointing guide: two ``Linear`` layers around a
    ``BatchNorm`` (one class for every call)."""
    from flax import nnx

    return _guide_mlp_class()(dim, rngs=nnx.Rngs(seed))


def boxed_train_state(seed: int = 0, step: int = 0) -> Any:
    """A linen ``TrainState`` whose params are boxed (``LogicallyPartitioned`` and
    ``Partitioned`` kernels) with an adamw state, whose moments are boxed too; ``step``
    a Python int, as ``TrainState.create`` makes it."""
    import flax.linen as nn
    import optax
    from flax.training import train_state

    init = nn.initializers.lecun_normal()

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            x = nn.Dense(16, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
            return nn.Dense(8, kernel_init=nn.with_partitioning(init, (None, "data")))(x)

    model = Model()
    params = model.init(jax.random.key(seed), jnp.ones((1, 8)))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(0.1))
    grads = jax.tree.map(jnp.ones_like, params)
    return state.apply_gradients(grads=grads).replace(step=step)  # moments not zero


_WRITER = r"""
import os, sys
exec(sys.argv[1])  # defines write(i); writes the first content before READY
print("READY", flush=True)
for _ in sys.stdin:
    pid = os.fork()
    if pid == 0:
        i = 1
        while True:
            write(i)
            i += 1
    print(pid, flush=True)
    os.waitpid(pid, 0)
    print("REAPED", flush=True)
"""


def kill_while_writing(
    path: Path, setup: str, kills: int = 20, seed: int = 0, timeout_s: float = 60
) -> list[bytes]:
    """``path``'s bytes after each of ``kills`` SIGKILLs of a writer at a random moment.

    ``setup`` (Python) defines ``write(i)``, called with ``0`` once, then ``1, 2, ...`` in
    a loop by a child forked from one process that imported everything once (so a kill
    costs a fork, not an interpreter start)."""
    import random

    rng = random.Random(seed)
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, setup],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.strip())

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout_s

    def expect() -> str:
        left = deadline - time.monotonic()
        try:
            return lines.get(timeout=max(left, 0.01))
        except queue.Empty:
            raise AssertionError(f"the writer did not answer within {timeout_s} s") from None

    seen = []
    try:
        assert expect() == "READY"
        assert proc.stdin is not None
        for _ in range(kills):
            proc.stdin.write("go\n")
            proc.stdin.flush()
            pid = int(expect())
            time.sleep(rng.uniform(0.005, 0.05))
            os.kill(pid, signal.SIGKILL)
            assert expect() == "REAPED"
            seen.append(path.read_bytes())
    finally:
        proc.kill()
        proc.wait(timeout=30)
    return seen


_RNG = np.random.default_rng(0)


def rand(shape: tuple[int, ...], dtype: Any = BF16) -> np.ndarray:
    """Standard-normal values of ``dtype`` (drawn in float32) from one shared generator."""
    return _RNG.standard_normal(shape).astype(np.float32).astype(dtype)


def row_layers(mesh: Any, n: int = 6, cols: int = 8) -> dict[str, Any]:
    """``n`` layers of one (64, cols) float32 ``w`` each, rows sharded over ``data``."""
    rows = NamedSharding(mesh, PartitionSpec("data"))
    return {
        f"layer{i}": {
            "w": jax.device_put(
                jnp.arange(64 * cols, dtype=jnp.float32).reshape(64, cols) + i, rows
            )
        }
        for i in range(n)
    }


# ---- shard_jit tests: one small dict of params, placed anywhere --------------------------

JIT_RULES = ms.Rules([("w$", PartitionSpec("data", None)), ("b$", PartitionSpec())])


def jit_params() -> dict[str, Any]:
    """A (16, 4) ``w`` and a (4,) ``b``: ``JIT_RULES`` shards ``w`` by rows."""
    return {"w": jnp.arange(64.0).reshape(16, 4), "b": jnp.ones(4)}


def committed_to_device0(tree: Any) -> Any:
    """Every leaf committed to the first device."""
    return jax.tree_util.tree_map(lambda x: jax.device_put(x, jax.devices()[0]), tree)


def sharded_otherwise(tree: Any, mesh: Any) -> Any:
    """Every leaf sharded along its last dimension (replicated where ``data`` does not divide it)."""

    def put(x: Any) -> Any:
        spec = (
            PartitionSpec(*([None] * (x.ndim - 1)), "data")
            if x.shape[-1] % 8 == 0
            else PartitionSpec()
        )
        return jax.device_put(x, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map(put, tree)


def two_processes(
    *args: str,
    env: dict[str, str],
    script: Path,
    limit_s: float = 240,
    ended: list[float] | None = None,
    stuck: list[int] | None = None,
) -> tuple[list[int], list[str]]:
    """Start ``script`` with ``args`` as two JAX processes of 4 CPU devices each, as a
    scheduler would, each with ``env`` (its MODELSHARD_* variables) on a coordinator port of
    its own; their exit codes and outputs once both ended (SIGKILLed after ``limit_s``), in
    ``ended`` the time (``time.time()``) each one's exit was seen, and in ``stuck`` the
    processes the backstop killed (their stacks are in their output)."""
    from modelshard._runtime import processes as _launch

    ended = [0.0, 0.0] if ended is None else ended
    stuck = [] if stuck is None else stuck
    reservation = _launch.reserve_port()
    port = reservation.getsockname()[1] if reservation is not None else _launch.free_port()
    procs: list[subprocess.Popen[str]] = []
    readers: list[threading.Thread] = []
    try:
        for i in range(2):
            child = _launch.child_env(dict(os.environ), f"127.0.0.1:{port}", 2, i, 4)
            child.update(env)
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), *args],
                    env=child,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        outputs = ["", ""]

        def read(i: int) -> None:
            stream = procs[i].stdout
            assert stream is not None
            outputs[i] = stream.read()
            procs[i].wait()
            ended[i] = time.time()

        readers += [threading.Thread(target=read, args=(i,)) for i in range(2)]
        for t in readers:
            t.start()
        for t in readers:
            t.join(limit_s)
    finally:
        stuck += [i for i, p in enumerate(procs) if p.poll() is None]
        for i in stuck:  # the scripts dump their threads' stacks on SIGUSR1
            procs[i].send_signal(signal.SIGUSR1)
        time.sleep(3 if stuck else 0)
        for i in stuck:  # the backstop: nothing outlives the test
            procs[i].kill()
            procs[i].wait()
        for t in readers:
            t.join(10)
        if reservation is not None:
            reservation.close()
    return [p.returncode for p in procs], outputs


def checksums(arrays: Sequence[Any]) -> list[str]:
    """Each array's ``"xxxxxxxx:yyyyyyyy"`` checksum, summed by the collector saves and
    restores use (``checksum.Checksums``)."""
    from modelshard._checkpoint.checksum import Checksums

    xs = dict(enumerate(arrays))
    return list(Checksums(xs).collect(xs).values())
