"""A peft adapter's files: ``adapter_model.safetensors`` and ``adapter_config.json``, each
replaced durably (a killed writer leaves the old adapter or the new one)."""

from __future__ import annotations

import json
import os
import re

import numpy as np

from helpers import kill_while_writing
from modelshard._weights.peft_adapter import _write_adapter

_SETUP = """
from pathlib import Path
import numpy as np
from modelshard._weights.peft_adapter import _write_adapter
out = Path({out!r})
tensors = {{"m.lora_A.weight": np.ones((2, 4), np.float32)}}
def write(i):
    _write_adapter(out, tensors, {{"r": 2, "lora_alpha": (4, 8)[i % 2]}})
write(0)
"""


def test_adapter_config_killed_mid_write_is_the_old_or_the_new(tmp_path):
    seen = kill_while_writing(tmp_path / "adapter_config.json", _SETUP.format(out=str(tmp_path)))
    assert {json.loads(s)["lora_alpha"] for s in seen} <= {4, 8}  # parses: never cut


def test_the_config_is_synced_before_its_rename_and_the_directory_after(tmp_path, fsynced):
    tensors = {"m.lora_A.weight": np.ones((2, 4), np.float32)}
    _write_adapter(tmp_path, tensors, {"r": 2})
    names = [re.sub("[0-9a-f]{12}", "*", os.path.relpath(f, tmp_path)) for f in fsynced]
    assert names[-2:] == [".adapter_config.json.*.partial", "."]
    assert json.loads((tmp_path / "adapter_config.json").read_text()) == {"r": 2}
    assert sorted(os.listdir(tmp_path)) == ["adapter_config.json", "adapter_model.safetensors"]
