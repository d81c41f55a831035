"""One leaf's spec resolved and checked: a logical name's problem in the words of the rules
that mapped it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms


def test_a_rules_files_pair_that_does_not_divide_gets_the_pair_to_write(tmp_path):
    """load_rules of a file with Flax-style pairs: the problem names the pair by its index
    in that file, the hint the pair to write there (TOML, as the file is written)."""
    path = tmp_path / "pairs.toml"
    path.write_text(
        'logical = [["embed", "none"], ["heads", "model"]]\n\n'
        '[[rules]]\npattern = "kernel$"\nspec = ["embed", "heads"]\n'
    )
    rules = ms.load_rules(path)
    mesh = ms.make_mesh({"model": 8}, abstract=True)
    with pytest.raises(ms.SpecError) as e:
        ms.plan({"kernel": jax.ShapeDtypeStruct((16, 4), jnp.float32)}, rules, mesh)
    entry = f"logical[1] of {path}"
    assert str(e.value).splitlines() == [
        "1 sharding problem found (every offending leaf is listed; paths are arg:path):",
        "  tree:kernel float32[16, 4]",
        f"    problem: 'heads' (dimension 1, size 4) maps to 'model' (8) by {entry}: 4 is not "
        "divisible by 8",
        "    spec: P(None, 'model') (from rule 0 'kernel$')",
        "    mesh: model=8",
        f"    hint: map heads to an axis whose size divides 4, or replicate it: in {path}, set "
        'logical[1] = ["heads", "none"]',
    ]
    [p] = e.value.problems
    assert (p.dimension, p.logical_name, p.logical_rule) == (1, "heads", entry)


def test_python_pairs_keep_python_words():
    """The same pairs written in Python: the entry is rules[1], the fix Python's None."""
    mesh = ms.make_mesh({"model": 8}, abstract=True)
    rules = ms.Rules(
        [("kernel$", P("embed", "heads"))], logical=[("embed", None), ("heads", "model")]
    )
    with pytest.raises(ms.SpecError) as e:
        ms.plan({"kernel": jax.ShapeDtypeStruct((16, 4), jnp.float32)}, rules, mesh)
    [p] = e.value.problems
    assert (p.what, p.hint, p.logical_rule) == (
        "'heads' (dimension 1, size 4) maps to 'model' (8) by logical[1]: 4 is not divisible by 8",
        "map 'heads' to an axis whose size divides 4, or to None",
        "logical[1]",
    )
