"""Folding paths that differ only in layer numbers."""

from __future__ import annotations

from modelshard._base.folding import fold, format_numbers, template


def test_template_and_numbers():
    assert template("layers_12/attn_0/w") == ("layers_#/attn_#/w", ("12", "0"))
    assert template("embed/w") == ("embed/w", ())
    assert format_numbers(["3", "0", "1", "2"]) == "0..3"
    assert format_numbers(["0", "1", "5", "7", "8", "9"]) == "0..1,5,7..9"
    assert format_numbers([str(i) for i in range(0, 100, 2)]) == "0..98 (50 values)"


def test_fold_keeps_constant_numbers_and_first_seen_order():
    paths = [f"enc/encoderblock_{i}/MlpBlock_0/Dense_0/kernel" for i in range(27)]
    paths += ["enc/head/kernel"]
    paths += [f"enc/encoderblock_{i}/MlpBlock_0/Dense_0/bias" for i in range(27)]
    groups = fold(paths, lambda p: p)
    assert [(g.path, g.count) for g in groups] == [
        ("enc/encoderblock_{0..26}/MlpBlock_0/Dense_0/kernel", 27),
        ("enc/head/kernel", 1),
        ("enc/encoderblock_{0..26}/MlpBlock_0/Dense_0/bias", 27),
    ]


def test_fold_by_key_splits_groups():
    items = [("layer_0/w", "a"), ("layer_1/w", "a"), ("layer_2/w", "b")]
    groups = fold(items, lambda x: x[0], key=lambda x: x[1])
    assert [(g.path, g.count) for g in groups] == [("layer_{0..1}/w", 2), ("layer_2/w", 1)]
    assert groups[0].items == items[:2]
