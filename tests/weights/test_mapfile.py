"""Ops, ``also`` and config in TOML mapping files (``_weights/mapfile.py``): the Python form,
errors line by line, sizes from config.json, typos named once with a suggestion."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import modelshard as ms
from helpers import llama_of_size, save_tensors
from modelshard._weights import parse_weight_map

ROOT = Path(__file__).parents[2]


BF16 = ml_dtypes.bfloat16


RNG = np.random.default_rng(7)


TOML = r"""
[config]
heads = 4

[[rules]]
source = 'q'
target = "q"
ops = [{ rearrange = "(h d) e -> h e d", h = "heads" }, { scale = 0.5 }]

[[rules]]
source = 'n'
target = "n"
ops = [{ add = 1.0 }, { transpose = [0] }, { reshape = [1, -1] }]

[[rules]]
source = 'e'
target = "e"

[[rules]]
source = 'e'
target = "head"
transpose = [1, 0]
also = true
untied = "lm_head.weight"
"""


def test_toml_ops_and_also_read_as_the_python_form() -> None:
    import tomllib

    wm = parse_weight_map(tomllib.loads(TOML))
    assert wm.rules[0].ops == (ms.Rearrange("(h d) e -> h e d", h="heads"), ms.Scale(0.5))
    assert wm.rules[1].ops == (ms.Add(1.0), ms.Transpose((0,)), ms.Reshape((1, -1)))
    assert wm.rules[3] == ms.MapRule(
        "e", "head", transpose=(1, 0), also=True, untied="lm_head.weight"
    )


def test_toml_op_errors_line_by_line() -> None:
    data = {
        "rules": [
            {"source": "a", "target": "a", "ops": [{"rearrange": "a b -> b a", "h": 1.5}]},
            {"source": "b", "target": "b", "ops": [{"add": 1.0, "scale": 2.0}, {}]},
            {"source": "c", "target": "c", "ops": {"add": 1.0}},
            {"source": "d", "target": "d", "ops": [{"add": "one"}], "also": "yes"},
        ]
    }
    hint = '    hint: e.g. ops = [{ rearrange = "(h d) e -> h e d", h = "heads" }, { add = 1.0 }]'
    with pytest.raises(ms.MappingError) as info:
        parse_weight_map(data, "m.toml")
    assert str(info.value).splitlines() == [
        "invalid mapping file m.toml:",
        "  m.toml:rules[0].ops[0].h",
        "    problem: size 1.5 is not an integer or a name",
        "  m.toml:rules[1].ops[0]",
        "    problem: 2 operations (add, scale): give exactly one of rearrange, transpose, "
        "reshape, add, scale",
        hint,
        "  m.toml:rules[1].ops[1]",
        "    problem: no operation: give exactly one of rearrange, transpose, reshape, add, scale",
        hint,
        "  m.toml:rules[2].ops",
        "    problem: {'add': 1.0} is not an array of tables",
        hint,
        "  m.toml:rules[3].ops[0].add",
        "    problem: 'one' is not a number",
        "  m.toml:rules[3].also",
        "    problem: also must be true or false, got 'yes'",
    ]


def test_one_llama_file_serves_every_size_from_config_json(tmp_path: Path) -> None:
    """hf_llama.toml takes its sizes from config.json: a [32, 32] q_proj of 8 heads is
    [embed 32, heads 8, head_dim 4], not the example's [64, 4, 16]; without a config.json
    the missing size is said once per rule."""
    mapping = ROOT / "examples" / "mappings" / "hf_llama.toml"
    for embed, heads, kv, hd in ((32, 8, 2, 4), (48, 4, 4, 16)):
        t = llama_of_size(tmp_path / f"e{embed}", embed, heads, kv, hd)
        out = ms.load_safetensors(tmp_path / f"e{embed}", mapping=mapping)
        attn = out["layers"]["0"]["attn"]
        assert attn["q"]["kernel"].shape == (embed, heads, hd)
        assert attn["k"]["kernel"].shape == (embed, kv, hd)
        assert attn["o"]["kernel"].shape == (heads, hd, embed)
        q = t["model.layers.0.self_attn.q_proj.weight"]
        assert np.asarray(attn["q"]["kernel"]).tobytes() == q.T.reshape(embed, heads, hd).tobytes()
    (tmp_path / "e32" / "config.json").unlink()
    with pytest.raises(ms.MappingError) as info:
        ms.load_safetensors(tmp_path / "e32", mapping=mapping, dry_run=True)
    lines = str(info.value).splitlines()
    assert lines[0].startswith("3 mapping problems found")  # q, k|v, o: once per rule
    assert lines[1:] == [
        "  source:model.layers.0.self_attn.k_proj.weight bfloat16[32, 8]",  # transposed
        "    problem: reshape size 'hidden_size' is not in the mapping's config (empty) (rules[2])",
        "    hint: add hidden_size = <size> to the config (the rule needs it for 1 more stored "
        "tensor)",
        "  source:model.layers.0.self_attn.o_proj.weight bfloat16[32, 32]",
        "    problem: reshape size 'num_attention_heads' is not in the mapping's config (empty) "
        "(rules[3])",
        "    hint: add num_attention_heads = <size> to the config",
        "  source:model.layers.0.self_attn.q_proj.weight bfloat16[32, 32]",
        "    problem: reshape size 'hidden_size' is not in the mapping's config (empty) (rules[1])",
        "    hint: add hidden_size = <size> to the config",
    ]


def test_a_mapping_config_contradicting_config_json_warns_naming_both(tmp_path: Path) -> None:
    llama_of_size(tmp_path, 32, 8, 2, 4)
    wm = ms.WeightMap(
        [
            ms.MapRule(
                r".*q_proj\.weight",
                "q",
                ops=[ms.Rearrange("(h d) e -> h e d", h="num_attention_heads")],
            ),
            ms.MapRule(r".*", None),
        ],
        config={"num_attention_heads": 4, "hidden_size": 32},  # agrees: no warning for it
    )
    with pytest.warns(UserWarning) as caught:
        out = ms.load_safetensors(tmp_path, mapping=wm)
    assert [str(w.message) for w in caught] == [
        "the mapping's config sets num_attention_heads = 4, but config.json has "
        "num_attention_heads = 8; using the mapping's 4 (remove num_attention_heads from the "
        "mapping's config to take config.json's)"
    ]
    assert caught[0].filename == __file__  # points at the caller's line
    assert out["q"].shape == (4, 32, 8)  # the mapping's value, as documented


def test_a_misspelled_toml_key_is_named_with_a_suggestion() -> None:
    data = {
        "rulez": [],
        "rules": [
            {"source": "a", "target": "a", "ops": [{"rearange": "(h d) e -> h e d", "h": 2}]},
            {"source": "b", "target": "b", "transpsoe": [1, 0]},
            {"source": "c", "target": "c", "stack": {"group": 1, "oder": ["x"]}},
        ],
    }
    with pytest.raises(ms.MappingError) as info:
        parse_weight_map(data, "m.toml")
    assert str(info.value).splitlines() == [
        "invalid mapping file m.toml:",
        "  m.toml:rulez",
        "    problem: unknown top-level key 'rulez' (did you mean 'rules'?)",
        "    hint: allowed: config, keep, optional, rules, strict",
        "  m.toml:rules[0].ops[0].rearange",
        "    problem: unknown key 'rearange' (did you mean 'rearrange'?)",
        "    hint: operations: rearrange, transpose, reshape, add, scale",
        "  m.toml:rules[1].transpsoe",
        "    problem: unknown key 'transpsoe' (did you mean 'transpose'?)",
        "    hint: allowed: also, cast, concat, ops, optional, reshape, skip, source, split, stack, "
        "target, transpose, unstack, untied",
        "  m.toml:rules[2].stack.oder",
        "    problem: unknown key 'oder' (did you mean 'order'?)",
        "    hint: allowed: group, axis, order",
    ]


def test_a_config_typo_is_reported_once_per_rule(tmp_path: Path) -> None:
    t = {f"l.{i}.q": np.zeros((8, 3), np.float32) for i in range(5)}
    path = save_tensors(tmp_path / "m.safetensors", t)
    wm = ms.WeightMap(
        [ms.MapRule(r"l\.(\d+)\.q", "q/{1}", ops=[ms.Rearrange("(h d) e -> h e d", h="haeds")])],
        config={"heads": 2},
    )
    with pytest.raises(ms.MappingError) as info:
        ms.load_safetensors(path, mapping=wm, dry_run=True)
    assert str(info.value).splitlines()[1:] == [
        "  source:l.0.q float32[8, 3]",
        "    problem: rearrange size 'haeds' is not in the mapping's config (did you mean "
        "'heads'?) (rules[0])",
        "    hint: add haeds = <size> to the config (the rule needs it for 4 more stored tensors)",
    ]
