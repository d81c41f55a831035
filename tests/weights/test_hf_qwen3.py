"""Qwen3 against transformers itself: ``Qwen3ForCausalLM.save_pretrained`` (per-head q/k
RMSNorms, a head_dim apart from hidden_size / heads) loads through the shipped
``mapping="qwen3"``, the norms into ``attn/{q,k}_norm/scale`` [head_dim], with torch's
logits; a changed model exports as a directory that ``from_pretrained`` loads with no
missing or unexpected keys and our logits."""

from __future__ import annotations

from hf_family import Sizes, round_trip, torch_model, transformers, write_pretrained


def test_qwen3_round_trips_through_transformers(tmp_path) -> None:
    config = transformers.Qwen3Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,  # 4 * 16 != 32, as in Qwen3 0.6B (16 * 128 != 1024)
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    model = torch_model(transformers.Qwen3ForCausalLM, config)
    d = write_pretrained(model, tmp_path / "hf")
    s = Sizes.of(config, qk_norm=True)
    changed = round_trip(d, model, s, "qwen3", tmp_path / "out")
    assert changed.layers[1].attn.q_norm.scale[...].shape == (s.head_dim,)
