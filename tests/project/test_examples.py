"""Every example runs (fast settings) so none can rot.

All examples run in ONE subprocess: it simulates 8 CPU devices (each example sets that at
its top, before JAX starts), imports every example module, then calls each ``main(fast=True)``
and reports what it returned as JSON. Sharing one process pays JAX's import once; XLA's
backend optimisations are turned down because the examples' arrays are tiny and compile
time dominates.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# one worker runs this file (its module fixtures start processes once)
pytestmark = pytest.mark.xdist_group("examples")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))
MARK = "@@EXAMPLE-RESULTS@@"

_RUNNER = r"""
import importlib.util, json, os, sys, time, traceback
from pathlib import Path

modules = {}
sys.path.insert(0, str(Path(sys.argv[2]).parent))  # examples import their shared _common
for path in sys.argv[2:]:
    name = Path(path).stem
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    modules[name] = module
results = {}
for name, module in modules.items():
    start = time.perf_counter()
    try:
        out = module.main(fast=True)
        results[name] = {"ok": True, "out": out, "seconds": time.perf_counter() - start}
    except BaseException:
        results[name] = {"ok": False, "error": traceback.format_exc()}
print(sys.argv[1] + json.dumps(results, default=lambda x: x.item() if hasattr(x, "item") else str(x)))
"""


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        COLUMNS="140",
        XLA_FLAGS="--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
    )
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, MARK, *map(str, EXAMPLES)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    assert proc.returncode == 0 and lines, proc.stdout[-4000:] + proc.stderr[-6000:]
    out = json.loads(lines[-1][len(MARK) :])
    out["_stdout"] = proc.stdout
    return out


def _ok(results: dict[str, Any], name: str) -> dict[str, Any]:
    r = results[name]
    assert r["ok"], r.get("error")
    return r["out"]


def _falls(losses: list[float]) -> bool:
    half = len(losses) // 2
    return sum(losses[half:]) / len(losses[half:]) < losses[0]


def test_every_example_is_run(results: dict[str, Any]) -> None:
    assert {p.stem for p in EXAMPLES} <= set(results)


def test_demo(results: dict[str, Any]) -> None:
    out = _ok(results, "demo")
    assert _falls(out["pretrain_losses"])
    assert _falls(out["finetune_losses"])
    # tensor parallel over 4 keeps more per device than FSDP over 8, but far less than all
    assert out["bytes_before"] < out["bytes_after"] < out["bytes_replicated"]
    text = results["_stdout"]
    assert (
        "modelshard plan" in text and "mesh (data=8)" in text and "mesh (data=2, model=4)" in text
    )


def test_equinox_lm(results: dict[str, Any]) -> None:
    out = _ok(results, "equinox_lm")
    assert _falls(out["pretrain_losses"]) and _falls(out["finetune_losses"])
    assert out["up_spec"] == "P('model', None)"  # restored straight into tensor parallel


def test_linen_scan(results: dict[str, Any]) -> None:
    out = _ok(results, "linen_scan")
    assert _falls(out["pretrain_losses"]) and _falls(out["finetune_losses"])
    assert out["step"] == 14  # pretrain + fine-tune steps, carried through save/restore
    # the scanned kernel (layers, embed, mlp) and its adam moment: mlp -> model
    assert out["up_spec"] == out["moment_spec"] == "P(None, None, 'model')"


def test_constrain_activations(results: dict[str, Any]) -> None:
    out = _ok(results, "constrain_activations")
    assert out["hidden_spec"] == "P('data', None, 'model')"
    assert out["max_err"] < 1e-4
    assert "6 is not divisible by 4" in out["problem"]


def test_restore_without_code(results: dict[str, Any]) -> None:
    out = _ok(results, "restore_without_code")
    assert out["paths"] == ["down/bias", "down/kernel", "embed/embedding", "up/bias", "up/kernel"]
    assert out["tp_spec"] == "P(None, 'model')"
    assert "changed  up/kernel" in out["error"]


def test_custom_container(results: dict[str, Any]) -> None:
    out = _ok(results, "custom_container")
    assert out["losses"][-1] < out["losses"][0] / 2
    assert "opt/0/mu/w1" in out["paths"] and "weights/w1" in out["paths"]
    assert out["step"] == 10


def _import_example(name: str) -> Any:
    import importlib.util

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        spec = importlib.util.spec_from_file_location(
            f"example_{name}", ROOT / "examples" / f"{name}.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "examples"))
    return module


def test_demo_full_size_plans_and_rules_file_agree() -> None:
    """`make demo` runs the full size, which the suite does not train: plan it abstractly on
    both layouts, and check the TOML the demo hands to `modelshard reshard` says the same as
    its Python rules."""
    import tomllib

    import jax
    import optax
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    import modelshard as ms
    from modelshard._specs.rulesfile import parse_rules

    demo = _import_example("demo")
    cfg = demo.Config()
    tx = optax.adamw(cfg.lr)

    def init_state() -> dict[str, Any]:
        params = nnx.state(demo.CharLM(cfg, nnx.Rngs(0)), nnx.Param)
        return {"params": params, "opt": tx.init(params)}

    abstract = jax.eval_shape(init_state)
    fsdp = ms.plan(abstract, demo.FSDP, ms.make_mesh({"data": 8}, abstract=True))
    tp = ms.plan(abstract, demo.TP_RULES, ms.make_mesh({"data": 2, "model": 4}, abstract=True))
    assert fsdp.bytes_per_device() < tp.bytes_per_device() < tp.total_bytes
    assert tp["params/blocks/0/up/kernel"].spec == P(None, "model")
    assert tp["opt/0/mu/blocks/0/up/kernel"].spec == P(None, "model")
    toml_rules = parse_rules(tomllib.loads(demo.TP_RULES_TOML))
    assert toml_rules.rules == demo.TP_RULES.rules


def test_llama_weights(results: dict[str, Any]) -> None:
    out = _ok(results, "llama_weights")
    assert out["max_err"] < 1e-4  # logits match the NumPy reference on the stored tensors
    assert out["bit_exact"]  # exported back in the checkpoint's names, shapes, dtypes
    assert out["q_spec"] == "P('data', 'model', None)"
    assert out["lora_b_zero"]  # the new LoRA adapters kept their init
    assert len(out["skipped"]) == 2 and all("inv_freq" in s for s in out["skipped"])
    assert "lm_head.weight" in out["exported"]


def test_qwen_weights(results: dict[str, Any]) -> None:
    out = _ok(results, "qwen_weights")
    for family, extra in (("qwen2", [4, 16]), ("qwen3", [32])):
        got = out[family]
        assert got["max_err"] < 1e-4  # logits match the NumPy reference on the stored tensors
        assert got["bit_exact"]  # exported back in the checkpoint's names, shapes, dtypes
        assert got["q_spec"] == "P('data', 'model', None)"
        assert got["extra_shape"] == extra  # q bias [heads, head_dim]; q_norm [head_dim]
        assert got["files"] == ["config.json", "model.safetensors"]  # a model directory
    assert "model.layers.1.self_attn.v_proj.bias" in out["qwen2"]["exported"]
    assert "model.layers.1.self_attn.k_norm.weight" in out["qwen3"]["exported"]
    assert not out["qwen2"]["has_head"] and "lm_head.weight" not in out["qwen2"]["exported"]
    assert out["qwen3"]["has_head"] and "lm_head.weight" in out["qwen3"]["exported"]


def test_linen_to_nnx(results: dict[str, Any]) -> None:
    out = _ok(results, "linen_to_nnx")
    assert out["max_err"] < 1e-4  # the NNX model restored through the mapping = linen's
    assert out["bit_exact"]  # and mapped back into linen's layout, restored by linen
    assert out["up_spec"] == "P(None, 'model')"
