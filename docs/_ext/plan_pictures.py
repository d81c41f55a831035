"""MkDocs hook: the plan pictures in the docs are rendered from a real plan at build time.

A page writes ``<!-- modelshard:plan -->`` where the HTML of the demo plan goes (memory per
device by module, the grouped table, tiles on demand) and ``<!-- modelshard:tiles PATH -->``
for one leaf's tiles. The demo plan is a 24-layer decoder and its AdamW state (abstract,
from ``jax.eval_shape``) planned with tensor-parallel rules on an abstract (data=16,
model=8) mesh, so the build needs no devices and the pictures can never go stale.
"""

from __future__ import annotations

import functools
import re
from typing import Any

_MARK = re.compile(r"<!--\s*modelshard:(plan|tiles)\s*([^\s>]*)\s*-->")


@functools.cache
def demo_plan() -> Any:
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    import modelshard as ms

    d, f, v, layers = 2048, 8192, 32000, 24

    def init() -> Any:
        params: dict[str, Any] = {"embed": jnp.zeros((v, d), jnp.bfloat16)}
        for i in range(layers):
            params[f"layer_{i}"] = {
                "attn": {
                    "qkv": jnp.zeros((d, 3 * d), jnp.bfloat16),
                    "out": jnp.zeros((d, d), jnp.bfloat16),
                },
                "mlp": {
                    "up": jnp.zeros((d, f), jnp.bfloat16),
                    "down": jnp.zeros((f, d), jnp.bfloat16),
                },
                "norm": {"scale": jnp.ones((d,), jnp.float32)},
            }
        return {"params": params, "opt_state": optax.adamw(1e-4).init(params)}

    state = jax.eval_shape(init)
    rules = ms.Rules(
        [
            (r"embed$", P("model", "data")),
            (r"qkv$|up$", P("data", "model")),
            (r"out$|down$", P("model", "data")),
            (r".*", P()),
        ]
    )
    return ms.plan(state, rules, ms.make_mesh({"data": 16, "model": 8}, abstract=True))


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if "modelshard:" not in markdown:
        return markdown

    def render(m: re.Match[str]) -> str:
        p = demo_plan()
        if m.group(1) == "plan":
            return p.html(tiles=False)
        return p.tiles(m.group(2))._repr_html_()

    return _MARK.sub(lambda m: "\n" + render(m) + "\n", markdown)
