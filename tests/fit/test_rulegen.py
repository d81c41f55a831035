"""``rules_for`` (``_fit/rulegen.py``): the short rules a suggestion is pasted as give every
leaf exactly the spec wanted for it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import modelshard as ms
from modelshard._fit.rulegen import rules_for


def test_rules_reproduce_every_spec_in_few_patterns():
    shapes = {
        "params/embed/embedding": (512, 64),
        "opt_state/0/count": (),
        "opt_state/0/mu/embed/embedding": (512, 64),
        "opt_state/0/nu/embed/embedding": (512, 64),
        "step": (),
    }
    for n in range(3):
        for kind in ("params", "opt_state/0/mu", "opt_state/0/nu"):
            shapes[f"{kind}/layers_{n}/mlp/up/kernel"] = (64, 256)
            shapes[f"{kind}/layers_{n}/norm/scale"] = (64,)
            shapes[f"{kind}/layers_{n}/mlp/down/kernel"] = (256, 64)  # stays replicated
    want = {
        p: P(None, "data")
        if p.endswith("up/kernel")
        else P("data")
        if p.startswith("opt_state") and p.endswith("embedding")
        else P()
        for p in shapes
    }
    rules = rules_for(list(want), list(want.values()), list(shapes.values()))
    assert sorted(rules.rules[:-1]) == [
        ("(^|/)up/kernel$", P(None, "data")),
        ("^opt_state/(.*/)?embedding$", P("data")),
    ]
    assert rules.rules[-1] == (".*", P())  # the catch-all replicates, as most leaves want
    tree = {p: jax.ShapeDtypeStruct(s, jnp.float32) for p, s in shapes.items()}
    plan = ms.plan(tree, rules, ms.make_mesh({"data": 4}, abstract=True))
    assert {p: leaf.spec for p, leaf in plan.named()} == {
        p: (s if shapes[p] else P()) for p, s in want.items()
    }
    # the rules file reads back as the same rules
    assert ms.Rules.__name__ in repr(rules) and "pattern = '(^|/)up/kernel$'" in rules.to_toml()
