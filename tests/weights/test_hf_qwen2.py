"""Qwen2 against transformers itself: ``Qwen2ForCausalLM.save_pretrained`` (q/k/v biases,
tied as Qwen2.5's small models are) loads through the shipped ``mapping="qwen2"``, the
biases into ``nnx.Einsum``'s own ``attn/{q,k,v}/bias`` [heads, head_dim], with torch's
logits; a changed model exports as a directory that ``from_pretrained`` loads with no
missing or unexpected keys and our logits, still tied."""

from __future__ import annotations

from hf_family import Sizes, round_trip, torch_model, transformers, write_pretrained


def test_qwen2_round_trips_through_transformers(tmp_path) -> None:
    config = transformers.Qwen2Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    model = torch_model(transformers.Qwen2ForCausalLM, config)
    d = write_pretrained(model, tmp_path / "hf")
    s = Sizes.of(config, bias=True)
    changed = round_trip(d, model, s, "qwen2", tmp_path / "out")
    assert changed.layers[0].attn.k.bias[...].shape == (s.kv_heads, s.head_dim)
