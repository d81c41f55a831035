"""Shipped mappings found by name, listed by Python and the CLI; optional rules and
patterns (a tensor or an adapter some models of a family lack); the peft adapter's and the
unknown name's errors, line by line."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

import modelshard as ms
from modelshard._weights import parse_weight_map


def test_every_shipped_mapping_reads_by_name_and_is_listed(capsys) -> None:
    from modelshard.cli import main

    shipped = ms.shipped_mappings()
    assert list(shipped) == ["llama", "mistral", "qwen2", "qwen3", "gemma3", "gemma3_checkpoint"]
    for name, m in shipped.items():
        assert m.path.is_file() and m.source and m.target
        assert ms.load_weight_map(name).rules == ms.load_weight_map(m.path).rules
    assert main(["mappings", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [m["name"] for m in doc["mappings"]] == list(shipped)
    assert doc["mappings"][2]["target"] == shipped["qwen2"].target
    assert main(["mappings"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in shipped)


def test_an_unknown_name_says_which_exist() -> None:
    with pytest.raises(ms.MappingError) as e:
        ms.load_weight_map("lama")
    assert str(e.value).splitlines() == [
        "unknown mapping:",
        "  mapping:lama",
        "    problem: no shipped mapping is named 'lama' (did you mean 'llama'?)",
        "    hint: shipped: llama, mistral, qwen2, qwen3, gemma3, gemma3_checkpoint; or give a "
        "path to a TOML mapping file",
    ]


def test_a_file_in_the_working_directory_wins_over_a_name(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama").write_text('[[rules]]\nsource = "x"\ntarget = "y"\n')
    assert len(ms.load_weight_map("llama").rules) == 1


def test_optional_rules_and_patterns_may_match_nothing_under_strict(tmp_path) -> None:
    from safetensors.numpy import save_file

    save_file({"w": np.ones((2, 3), np.float32)}, str(tmp_path / "m.safetensors"))
    wm = ms.WeightMap(
        [ms.MapRule("w", "w/kernel"), ms.MapRule("head", "head/kernel", optional=True)],
        optional=["lora_"],
    )
    like = {"w": {"kernel": jnp.zeros((2, 3))}}
    got = ms.load_safetensors(tmp_path / "m.safetensors", like=like, mapping=wm)
    np.testing.assert_array_equal(got["w"]["kernel"], np.ones((2, 3)))
    like["w"]["lora_a"] = jnp.full((3, 1), 7.0)  # an adapter: kept, with like's value
    got = ms.load_safetensors(tmp_path / "m.safetensors", like=like, mapping=wm)
    np.testing.assert_array_equal(got["w"]["lora_a"], like["w"]["lora_a"])
    strict = ms.WeightMap([ms.MapRule("w", "w/kernel"), ms.MapRule("head", "head/kernel")])
    with pytest.raises(ms.MappingError, match=r"source 'head' matched no stored tensor"):
        ms.load_safetensors(tmp_path / "m.safetensors", like=like, mapping=strict)


def test_optional_in_toml_is_checked() -> None:
    data = {"optional": "lora", "rules": [{"source": "a", "target": "a", "optional": 1}]}
    with pytest.raises(ms.MappingError) as e:
        parse_weight_map(data, "m.toml")
    assert str(e.value).splitlines() == [
        "invalid mapping file m.toml:",
        "  m.toml:optional",
        "    problem: optional must be an array of regexes, got 'lora'",
        "  m.toml:rules[0].optional",
        "    problem: optional must be true or false, got 1",
    ]
    wm = parse_weight_map({"optional": ["lora_"], "rules": [{"source": "a", "target": "a"}]}, "t")
    assert wm.optional == ("lora_",)
    with pytest.raises(ms.MappingError) as e:
        ms.WeightMap([], optional=["("])
    assert "mapping:optional[0]" in str(e.value)


def test_a_peft_adapter_needs_adapters(tmp_path) -> None:
    from safetensors.numpy import save_file

    save_file({"fc.weight": np.ones((4, 3), np.float32)}, str(tmp_path / "m.safetensors"))
    wm = ms.WeightMap([ms.MapRule(r"fc\.weight", "fc/kernel", transpose=(1, 0))])
    with pytest.raises(ms.MappingError) as e:
        ms.save_peft_adapter(
            tmp_path / "a", {"fc": {"kernel": jnp.ones((3, 4))}}, reference=tmp_path, mapping=wm
        )
    assert str(e.value).splitlines() == [
        "cannot write a peft adapter:",
        "  state:<root>",
        "    problem: no LoRA adapter (a P/lora/lora_a leaf beside P/kernel)",
        "    hint: add adapters as nnx.LoRALinear does: module.lora = nnx.LoRA(...)",
    ]
    state = {
        "fc": {
            "kernel": jnp.ones((3, 4)),
            "lora": {"lora_a": jnp.ones((3, 2)), "lora_b": jnp.ones((2, 5))},
        }
    }
    with pytest.raises(ms.MappingError) as e:
        ms.save_peft_adapter(tmp_path / "a", state, reference=tmp_path, mapping=wm)
    assert str(e.value).splitlines()[2] == (
        "    problem: lora_a [3, 2] and lora_b [2, 5] do not adapt fc.weight [4, 3] (want "
        "[3, rank], [rank, 4])"
    )
    state["fc"]["lora"]["lora_b"] = jnp.full((2, 4), 3.0)
    out = ms.save_peft_adapter(tmp_path / "a", state, reference=tmp_path, mapping=wm, alpha=4)
    from safetensors.numpy import load_file

    t = load_file(str(out / "adapter_model.safetensors"))
    assert sorted(t) == ["base_model.model.fc.lora_A.weight", "base_model.model.fc.lora_B.weight"]
    np.testing.assert_array_equal(t["base_model.model.fc.lora_B.weight"], np.full((4, 2), 1.5))
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (2, 4, ["fc"])


def test_gemma3_maps_onto_the_gemma_model_tree_and_gemma3_checkpoint_onto_the_files(
    tmp_path,
) -> None:
    """``gemma3`` gives the tree gemma's models take (no ``transformer/`` prefix, the MLP's
    einsum weights as ``mlp/gating_einsum`` and ``mlp/linear``); ``gemma3_checkpoint`` the
    official files' layout; the same values in both. gemma itself is not installed here
    (it pulls TensorFlow), so its tree is written out from its source's parameter names."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "gemma_cases", Path(__file__).with_name("test_gemma.py")
    )
    assert spec is not None and spec.loader is not None
    gemma_cases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gemma_cases)
    SMALL, _gemma_layout, _hf_checkpoint = (
        gemma_cases.SMALL,
        gemma_cases._gemma_layout,
        gemma_cases._hf_checkpoint,
    )

    _hf_checkpoint(tmp_path, SMALL)
    files = _gemma_layout(SMALL)
    model_tree = dict(files["transformer"])
    for name, layer in list(model_tree.items()):
        if name.startswith("layer_"):
            mlp = {k: v["w"] for k, v in layer["mlp"].items()}
            model_tree[name] = {**layer, "mlp": mlp}
    params = ms.load_safetensors(tmp_path, like=model_tree, mapping="gemma3")
    official = ms.load_safetensors(tmp_path, like=files, mapping="gemma3_checkpoint")
    np.testing.assert_array_equal(
        params["layer_1"]["mlp"]["gating_einsum"],
        official["transformer"]["layer_1"]["mlp"]["gating_einsum"]["w"],
    )
    np.testing.assert_array_equal(
        params["embedder"]["input_embedding"],
        official["transformer"]["embedder"]["input_embedding"],
    )
