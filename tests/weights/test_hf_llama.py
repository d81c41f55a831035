"""Llama against transformers itself: ``LlamaForCausalLM.save_pretrained`` (untied, and
3.2-style tied) loads through the shipped ``mapping="llama"`` with torch's logits, by path,
by ``hf://`` id from an offline cache and through ``modelshard convert``; a changed model
exports as a directory that ``from_pretrained`` loads with no missing or unexpected keys
and our logits; tied stays tied; a sharded export round-trips."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import modelshard as ms
from hf_family import (
    TOL,
    CausalLM,
    Sizes,
    abstract,
    assert_clean,
    hub_cache,
    jax_logits,
    nudged,
    reload,
    round_trip,
    torch_logits,
    torch_model,
    transformers,
    write_pretrained,
)

# one worker runs this file (its module fixtures start processes once)
pytestmark = pytest.mark.xdist_group("hf-llama")


def _config(tied: bool) -> object:
    return transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=32,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
    )


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def written(request, tmp_path_factory) -> tuple[Path, object, Sizes]:
    config = _config(request.param)
    model = torch_model(transformers.LlamaForCausalLM, config)
    d = write_pretrained(model, tmp_path_factory.mktemp("llama") / "hf")
    return d, model, Sizes.of(config)


def test_loads_with_torchs_logits_and_exports_a_directory_transformers_loads(
    written, tmp_path
) -> None:
    d, model, s = written
    round_trip(d, model, s, "llama", tmp_path / "out")


def test_a_sharded_export_round_trips(written, tmp_path) -> None:
    d, _, s = written
    ours = nudged(ms.load_safetensors(d, like=abstract(s), mapping="llama"))
    out = ms.save_safetensors(
        tmp_path / "out", ours, reference=d, mapping="llama", max_shard_size="40KB"
    )
    assert out.name == "model.safetensors.index.json"
    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) > 1
    back, info = reload(tmp_path / "out", transformers.AutoModelForCausalLM)
    assert_clean(info)
    np.testing.assert_allclose(torch_logits(back), jax_logits(ours), atol=TOL, rtol=0)
    again = ms.load_safetensors(out, like=abstract(s), mapping="llama")
    np.testing.assert_array_equal(jax_logits(again), jax_logits(ours))


def test_loads_by_hub_id_from_an_offline_cache(written, tmp_path, monkeypatch) -> None:
    d, model, s = written
    hub_cache(tmp_path / "hf", "tiny-org/llama", d)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ours = ms.load_safetensors("hf://tiny-org/llama", like=abstract(s), mapping="llama")
    np.testing.assert_allclose(jax_logits(ours), torch_logits(model), atol=TOL, rtol=0)
    out = ms.save_safetensors(
        tmp_path / "out", ours, reference="hf://tiny-org/llama", mapping="llama"
    )
    assert (out.parent / "config.json").is_file()
    _, info = reload(out.parent, transformers.AutoModelForCausalLM)
    assert_clean(info)


def test_cli_convert_both_ways_with_torchs_logits(written, tmp_path) -> None:
    """``modelshard convert`` into a checkpoint that restores with torch's logits, and
    back (``--to safetensors`` to a directory, no ``--max-shard-size``: save_pretrained's
    default) into a model directory that ``from_pretrained`` loads with the same logits."""
    from modelshard.cli import main

    d, model, s = written
    assert main(["convert", str(d), str(tmp_path / "ckpt"), "--mapping", "llama"]) == 0
    like = abstract(s)
    graph, state = nnx.split(like)
    restored = ms.restore(tmp_path / "ckpt", like=state)
    ours = nnx.merge(graph, restored)
    np.testing.assert_allclose(jax_logits(ours), torch_logits(model), atol=TOL, rtol=0)

    out = tmp_path / "out"
    back = ["convert", str(tmp_path / "ckpt"), str(out), "--to", "safetensors"]
    assert main([*back, "--mapping", "llama", "--reference", str(d)]) == 0
    names = {"model.safetensors", "config.json", "generation_config.json"}
    assert {p.name for p in out.iterdir()} == names | {"tokenizer.json", "tokenizer_config.json"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    reloaded, info = reload(out, transformers.AutoModelForCausalLM)
    assert_clean(info)
    np.testing.assert_allclose(torch_logits(reloaded), torch_logits(model), atol=TOL, rtol=0)


def test_a_plain_and_a_lora_model_load_with_the_same_mapping(written) -> None:
    d, model, s = written
    like = _lora_model(s)  # concrete: the adapters keep its values
    ours = ms.load_safetensors(d, like=like, mapping="llama")
    a = ours.layers[1].attn.q.lora.lora_a[...]
    np.testing.assert_array_equal(a, like.layers[1].attn.q.lora.lora_a[...])
    np.testing.assert_allclose(jax_logits(ours), torch_logits(model), atol=TOL, rtol=0)
    plain = ms.load_safetensors(d, like=abstract(s), mapping="llama")
    np.testing.assert_allclose(jax_logits(plain), torch_logits(model), atol=TOL, rtol=0)


def test_lora_out_as_a_peft_adapter_and_merged_into_the_base(written, tmp_path) -> None:
    """A fine-tune's adapters: written as a peft adapter that ``PeftModel`` loads on the
    base model with our logits; merged into the base kernels and exported as a model
    directory that transformers loads with our logits."""
    peft = pytest.importorskip("peft")
    d, _, s = written
    ours = ms.load_safetensors(d, like=_lora_model(s), mapping="llama")
    rng = np.random.default_rng(1)
    for layer in ours.layers:  # a fine-tuning step: nnx.LoRA starts lora_b at zero
        for proj in (layer.attn.q, layer.attn.v):
            b = proj.lora.lora_b
            b[...] = jnp.asarray(rng.standard_normal(b[...].shape) * 0.1, jnp.float32)
    want = jax_logits(ours)

    ms.save_peft_adapter(tmp_path / "adapter", ours, reference=d, mapping="llama", alpha=8)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    assert config["target_modules"] == ["q_proj", "v_proj"]
    base, info = reload(d, transformers.AutoModelForCausalLM)
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    np.testing.assert_allclose(torch_logits(adapted), want, atol=TOL, rtol=0)

    for layer in ours.layers:  # merged: kernel + a @ b, the adapters then contribute 0
        for proj in (layer.attn.q, layer.attn.v):
            delta = proj.lora.lora_a[...] @ proj.lora.lora_b[...]
            proj.kernel[...] = proj.kernel[...] + delta.reshape(proj.kernel[...].shape)
            proj.lora.lora_b[...] = jnp.zeros_like(proj.lora.lora_b[...])
    ms.save_safetensors(tmp_path / "merged", ours, reference=d, mapping="llama")
    merged, info = reload(tmp_path / "merged", transformers.AutoModelForCausalLM)
    assert_clean(info)
    np.testing.assert_allclose(torch_logits(merged), want, atol=TOL, rtol=0)


def _lora_model(s: Sizes) -> CausalLM:
    return CausalLM(s, nnx.Rngs(0), lora=4)
