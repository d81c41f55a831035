"""Plans as pictures: notebook/page HTML (checked structurally), a leaf's tiles, the CLI page."""

from __future__ import annotations

from html.parser import HTMLParser

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms
from helpers import MAKERS, gemma_like
from modelshard._place.plan_html import MAX_GRID
from modelshard.cli import main


class _Page(HTMLParser):
    """Collects what the tests check: rows, memory segments, tiles, anything external."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, str]] = []
        self.segments: list[dict[str, str]] = []
        self.tile_sets: list[dict[str, str]] = []
        self.tiles: list[list[dict[str, str]]] = []
        self.external: list[str] = []
        self.roots: list[dict[str, str]] = []
        self.summarised = 0
        self.headers: list[str] = []
        self.panels: list[dict[str, str]] = []
        self._in_th = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        cls = a.get("class", "").split()
        if tag in ("script", "link", "img", "iframe", "object", "embed"):
            self.external.append(tag)
        for k in ("src", "href", "srcset"):
            if k in a:
                self.external.append(f"{tag} {k}={a[k]}")
        if "url(" in a.get("style", ""):
            self.external.append(a["style"])
        if "ms-plan" in cls and "data-leaves" in a:
            self.roots.append(a)
        if "ms-row" in cls:
            self.rows.append(a)
        if "ms-seg" in cls:
            self.segments.append(a)
        if "ms-tiles" in cls:
            self.tile_sets.append(a)
            self.tiles.append([])
        if "ms-tile" in cls:
            self.tiles[-1].append(a)
        if "ms-summarised" in cls:
            self.summarised += 1
        if tag == "th" and self.tile_sets == []:
            self._in_th = True
            self.headers.append("")
        if tag == "details":
            self.panels.append(a)

    def handle_endtag(self, tag: str) -> None:
        if tag == "th":
            self._in_th = False

    def handle_data(self, data: str) -> None:
        if self._in_th:
            self.headers[-1] += data
        if "@import" in data or "url(" in data:
            self.external.append(data[:80])


def _check(p: ms.Plan, page_text: str) -> _Page:
    page = _Page()
    page.feed(page_text)
    assert page.external == []
    [root] = page.roots
    assert int(root["data-leaves"]) == len(p)
    assert int(root["data-bytes-per-device"]) == p.bytes_per_device()
    # every leaf kind has its row; the rows and the memory bar add up to the plan's numbers
    assert [r["data-path"] for r in page.rows] == [g["path"] for g in p.groups()]
    assert sum(int(r["data-count"]) for r in page.rows) == len(p)
    assert sum(int(r["data-bytes-per-device"]) for r in page.rows) == p.bytes_per_device()
    assert sum(int(s["data-bytes"]) for s in page.segments) == p.bytes_per_device()
    assert [s["data-module"] for s in page.segments] == [m["module"] for m in p.modules()]
    # one tile per device shard; each device in exactly one tile of each leaf
    for info, tiles in zip(page.tile_sets, page.tiles, strict=True):
        assert int(info["data-devices"]) == p.num_devices
        shards = int(info["data-shards"])
        if shards <= MAX_GRID:
            assert len(tiles) == shards
            assert sum(int(t["data-replicas"]) for t in tiles) == p.num_devices
        assert len({t["data-index"] for t in tiles}) == len(tiles)
    return page


def test_nnx_plan_html(mesh8):
    model = MAKERS["nnx"]()
    p = ms.plan(model, ms.fsdp("data", min_size=0), mesh8)
    page = _check(p, p.html())
    assert p._repr_html_() == p.html()
    kernel = next(t for t in page.tile_sets if t["data-path"] == "mlp/kernel")
    assert (kernel["data-shards"], kernel["data-replicas"]) == ("8", "1")


def test_columns_say_what_they_sum_and_panels_open_alike(mesh24):
    """The grouped table's byte columns name what they add up (one leaf, the whole row);
    every row's tile panel starts the same way (closed), none singled out."""
    tree = {f"layer_{i}": {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)} for i in range(3)}
    tree["head"] = jax.ShapeDtypeStruct((64, 8), jnp.float32)
    p = ms.plan(tree, ms.Rules([("w$", P("data")), ("head", P("model"))]), mesh24)
    page = _check(p, p.html())
    assert page.headers[-8:] == [
        "path",
        "leaves",
        "shape",
        "dtype",
        "spec",
        "rule",
        "per device, each leaf",
        "per device, row total",
    ]
    assert len(page.panels) == 2 and all("open" not in a for a in page.panels)
    layers = next(r for r in page.rows if r["data-path"] == "layer_{0..2}/w")
    assert int(layers["data-bytes-per-device"]) == 3 * 4 * 8 * 4  # the row total, 3 leaves


def test_linen_plan_page(tmp_path, mesh24):
    variables = MAKERS["linen"]()
    rules = ms.Rules([("kernel", P(None, "model")), (".*", P())], strict=False)
    p = ms.plan(variables, rules, mesh24)
    out = p.to_html(tmp_path / "plan.html")
    text = out.read_text()
    assert text.startswith("<!DOCTYPE html>") and "<title>modelshard plan</title>" in text
    page = _check(p, text)
    assert any(t["data-replicas"] == "2" for t in page.tile_sets)  # model=4 shards, data=2 replicas


def test_27b_class_plan_on_thousands_of_devices():
    """Abstract 27B-class state on 2,048 abstract devices: grids are summarised."""
    rules = ms.Rules(
        [
            ("input_embedding", P("model", "data")),
            ("kv_einsum/w", P(None, "model", "data")),
            ("einsum/w", P("model", "data")),
            ("gating_einsum", P(None, "model", "data")),
            ("mlp/linear", P("model", "data")),
            (".*", P()),
        ],
        strict=False,
    )
    p = ms.plan(gemma_like(), rules, ms.make_mesh({"data": 128, "model": 16}, abstract=True))
    assert p.num_devices == 2048
    page = _check(p, p.html())
    assert page.summarised > 0
    assert max(len(t) for t in page.tiles) <= MAX_GRID * MAX_GRID
    t = p.tiles("transformer/layer_3/mlp/linear")
    assert len(t.tiles) == 2048 and t.replicas == 1 and t.parts == (16, 128)
    assert sorted(d for _, _, devs in t.tiles for d in devs) == list(range(2048))


def test_tiles_slices_devices_and_terminal_rendering():
    mesh = ms.make_mesh({"data": 4, "model": 2}, abstract=True)
    p = ms.plan({"w": jax.ShapeDtypeStruct((8, 6), jnp.float32)}, P(None, "model"), mesh)
    t = p.tiles("w")
    assert t.parts == (1, 2) and t.replicas == 4
    assert t.tiles[1] == ((0, 1), (slice(0, 8), slice(3, 6)), [1, 3, 5, 7])
    text = str(t)
    assert "w: (8, 6) float32 P(None, 'model'); 2 shards (2), each on 4 devices" in text
    assert "[:, 0:3]" in text and "[:, 3:6]" in text and "1, 3, 5, 7" in text
    replicated = ms.plan({"b": jax.ShapeDtypeStruct((3,), jnp.float32)}, P(), mesh).tiles("b")
    assert len(replicated.tiles) == 1 and replicated.tiles[0][2] == list(range(8))


def test_tiles_on_a_concrete_mesh_use_device_ids(mesh8):
    p = ms.plan({"w": jnp.ones((8, 2))}, P("data"), mesh8)
    t = p.tiles("w")
    ids = [d.id for d in mesh8.devices.reshape(-1)]
    assert [devs for _, _, devs in t.tiles] == [[i] for i in ids]


def test_treescope_renders_the_plan(monkeypatch):
    treescope = pytest.importorskip("treescope")
    mesh = ms.make_mesh({"data": 2}, abstract=True)
    p = ms.plan({"w": jax.ShapeDtypeStruct((8, 2), jnp.float32)}, P(), mesh)
    calls = []
    html = p.html
    monkeypatch.setattr(type(p), "html", lambda self, **k: calls.append(1) or html(**k))
    assert "<script" in treescope.render_to_html(p)  # treescope's own page, with ours inside
    assert calls  # our __treescope_repr__ supplied the HTML
    assert treescope.render_to_text(p).startswith("<Plan: 1 array leaves")


def test_cli_plan_html(tmp_path, capsys):
    path = ms.save(tmp_path / "ckpt", {"w": jnp.ones((8, 4)), "b": jnp.zeros(3)})
    out = tmp_path / "plan.html"
    assert main(["plan", str(path), "--mesh", "data=2", "--html", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().err
    text = out.read_text()
    assert len(_check_page(text).rows) == 2


def _check_page(text: str) -> _Page:
    page = _Page()
    page.feed(text)
    assert page.external == []
    return page


def test_docs_pictures_come_from_a_real_plan():
    """The mkdocs hook replaces the markers with the demo plan's HTML at build time."""
    import importlib.util
    from pathlib import Path

    hook = Path(__file__).parents[2] / "docs" / "_ext" / "plan_pictures.py"
    spec = importlib.util.spec_from_file_location("plan_pictures", hook)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    page = Path(__file__).parents[2] / "docs" / "concepts" / "plan.md"
    text = module.on_page_markdown(page.read_text())
    assert "modelshard:plan" not in text and "modelshard:tiles" not in text
    p = module.demo_plan()
    parsed = _check(p, text[text.index('<div class="ms-plan" data-leaves') :])
    assert {s["data-module"] for s in parsed.segments} == {"opt_state", "params"}
    assert any(t["data-path"] == "params/layer_0/mlp/up" for t in parsed.tile_sets)


def test_a_step_page_shows_logical_names_and_activation_constraints():
    """A step's page: each leaf's rule cell names its logical names and the rules that
    mapped them, and a section lists the activation constraints the step applies."""
    import html
    import re

    from flax import nnx

    import tinylm
    from tinylm import nnx_model

    mesh = ms.make_mesh({"data": 2, "model": 4})  # Auto: tinylm's o-projection needs it
    block = nnx_model.TinyLM(rngs=nnx.Rngs(0)).block_0
    x = jax.ShapeDtypeStruct((8, 8, 16), jnp.float32)
    with ms.logical_rules(tinylm.AXES, {"mlp": None}):
        step = ms.shard_jit(
            lambda b, x: b(x),
            mesh=mesh,
            in_specs=(ms.Rules([], strict=False), P("batch", "seq", "embed")),
        )
        p = step.plan(block, x)
    text = p.html()
    page = _check(p, text)
    cells = [
        html.unescape(re.sub(r"<[^>]+>", "", c))
        for c in re.findall(r'<tr class="ms-row" data-path="b:k/kernel".*?</tr>', text)[0].split(
            "</td>"
        )
    ]
    assert cells[5] == "metadata: embed, heads->model, kv (tinylm defaults)"
    [section] = re.findall(r'<section class="ms-activations".*?</section>', text)
    rows = re.findall(r"<tr data-name=.*?</tr>", section)
    assert len(rows) == len(p.activations) == 6  # q, k, v, attention out, mlp, block out
    assert [html.unescape(re.sub(r"<[^>]+>", "", c)) for c in rows[4].split("</td>")[:-1]] == [
        "batch/seq/mlp",
        "<root>",
        "(8, 8, 32)",
        "batch->data, seq (tinylm defaults), mlp (rules)",
        "P('data', None, None)",
        "4.00 KiB",
    ]
    assert len(page.rows) == 8


def test_a_plain_plan_page_has_no_activation_section(mesh24):
    p = ms.plan({"w": jax.ShapeDtypeStruct((8, 4), jnp.float32)}, P("data"), mesh24)
    assert "ms-activations" not in p.html()
