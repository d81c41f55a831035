"""Rules with ops (``_weights/rules.py``, ``ops.py``, ``steps.py``, ``resolution.py``):
malformed or misfitting ops listed all at once, shadowed and skip rules, the mapping table,
untie names."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import modelshard as ms
from helpers import save_tensors, tied_checkpoint

BF16 = ml_dtypes.bfloat16


RNG = np.random.default_rng(7)


def test_malformed_ops_are_listed_all_at_once() -> None:
    with pytest.raises(ms.MappingError) as info:
        ms.WeightMap(
            [
                ms.MapRule("a", "a", ops=[ms.Rearrange("(h d) e -> h d")]),
                ms.MapRule("b", "b", ops=[ms.Rearrange("h e -> e h", h=4)]),
                ms.MapRule("c", "c", ops=[ms.Transpose((0, 0)), ms.Scale(0.0)]),
                ms.MapRule("d", "d", transpose=(1, 0), ops=[ms.Add(1.0)]),
                ms.MapRule("e", "e", ops=["transpose"]),  # type: ignore[list-item]
                ms.MapRule("f", "f", untied="lm_head.weight"),
                ms.MapRule("g", None, also=True),
            ]
        )
    assert str(info.value).splitlines() == [
        "8 mapping problems found (every offending tensor, leaf and rule is listed; paths are "
        "source:NAME, target:PATH, mapping:rules[i]):",
        "  mapping:rules[0].ops[0]",
        "    problem: rearrange '(h d) e -> h d': every axis must be on both sides: e only in "
        "the input",
        '    hint: einops notation: "(h d) e -> h e d"',
        "  mapping:rules[1].ops[0]",
        "    problem: rearrange 'h e -> e h': size h=4 is not an axis inside a group",
        "    hint: sizes are given for the axes inside parentheses",
        "  mapping:rules[2].ops[0]",
        "    problem: transpose (0, 0) is not a permutation of 0..1",
        "  mapping:rules[2].ops[1]",
        "    problem: scale(0): multiplying by zero cannot be undone on export",
        "  mapping:rules[3]",
        "    problem: a rule takes ops or transpose/reshape, not both",
        "    hint: write Transpose(...) and Reshape(...) into ops",
        "  mapping:rules[4].ops[0]",
        "    problem: 'transpose' is not an operation",
        "    hint: use Rearrange, Transpose, Reshape, Add or Scale",
        "  mapping:rules[5]",
        "    problem: untied 'lm_head.weight' needs also=True",
        "    hint: untied names the stored tensor an untied export writes an also leaf as",
        "  mapping:rules[6]",
        "    problem: an also rule needs a target (it fills another leaf)",
    ]


def test_ops_that_do_not_fit_the_tensors_are_listed_all_at_once(tmp_path: Path) -> None:
    path = save_tensors(
        tmp_path / "m.safetensors",
        {
            "a": np.zeros((12, 5), np.float32),
            "b": np.zeros((6, 5), np.float32),
            "c": np.zeros(3, np.int32),
            "d": np.zeros((4, 4), np.float32),
        },
    )
    wm = ms.WeightMap(
        [
            ms.MapRule("a", "a", ops=[ms.Rearrange("(h d) e -> h e d", h=5)]),
            ms.MapRule("b", "b", ops=[ms.Rearrange("(h d) e f -> h e d f", h=2)]),
            ms.MapRule("c", "c", ops=[ms.Add(1.0)]),
            ms.MapRule("d", "d", ops=[ms.Rearrange("(h d) e -> h e d", h="heads")]),
        ]
    )
    with pytest.raises(ms.MappingError) as info:
        ms.load_safetensors(path, mapping=wm, dry_run=True)
    assert str(info.value).splitlines() == [
        "4 mapping problems found (every offending tensor, leaf and rule is listed; paths are "
        "source:NAME, target:PATH, mapping:rules[i]):",
        "  source:a float32[12, 5]",
        "    problem: rearrange((h d) e -> h e d): axis of size 12 does not divide by 5 (rules[0])",
        "  source:b float32[6, 5]",
        "    problem: rearrange((h d) e f -> h e d f) expects 3 axes, the tensor has 2 (rules[1])",
        "  source:d float32[4, 4]",
        "    problem: rearrange size 'heads' is not in the mapping's config (empty) (rules[3])",
        "    hint: add heads = <size> to the config",
        "  source:c int32[3]",  # the file's order: save_file puts 4-byte floats first
        "    problem: add(1.0) needs a floating-point tensor, not int32 (rules[2])",
        "    hint: add applies to float tensors only",
    ]


def test_untie_needs_the_rules_untied_name(tmp_path: Path) -> None:
    path, _, wm = tied_checkpoint(tmp_path)
    out = ms.load_safetensors(path, mapping=wm)
    rules = [
        *wm.rules[:2],
        ms.MapRule(r"embed\.weight", "head/kernel", transpose=(1, 0), also=True),
    ]
    with pytest.raises(ms.MappingError) as info:
        ms.save_safetensors(
            tmp_path / "b.safetensors", out, reference=path, mapping=ms.WeightMap(rules), untie=True
        )
    assert str(info.value).splitlines()[1:] == [
        "  mapping:rules[2]",
        "    problem: untie=True, but this also rule names no untied tensor to write "
        "head/kernel as",
        '    hint: give the rule untied="..." (lm_head.weight)',
    ]


def test_rearrange_sizes_that_do_not_fit_are_named(tmp_path: Path) -> None:
    path = save_tensors(tmp_path / "m.safetensors", {"a": np.zeros((12, 5), np.float32)})
    cases = {
        ms.Rearrange("(h d) e -> h e d", h=5, d=3): "axis of size 12 is not h=5 * d=3",
        ms.Rearrange("(h d t) e -> h e d t", h=2): "give the size of all but one of d, t",
        ms.Rearrange("() (h d) e -> h e d", h=3): "expects 3 axes, the tensor has 2",
    }
    for op, what in cases.items():
        wm = ms.WeightMap([ms.MapRule("a", "a", ops=[op])])
        with pytest.raises(ms.MappingError) as info:
            ms.load_safetensors(path, mapping=wm, dry_run=True)
        assert str(info.value).splitlines()[2] == (
            f"    problem: rearrange({op.pattern}): {what} (rules[0])"
            if "expects" not in what
            else f"    problem: rearrange({op.pattern}) {what} (rules[0])"
        )


def test_the_mapping_table_shows_names_and_templates_as_written(tmp_path: Path) -> None:
    path = save_tensors(tmp_path / "m.safetensors", {"w[qkv]": np.zeros((2, 2), np.float32)})
    wm = ms.WeightMap([ms.MapRule(r"w\[qkv\]", "attn/[bold]/w", ops=[ms.Scale(2.0)])])
    table = str(ms.load_safetensors(path, mapping=wm, dry_run=True))
    assert "attn/[bold]/w" in table and "w[qkv]" in table and "scale(2.0)" in table


def test_a_skip_rule_that_matches_nothing_is_no_error_under_strict(tmp_path: Path) -> None:
    """skip means "ignore if present": current checkpoints store no rotary_emb.inv_freq;
    a rule with a target that matches nothing is still an error."""
    path = save_tensors(tmp_path / "m.safetensors", {"w": np.zeros((2, 2), np.float32)})
    wm = ms.WeightMap([ms.MapRule("w", "w"), ms.MapRule(r".*\.rotary_emb\.inv_freq", None)])
    assert wm.strict
    res = ms.load_safetensors(path, mapping=wm, dry_run=True)
    assert list(res.recipes) == ["w"] and res.skipped == []
    wm = ms.WeightMap([ms.MapRule("w", "w"), ms.MapRule("v", "v")])
    with pytest.raises(ms.MappingError) as info:
        ms.load_safetensors(path, mapping=wm, dry_run=True)
    assert str(info.value).splitlines()[1:3] == [
        "  mapping:rules[1]",
        "    problem: source 'v' matched no stored tensor",
    ]


def test_a_rule_shadowed_by_an_earlier_one_says_so(tmp_path: Path) -> None:
    t = {f"l.{i}.{n}": np.zeros((2, 2), np.float32) for i in range(2) for n in ("gate", "up")}
    path = save_tensors(tmp_path / "m.safetensors", t)
    wm = ms.WeightMap(
        [
            ms.MapRule(r"l\.(\d+)\.(\w+)", "mlp/{1}/{2}"),
            ms.MapRule(r"l\.(\d+)\.(gate|up)", "wi/{1}", stack=ms.Stack(2, order=("gate", "up"))),
            ms.MapRule(r"l\.0\.up", "up0"),
        ]
    )
    with pytest.raises(ms.MappingError) as info:
        ms.load_safetensors(path, mapping=wm, dry_run=True)
    assert str(info.value).splitlines()[1:] == [
        "  mapping:rules[1]",
        "    problem: source 'l\\\\.(\\\\d+)\\\\.(gate|up)' matches 4 stored tensors, but all were "
        "taken by an earlier rule: rules[0] ('l\\\\.(\\\\d+)\\\\.(\\\\w+)') (first match wins)",
        "    hint: move rules[1] before it, narrow the earlier regex, or give this rule "
        "also=True to fill its leaf in addition",
        "  mapping:rules[2]",
        "    problem: source 'l\\\\.0\\\\.up' matches 1 stored tensor, but it was taken by an "
        "earlier rule: rules[0] ('l\\\\.(\\\\d+)\\\\.(\\\\w+)') (first match wins)",
        "    hint: move rules[2] before it, narrow the earlier regex, or give this rule "
        "also=True to fill its leaf in addition",
    ]
