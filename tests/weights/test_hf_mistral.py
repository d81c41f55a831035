"""Mistral against transformers itself: ``MistralForCausalLM.save_pretrained`` loads
through the shipped ``mapping="mistral"`` with torch's logits; a changed model exports as
a directory that ``from_pretrained`` loads with no missing or unexpected keys and our
logits."""

from __future__ import annotations

from hf_family import Sizes, round_trip, torch_model, transformers, write_pretrained


def test_mistral_round_trips_through_transformers(tmp_path) -> None:
    config = transformers.MistralConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=32,
        sliding_window=None,  # the window is the model's concern; 8 tokens fit any
        tie_word_embeddings=False,
    )
    model = torch_model(transformers.MistralForCausalLM, config)
    d = write_pretrained(model, tmp_path / "hf")
    round_trip(d, model, Sizes.of(config), "mistral", tmp_path / "out")
