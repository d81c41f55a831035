"""A model directory's files beside the weights: ``config.json`` with the written dtype and
the reference's tokenizer files, each replaced durably (the old file or the new one)."""

from __future__ import annotations

import json
import os
import re

from helpers import kill_while_writing
from modelshard._weights import finish_model_directory


def _reference(tmp_path):
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "config.json").write_text(json.dumps({"hidden_size": 8, "torch_dtype": "float32"}))
    (ref / "tokenizer.json").write_text(json.dumps({"vocab": ["a"] * 4000}))
    out = tmp_path / "out"
    out.mkdir()
    return ref, out


def test_config_json_killed_mid_write_is_the_old_or_the_new(tmp_path):
    ref, out = _reference(tmp_path)
    setup = f"""
from pathlib import Path
from modelshard._weights import finish_model_directory
def write(i):
    dtype = ("bfloat16", "float32")[i % 2]
    finish_model_directory(Path({str(out)!r}) / "model.safetensors", {str(ref)!r}, [("w", (4,), dtype)])
write(0)
"""
    seen = kill_while_writing(out / "config.json", setup)
    configs = {json.loads(s)["torch_dtype"] for s in seen}  # parses: never empty or cut
    assert configs <= {"bfloat16", "float32"}
    assert (out / "tokenizer.json").read_bytes() == (ref / "tokenizer.json").read_bytes()


def test_each_file_is_synced_before_its_rename_and_the_directory_after(tmp_path, fsynced):
    ref, out = _reference(tmp_path)
    finish_model_directory(out / "model.safetensors", ref, [("w", (4,), "bfloat16")])
    names = [re.sub("[0-9a-f]{12}", "*", os.path.relpath(f, out)) for f in fsynced]
    assert names == [".config.json.*.partial", ".", ".tokenizer.json.*.partial", "."]
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert sorted(os.listdir(out)) == ["config.json", "tokenizer.json"]
