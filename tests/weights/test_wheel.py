"""The built wheel carries the shipped mappings: ``pip install`` of it into a fresh venv
(its dependencies from the locked stack, nothing else fetched), then ``mapping="llama"``
loads a Hugging Face-named checkpoint there."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys, tempfile, pathlib
import numpy as np
from safetensors.numpy import save_file
import modelshard as ms

assert pathlib.Path(ms.__file__).is_relative_to(sys.prefix), ms.__file__  # the wheel's copy
d = pathlib.Path(tempfile.mkdtemp())
save_file({"model.norm.weight": np.arange(4, dtype=np.float32)}, str(d / "model.safetensors"))
(d / "config.json").write_text(json.dumps({"hidden_size": 4}))
wm = ms.load_weight_map("llama")
assert wm.target_of("model.norm.weight") == "norm/scale"
assert ms.shipped_mappings()["llama"].path.is_relative_to(sys.prefix)
got = ms.load_safetensors(d, like={"norm": {"scale": np.zeros(4, np.float32)}},
                          mapping=ms.WeightMap([r for r in wm.rules if "norm" in r.source
                                                and "layers" not in r.source]))
print(got["norm"]["scale"].tolist(), sorted(ms.shipped_mappings()))
"""


def test_the_wheel_ships_the_mappings(tmp_path) -> None:
    uv = [sys.executable, "-m", "uv"]
    if subprocess.run([*uv, "--version"], capture_output=True).returncode != 0:
        pytest.skip("uv is not installed")
    dist = tmp_path / "dist"
    subprocess.run(
        [*uv, "build", "--wheel", "--out-dir", str(dist), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = dist.glob("modelshard-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # the locked stack, as a path: the test's own modelshard (an editable finder run by a
    # .pth file of that directory) is not on it
    (Path(site) / "locked_stack.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [*uv, "pip", "install", "--no-deps", "--python", str(python), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    run = subprocess.run(
        [str(python), "-c", SCRIPT], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("] ")[0] == "[0.0, 1.0, 2.0, 3.0"
    assert "'llama'" in run.stdout and "'qwen3'" in run.stdout
