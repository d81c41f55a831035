"""``plan``: per-leaf placement, bytes per device, mirrors, tables; abstract trees and meshes."""

from __future__ import annotations

import io
import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import modelshard as ms
from helpers import MAKERS
from modelshard._base import format_bytes

SDS = jax.ShapeDtypeStruct


def test_bytes_per_device_and_totals(mesh24):
    tree = {"w": SDS((64, 32), jnp.float32), "b": SDS((32,), jnp.bfloat16)}
    p = ms.plan(tree, ms.Rules([("w", P("data", "model")), ("b", P())]), mesh24)
    assert p.shard_shape(p["w"]) == (32, 8)
    assert p.bytes_per_device(p["w"]) == 32 * 8 * 4
    assert p.bytes_per_device(p["b"]) == 32 * 2
    assert p.bytes_per_device() == 32 * 8 * 4 + 64
    assert p.total_bytes == 64 * 32 * 4 + 64
    assert len(p) == 2 and p.num_devices == 8
    assert p.rows()[1] == {
        "path": "w",
        "shape": [64, 32],
        "dtype": "float32",
        "spec": ["data", "model"],
        "rule": "rule 0 'w'",
        "logical": None,
        "bytes_per_device": 1024,
        "bytes": 8192,
    }


def test_plan_a_27b_model_on_256_abstract_chips():
    """Nothing is allocated: abstract leaves from eval_shape, an AbstractMesh bigger than us."""
    layers, d, f, v = 46, 4608, 36864, 256000

    def model():
        return {
            "embed": jnp.zeros((v, d), jnp.bfloat16),
            "layers": {
                "up": jnp.zeros((layers, d, f), jnp.bfloat16),
                "gate": jnp.zeros((layers, d, f), jnp.bfloat16),
                "down": jnp.zeros((layers, f, d), jnp.bfloat16),
                "qkv": jnp.zeros((layers, d, 3 * d), jnp.bfloat16),
                "out": jnp.zeros((layers, d, d), jnp.bfloat16),
            },
        }

    abstract = jax.eval_shape(model)
    mesh = ms.make_mesh({"data": 32, "model": 8}, abstract=True)
    rules = ms.Rules(
        [
            ("embed", P("model", "data")),
            ("up|gate|qkv", P(None, "data", "model")),
            ("down|out", P(None, "model", "data")),
        ]
    )
    p = ms.plan(abstract, rules, mesh)
    params = sum(math.prod(leaf.shape) for leaf in p)
    assert params > 27e9
    assert p.bytes_per_device() * 256 == p.total_bytes
    assert "256 devices" in p.summary()
    assert isinstance(p.shardings["embed"], NamedSharding)


def test_shardings_and_specs_mirror_the_container(kind, container, mesh8):
    p = ms.plan(container, ms.fsdp("data", min_size=0), mesh8)
    shardings, specs = p.shardings, p.specs
    expected_type = type(container)
    if kind == "nnx":
        from flax import nnx

        expected_type = nnx.State
    assert type(shardings) is expected_type and type(specs) is expected_type
    s_flat = ms.adapters.split(shardings)
    got = [x for x in s_flat.leaves if isinstance(x, NamedSharding)]
    assert got == p.flat_shardings(0)
    assert [x.spec for x in got] == [leaf.spec for leaf in p]


def test_equinox_mirror_keeps_static_fields(mesh8):
    mlp = MAKERS["equinox"]()
    mirror = ms.plan(mlp, P(), mesh8).shardings
    assert mirror.activation is mlp.activation
    assert isinstance(mirror.layers[0].weight, NamedSharding)


def test_plan_table_and_str(mesh24):
    tree = {"w": SDS((64, 32), jnp.float32), "b": SDS((32,), jnp.float32)}
    p = ms.plan(tree, ms.Rules([("w", P("data", "model")), ("b", P())]), mesh24)
    text = str(p)
    assert "modelshard plan" in text
    assert "P('data', 'model')" in text and "rule 0 'w'" in text
    assert "2 array leaves on mesh (data=2, model=4), 8 devices: 1.12 KiB per device" in text
    assert "replicated 8.12 KiB" in text
    assert repr(p).startswith("<Plan: 2 array leaves")
    many = ms.plan({f"x{i}": SDS((8,), jnp.float32) for i in range(70)}, P(), mesh24)
    assert "x{0..69} │     70 │ (8,)" in str(many)
    assert "... 10 more rows (10 leaves); max_rows=None shows all" in str(many.table(fold=False))


def test_getitem_unknown_path(mesh24):
    p = ms.plan({"w": SDS((4,), jnp.float32)}, P(), mesh24)
    with pytest.raises(ms.SpecError, match="no array leaf has this path"):
        p["nope"]


def test_plan_of_concrete_arrays_moves_nothing(mesh8):
    x = jnp.ones((16, 4))
    before = x.sharding
    ms.plan({"x": x}, ms.fsdp("data", min_size=0), mesh8)
    assert x.sharding == before


def test_plan_typed_prng_keys_and_zero_size(mesh8):
    tree = {
        "key": jax.random.key(0),
        "keys": jax.random.split(jax.random.key(1), 8),
        "empty": jnp.zeros((0, 8)),
    }
    p = ms.plan(
        tree, ms.Rules([("keys", P("data")), ("empty", P(None, "data")), ("key", P())]), mesh8
    )
    assert p.bytes_per_device(p["keys"]) == 8  # one key (2 x uint32) per device
    assert p.bytes_per_device(p["empty"]) == 0


# ---- plans that read at model scale --------------------------------------------------------


def _tp_rules():
    return ms.Rules(
        [
            ("input_embedding", P("model", None)),
            ("kv_einsum/w", P(None, "model")),
            ("einsum/w", P("model")),
            ("mlp", P(None, "model")),
            (".*", P()),
        ]
    )


def test_a_1000_layer_leaf_plan_prints_in_60_lines():
    from helpers import gemma_like

    tree = gemma_like(layers=150, vision_blocks=0)
    p = ms.plan(tree, _tp_rules(), ms.make_mesh({"data": 16, "model": 8}, abstract=True))
    assert len(p) == 150 * 7 + 7 > 1000
    text = str(p)
    lines = text.splitlines()
    assert len(lines) <= 60
    for kind in (
        "attn/attn_vec_einsum/w",
        "attn/kv_einsum/w",
        "attn/q_einsum/w",
        "mlp/gating_einsum",
        "mlp/linear",
        "pre_attention_norm/scale",
        "pre_ffw_norm/scale",
    ):
        assert f"transformer/layer_{{0..149}}/{kind} " in text, kind
    for leaf in ("transformer/embedder/input_embedding", "vision_encoder/pos_embedding"):
        assert leaf in text
    row = next(line for line in lines if "layer_{0..149}/mlp/linear " in line)
    assert "│    150 │ (21504, 5376)" in row and "P(None, 'model')" in row and "x150" in row
    # the per-module summary, with bytes per device
    modules = {m["module"]: m for m in p.modules()}
    assert sum(m["bytes_per_device"] for m in modules.values()) == p.bytes_per_device()
    assert sum(m["leaves"] for m in modules.values()) == len(p)
    per = format_bytes(modules["transformer"]["bytes_per_device"])
    assert any(line.split()[:2] == ["transformer", "1052"] and per in line for line in lines)
    # folding off: one row per leaf
    assert len(p.groups(fold=False)) == len(p)
    assert sum(g["count"] for g in p.groups()) == len(p)


def test_table_prints_properly_and_never_cuts_paths():
    """A linen model using Flax's standard attention inside nn.scan: the query/key/value/out
    kernels share a long prefix; no column cut hides which is which."""
    import flax.linen as nn
    from rich.console import Console

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            x = x + nn.MultiHeadDotProductAttention(num_heads=4)(x)
            return x + nn.Dense(32)(x), None

    class Decoder(nn.Module):
        @nn.compact
        def __call__(self, x):
            scan = nn.scan(
                Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3
            )
            return scan(name="decoder")(x, None)[0]

    variables = jax.eval_shape(lambda: Decoder().init(jax.random.key(0), jnp.zeros((1, 4, 32))))
    p = ms.plan(
        variables,
        ms.Rules([("kernel", P()), (".*", P())]),
        ms.make_mesh({"data": 2}, abstract=True),
    )
    table = p.table()
    assert not repr(table).startswith("<") and str(table) == str(p)
    for name in ("query", "key", "value", "out"):
        assert f"params/decoder/MultiHeadDotProductAttention_0/{name}/kernel" in str(p)
    for width in (60, 100):
        out = io.StringIO()
        Console(file=out, width=width, color_system=None).print(table)
        text = out.getvalue()
        assert "…" not in text
        joined = "".join(
            line.split("│")[1].strip() for line in text.splitlines() if line.count("│") > 2
        )
        for name in ("query", "key", "value", "out"):
            assert f"params/decoder/MultiHeadDotProductAttention_0/{name}/kernel" in joined
        if width == 60:
            assert "rule" not in text.splitlines()[2]  # the first column to go


def test_filter_rows_and_tables():
    from helpers import gemma_like

    p = ms.plan(
        gemma_like(4, 2), _tp_rules(), ms.make_mesh({"data": 16, "model": 8}, abstract=True)
    )
    rows = p.rows(filter=r"layer_\d+/mlp/")
    assert {r["path"] for r in rows} == {
        f"transformer/layer_{i}/mlp/{k}" for i in range(4) for k in ("gating_einsum", "linear")
    }
    text = str(p.table(filter="mlp/linear"))
    assert "filter mlp/linear: 4 of" in text and "gating" not in text
    with pytest.raises(ms.SpecError, match="invalid memory budget"):
        p.check_budget("lots")


def test_budget_names_the_top_contributors():
    from helpers import gemma_like

    p = ms.plan(gemma_like(), _tp_rules(), ms.make_mesh({"data": 16, "model": 8}, abstract=True))
    p.check_budget("16GiB")  # 7.07 GiB fits
    p.check_budget(p.bytes_per_device())
    with pytest.raises(ms.SpecError) as e:
        p.check_budget("4GiB", top=2)
    lines = str(e.value).splitlines()
    assert lines[0] == "the plan does not fit the memory budget:"
    assert lines[2] == (
        "    problem: 7.07 GiB per device > budget 4.00 GiB (by module: transformer 6.29 GiB, "
        "vision_encoder 794.99 MiB); largest per device: "
        "transformer/layer_{0..61}/mlp/gating_einsum 3.34 GiB (62 leaves); "
        "transformer/layer_{0..61}/mlp/linear 1.67 GiB (62 leaves)"
    )
    assert [p.cause for p in e.value.problems] == ["bytes per device > budget"]


def test_parse_bytes():
    from modelshard._place.planning import parse_bytes

    assert parse_bytes("16GiB") == 16 << 30
    assert parse_bytes("80 GB") == 80 * 10**9
    assert parse_bytes("1.5KiB") == 1536
    assert parse_bytes(1000) == parse_bytes("1000") == parse_bytes("1kB") == 1000
    for bad in ("", "-1GiB", "16 GiBs", float("nan"), True):
        with pytest.raises(ms.SpecError):
            parse_bytes(bad)
    with pytest.raises(ms.SpecError) as e:
        parse_bytes("lots")
    assert str(e.value).splitlines() == [  # no leaf: 'budget', as over budget, not <root>
        "invalid memory budget:",
        "  budget",
        "    problem: 'lots' is not a size",
        "    hint: write bytes or a number with a unit: 16GiB, 80GB, 512MiB",
    ]
    assert e.value.to_json()["problems"][0]["path"] is None


# Rules whose patterns rich would read as markup (``[qkv]``, ``[bold]``) or that repr would
# double (``\d``), and a leaf path holding rich's own tags.
MARKUP_RULES = [
    ("attn/w[qkv]$", P(None, "model")),
    (r"norm\d?/weight$", P()),
    (r"\[bold\]", P("model")),
]


def _markup_tree():
    return {
        "attn": {"wq": SDS((8, 8), jnp.float32), "wk": SDS((8, 8), jnp.float32)},
        "norm1": {"weight": SDS((8,), jnp.float32)},
        "[bold]emb[/bold]": SDS((16, 8), jnp.float32),
    }


def test_table_shows_rules_and_paths_as_written():
    """Rule patterns and paths are user text: never read as rich markup, never repr'd."""
    mesh = ms.make_mesh({"data": 2, "model": 4}, abstract=True)
    p = ms.plan(_markup_tree(), ms.Rules(MARKUP_RULES), mesh)
    assert [leaf.rule for leaf in p] == [
        r"rule 2 '\[bold\]'",
        "rule 0 'attn/w[qkv]$'",
        "rule 0 'attn/w[qkv]$'",
        r"rule 1 'norm\d?/weight$'",
    ]
    assert str(p).splitlines()[:9] == [
        "modelshard plan",
        "┏━━━━━━━━━━━━━━━━━━┳━━━━━━━━━┳━━━━━━━━━┳━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━━━┓",
        "┃ path             ┃ shape   ┃ dtype   ┃ spec             ┃ per device ┃ rule                     ┃",
        "┡━━━━━━━━━━━━━━━━━━╇━━━━━━━━━╇━━━━━━━━━╇━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━━┩",
        r"│ [bold]emb[/bold] │ (16, 8) │ float32 │ P('model')       │      128 B │ rule 2 '\[bold\]'        │",
        "│ attn/wk          │ (8, 8)  │ float32 │ P(None, 'model') │       64 B │ rule 0 'attn/w[qkv]$'    │",
        "│ attn/wq          │ (8, 8)  │ float32 │ P(None, 'model') │       64 B │ rule 0 'attn/w[qkv]$'    │",
        r"│ norm1/weight     │ (8,)    │ float32 │ P()              │       32 B │ rule 1 'norm\d?/weight$' │",
        "└──────────────────┴─────────┴─────────┴──────────────────┴────────────┴──────────────────────────┘",
    ]
    # on a colour terminal too (rich.print(plan)): the same characters, styles aside
    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=140, force_terminal=True, color_system="truecolor").print(p)
    from rich.text import Text

    shown = Text.from_ansi(buf.getvalue()).plain
    for text in ("[bold]emb[/bold]", "rule 0 'attn/w[qkv]$'", r"rule 1 'norm\d?/weight$'"):
        assert text in shown
    assert "\\\\" not in shown


# ---- logical names in the table ----------------------------------------------------------


def _cells(text: str, first: str) -> list[str]:
    """The cells of the table line whose first cell is ``first`` (box or blank columns)."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if len(cells) == 1:
            cells = line.split() or [None]
        if cells[0] == first:
            return cells
    raise AssertionError(f"no row {first!r} in\n{text}")


def test_rule_cells_name_logical_names_and_their_rules(mesh24):
    """A leaf placed by its logical names says which names and which rules mapped each,
    not just ``metadata (Param)``: tinylm's defaults, one entry overridden by the user's
    rules (NNX metadata, both axis types)."""
    from flax import nnx

    import tinylm
    from tinylm import nnx_model

    block = nnx_model.TinyLM(rngs=nnx.Rngs(0)).block_0
    with ms.logical_rules(tinylm.AXES, {"mlp": None}):
        p = ms.plan(block, ms.Rules([], strict=False), mesh24)
    text = str(p.table())
    assert _cells(text, "down/kernel") == [
        "down/kernel",
        "(32, 16)",
        "float32",
        "P(None, None)",
        "2.00 KiB",
        "metadata: mlp (rules), embed (tinylm defaults)",
    ]
    assert _cells(text, "k/kernel")[-1] == "metadata: embed, heads->model, kv (tinylm defaults)"
    assert _cells(text, "norm/scale")[-1] == "unmatched (replicated, strict=False)"
    assert p["down/kernel"].rule == "metadata (Param)"  # the JSON keeps both apart
    assert p.rows()[0]["logical"] == [
        [{"name": "mlp", "axes": [], "rule": "rules['mlp']"}],
        [{"name": "embed", "axes": [], "rule": "tinylm defaults['embed']"}],
    ]


def test_a_step_plan_lists_its_activation_constraints(mesh24):
    """What a step's constrain calls will apply, recorded while it is traced: name, logical
    names with their rules, spec and bytes per device, in the table and the JSON (Auto and
    Explicit meshes)."""
    import tinylm
    from tinylm.sharding import constrain

    def step(x):
        h = constrain(x * 2, "batch", "seq", "mlp")
        return constrain(h.sum(-1), "batch", None)

    x = SDS((8, 4, 32), jnp.float32)
    with ms.logical_rules(tinylm.AXES, {"batch": ("data",)}):
        plan = ms.shard_jit(step, mesh=mesh24, in_specs=(P("batch"),)).plan(x)
    assert plan.activation_rows() == [
        {
            "name": "batch/seq/mlp",
            "path": "",
            "shape": [8, 4, 32],
            "dtype": "float32",
            "written": "P('batch', 'seq', 'mlp')",
            "logical": [
                [{"name": "batch", "axes": ["data"], "rule": "rules['batch']"}],
                [{"name": "seq", "axes": [], "rule": "tinylm defaults['seq']"}],
                [{"name": "mlp", "axes": ["model"], "rule": "tinylm defaults['mlp']"}],
            ],
            "spec": ["data", None, "model"],
            "bytes_per_device": 8 * 4 * 32 * 4 // 8,
        },
        {
            "name": "batch/-",
            "path": "",
            "shape": [8, 4],
            "dtype": "float32",
            "written": "P('batch', None)",
            "logical": [[{"name": "batch", "axes": ["data"], "rule": "rules['batch']"}], []],
            "spec": ["data", None],
            "bytes_per_device": 8 * 4 * 4 // 2,
        },
    ]
    text = str(plan.table())
    lines = text.splitlines()
    at = lines.index("activation constraints")
    assert [line.split("  ")[0] for line in lines[at + 2 : at + 4]] == ["batch/seq/mlp", "batch/-"]
    assert _cells(text, "batch/seq/mlp") == [
        "batch/seq/mlp",
        "<root>",
        "(8,",
        "4,",
        "32)",
        "batch->data",
        "(rules),",
        "seq,",
        "mlp->model",
        "(tinylm",
        "defaults)",
        "P('data',",
        "None,",
        "'model')",
        "512",
        "B",
    ]
    [x_row] = [line for line in lines if "(8, 4, 32) │" in line]  # the input x, at the root
    assert x_row.endswith("│ argument: batch->data (rules) │")


@pytest.mark.parametrize("variant", ["linen", "nnx"])
def test_optimizer_moments_show_their_parameters_logical_names(variant, mesh24):
    """Adam's moments keep their parameters' logical names (linen's LogicallyPartitioned
    boxes, NNX's OptVariable metadata): their rows name the same names and rules."""
    import optax
    from flax import nnx

    import tinylm
    from tinylm import linen_model, nnx_model

    if variant == "linen":
        ids = jnp.zeros((8, 8), jnp.int32)
        params = linen_model.TinyLM().init(jax.random.key(0), ids)["params"]
        state = {"params": params, "opt": optax.adam(1e-2).init(params)}
        param, moment = "params/block_{0..1}/k/kernel", "opt/0/mu/block_{0..1}/k/kernel"
    else:
        model = nnx_model.TinyLM(rngs=nnx.Rngs(0))
        state = (model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param))
        param, moment = "0/block_{0..1}/k/kernel", "1/opt_state/0/mu/block_{0..1}/k/kernel"
    with ms.logical_rules(tinylm.AXES):
        p = ms.plan(state, ms.Rules([], strict=False), mesh24)
    rows = {r["path"]: r for r in p.groups()}
    text = str(p.table(max_rows=None))
    for path in (param, moment):
        assert rows[path]["spec"] == [None, "model", None]
        assert _cells(text, path)[-1] == "metadata: embed, heads->model, kv (tinylm defaults)"
