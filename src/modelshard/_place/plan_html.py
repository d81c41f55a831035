"""Plans as pictures: notebook HTML, ``to_html``, a leaf's tiles, logical names in words."""

from __future__ import annotations

import html
import io
import math
import os
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
from jax.sharding import Mesh

from .._base import format_bytes, format_spec, spec_from_json
from .._specs import entry_axes


class PlanView(Protocol):
    """What the pictures read of a [`Plan`][modelshard.Plan] (its public surface only)."""

    mesh: Any
    sizes: dict[str, int]

    def __len__(self) -> int: ...
    def bytes_per_device(self, leaf: Any = None) -> int: ...
    @property
    def total_bytes(self) -> int: ...
    @property
    def num_devices(self) -> int: ...
    def named(self, filter: Any = None) -> list[tuple[str, Any]]: ...
    def groups(self, fold: bool = True, filter: Any = None) -> list[dict[str, Any]]: ...
    def modules(self, filter: Any = None) -> list[dict[str, Any]]: ...
    def summary(self) -> str: ...
    def activation_rows(self) -> list[dict[str, Any]]: ...

    memory: Any


MAX_GRID = 16
"""Tile grids larger than this many rows or columns show their first rows/columns only."""

MAX_DEVICES_LISTED = 4

_PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1"]
_TILE_COLOURS = ["#dbe7f3", "#fde3c8", "#d9ecd6", "#f7d3d4", "#d8eeec", "#f8efc4", "#eadcf0"]

CSS = """
.ms-plan{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;font-size:13px;
 color:#1f2328;line-height:1.4;max-width:100%}.ms-plan h3{font-size:14px;margin:14px 0 6px}
.ms-plan .ms-summary{margin:4px 0 8px;color:#444}.ms-plan table{border-collapse:collapse}
.ms-plan th,.ms-plan td{padding:3px 8px;border-bottom:1px solid #e5e7eb;text-align:left;
 vertical-align:top}.ms-plan th{background:#f6f8fa;font-weight:600}
.ms-plan td.num,.ms-plan th.num{text-align:right;white-space:nowrap}
.ms-plan td.path{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;word-break:break-all;
 min-width:16em}
.ms-plan code{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:12px;
 white-space:nowrap}
.ms-plan .ms-bar{display:flex;height:22px;width:100%;max-width:720px;border:1px solid #c9ced6;
 border-radius:4px;overflow:hidden;background:#fff}.ms-plan .ms-seg{height:100%}
.ms-plan .ms-swatch{display:inline-block;width:10px;height:10px;border-radius:2px;
 margin-right:6px;vertical-align:middle}.ms-plan .ms-grid{display:grid;gap:3px;margin:6px 0}
.ms-plan .ms-tile{border:1px solid #9aa4b2;border-radius:3px;padding:4px 6px;font-size:11px;
 min-width:0;overflow-wrap:anywhere}.ms-plan .ms-tile code{white-space:normal}
.ms-plan table.ms-table{width:100%}
.ms-plan tr.ms-tiles-row td{border-bottom:1px solid #e5e7eb;padding-top:0}
.ms-plan tr.ms-row td{border-bottom:none}.ms-plan .ms-tile .ms-devs{color:#333}
.ms-plan .ms-note{color:#666;font-size:12px}.ms-plan details>summary{cursor:pointer;color:#0969da}
"""


def _esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def logical_text(logical: list[list[dict[str, Any]]] | None) -> str:
    """``batch->data, seq (tinylm defaults)``: each dimension's logical names, in words."""
    if not logical:
        return ""
    names: list[tuple[str, str]] = []
    for dim in logical:
        for m in dim:
            axes = m["axes"]
            to = "" if not axes else axes[0] if len(axes) == 1 else "(" + ", ".join(axes) + ")"
            names.append((m["name"] + (f"->{to}" if to else ""), _source(m["name"], m["rule"])))
    return ", ".join(
        n + (f" ({src})" if i + 1 == len(names) or names[i + 1][1] != src else "")
        for i, (n, src) in enumerate(names)
    )


def _source(name: str, label: str) -> str:
    """Where an entry of logical rules comes from, without the name it maps."""
    file_entry = f"[logical] {name} of "
    if label.startswith(file_entry):
        return f"[logical] of {os.path.basename(label[len(file_entry) :])}"
    head, of, file = label.partition(" of ")
    if of and head.startswith("logical["):
        return f"{head} of {os.path.basename(file)}"
    return label.removesuffix(f"[{name!r}]")


def rule_text(rule: str, logical: list[list[dict[str, Any]]] | None) -> str:
    """A table's rule cell: the rule, and the logical names of a spec written in them."""
    names = logical_text(logical)
    if not names:
        return rule
    if rule.startswith("metadata ("):
        rule = "metadata"  # the box's type says nothing the names do not
    elif rule.endswith(" for the whole argument"):
        rule = "argument"
    return f"{rule}: {names}"


class Tiles:
    """Which device holds which slice of one leaf: one tile per distinct shard."""

    def __init__(self, plan: PlanView, path: str, leaf: Any):
        self.path = path
        self.shape = tuple(leaf.shape)
        self.spec = leaf.spec
        self.dtype = leaf.dtype
        self.bytes_per_device = plan.bytes_per_device(leaf)
        sizes = plan.sizes
        names = list(sizes)
        coords = np.indices([sizes[n] for n in names]).reshape(len(names), -1)
        if isinstance(plan.mesh, Mesh):
            ids = np.array([d.id for d in plan.mesh.devices.flat], dtype=np.int64)
        else:  # an abstract mesh: positions
            ids = np.arange(coords.shape[1], dtype=np.int64)
        entries = list(self.spec) + [None] * (len(self.shape) - len(tuple(self.spec)))
        parts = []
        flat = np.zeros(ids.size, dtype=np.int64)  # each device's row-major shard number
        for entry in entries:
            n = 1
            for a in entry_axes(entry):  # the mixed-radix index along this dimension
                flat = flat * sizes[a] + coords[names.index(a)]
                n *= sizes[a]
            parts.append(n)
        self.parts = tuple(parts)
        self.num_devices = int(ids.size)
        order = np.argsort(flat, kind="stable")
        bounds = np.flatnonzero(np.diff(flat[order])) + 1
        self.tiles: list[tuple[tuple[int, ...], tuple[slice, ...], list[int]]] = []
        for group in np.split(order, bounds):
            tile = (
                tuple(int(i) for i in np.unravel_index(int(flat[group[0]]), parts)) if parts else ()
            )
            slices = tuple(
                slice(t * (d // p), (t + 1) * (d // p))
                for t, d, p in zip(tile, self.shape, parts, strict=True)
            )
            self.tiles.append((tile, slices, ids[group].tolist()))

    @property
    def replicas(self) -> int:
        """Devices holding each shard (1: no replication)."""
        return self.num_devices // max(len(self.tiles), 1)

    def _grid(self) -> tuple[int, int, list[tuple[int, int, Any, Any, list[int]]]]:
        """Rows and columns of shards (at most two cut dimensions drawn), and
        ``(row, column, tile, slices, devices)`` of each tile within ``MAX_GRID``."""
        cut = [d for d, p in enumerate(self.parts) if p > 1]
        if len(cut) == 1 and cut[0] > 0:  # one cut along a later dimension: columns
            cut = [-1, *cut]
        rows = self.parts[cut[0]] if cut and cut[0] >= 0 else 1
        cols = math.prod(self.parts[d] for d in cut[1:])
        cells = []
        for tile, slices, devs in self.tiles:
            r = tile[cut[0]] if cut and cut[0] >= 0 else 0
            c = 0
            for d in cut[1:]:
                c = c * self.parts[d] + tile[d]
            if r < MAX_GRID and c < MAX_GRID:
                cells.append((r, c, tile, slices, devs))
        return rows, cols, cells

    def describe(self) -> str:
        """One line: shape, spec, how many shards and replicas."""
        cuts = " x ".join(str(p) for p in self.parts if p > 1) or "not cut"
        return (
            f"{self.path}: {self.shape} {self.dtype} {format_spec(self.spec)}; "
            f"{len(self.tiles)} shard{'s' if len(self.tiles) != 1 else ''} ({cuts}), "
            f"each on {self.replicas} device{'s' if self.replicas != 1 else ''}; "
            f"{format_bytes(self.bytes_per_device)} per device"
        )

    @staticmethod
    def _slice_text(slices: Sequence[slice], shape: Sequence[int]) -> str:
        cells = [
            ":" if (s.start, s.stop) == (0, d) else f"{s.start}:{s.stop}"
            for s, d in zip(slices, shape, strict=True)
        ]
        return f"[{', '.join(cells)}]"

    @staticmethod
    def _devices_text(devs: list[int]) -> str:
        if len(devs) <= MAX_DEVICES_LISTED:
            return ", ".join(map(str, devs))
        head = ", ".join(map(str, devs[: MAX_DEVICES_LISTED - 1]))
        return f"{head}, …, {devs[-1]} ({len(devs)})"

    def html(self) -> str:
        rows, cols, cells = self._grid()
        shown_r, shown_c = min(rows, MAX_GRID), min(cols, MAX_GRID)
        out = [
            f'<div class="ms-tiles" data-path="{_esc(self.path)}" data-shards="{len(self.tiles)}"'
            f' data-devices="{self.num_devices}" data-replicas="{self.replicas}">',
            f'<div class="ms-note">{_esc(self.describe())}</div>',
        ]
        if shown_r < rows or shown_c < cols:
            out.append(
                f'<div class="ms-note ms-summarised">showing {shown_r} of {rows} rows and '
                f"{shown_c} of {cols} columns of shards ({len(self.tiles)} shards in all)</div>"
            )
        out.append(
            f'<div class="ms-grid" style="grid-template-columns:repeat({shown_c},minmax(0,9em))">'
        )
        for r, c, tile, slices, devs in cells:
            colour = _TILE_COLOURS[(r + c) % len(_TILE_COLOURS)]
            out.append(
                f'<div class="ms-tile" data-index="{_esc(tile)}" data-replicas="{len(devs)}"'
                f' style="background:{colour};grid-row:{r + 1};grid-column:{c + 1}"'
                + (f' title="devices {_esc(", ".join(map(str, devs)))}"' if len(devs) <= 64 else "")
                + ">"
                f"<code>{_esc(self._slice_text(slices, self.shape))}</code><br>"
                f'<span class="ms-devs">{"replicas" if len(devs) > 1 else "device"} '
                f"{_esc(self._devices_text(devs))}</span></div>"
            )
        return "".join(out) + "</div></div>"

    def _repr_html_(self) -> str:
        return f'<div class="ms-plan"><style>{CSS}</style>{self.html()}</div>'

    def __rich__(self) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        rows, cols, cells = self._grid()
        shown_r, shown_c = min(rows, MAX_GRID), min(cols, MAX_GRID)
        t = Table(show_header=False, show_lines=True)
        for _ in range(shown_c):
            t.add_column(justify="center")
        grid: list[list[Any]] = [[""] * shown_c for _ in range(shown_r)]
        styles = ["on grey23", "on dark_blue", "on dark_green", "on dark_red", "on purple4"]
        for r, c, _, slices, devs in cells:
            style = styles[(r + c) % len(styles)]
            grid[r][c] = Text.assemble(
                (self._slice_text(slices, self.shape), style), "\n" + self._devices_text(devs)
            )
        for row in grid:
            t.add_row(*row)
        parts: list[Any] = [Text(self.describe()), t]
        if shown_r < rows or shown_c < cols:
            parts.append(
                Text(f"showing {shown_r} of {rows} rows, {shown_c} of {cols} columns of shards")
            )
        return Group(*parts)

    def __str__(self) -> str:
        return plain_text(self.__rich__(), 160)


def plain_text(renderable: Any, width: int) -> str:
    """``renderable`` as plain text ``width`` columns wide, trailing spaces cut."""
    from rich.console import Console

    out = io.StringIO()
    console = Console(width=width, record=True, force_terminal=False, color_system=None, file=out)
    console.print(renderable)
    return "\n".join(line.rstrip() for line in console.export_text().splitlines()).rstrip()


def _bar(items: list[tuple[str, str, int, list[Any], list[Any]]], total: int, head: str) -> str:
    """A bar split into ``items``, with its legend under the columns ``head``."""
    out = ['<div class="ms-bar">']
    for i, (data, name, n, _, _) in enumerate(items):
        out.append(
            f'<span class="ms-seg" {data} data-bytes="{n}"'
            f' style="width:{100 * n / total if total else 0:.3f}%;background:'
            f'{_PALETTE[i % len(_PALETTE)]}" title="{_esc(name)}: {_esc(format_bytes(n))}"></span>'
        )
    out.append(f'</div><table class="ms-legend"><thead><tr>{head}</tr></thead><tbody>')
    for i, (_, name, n, before, after) in enumerate(items):
        cells = [*before, format_bytes(n), f"{n / total if total else 0:.1%}", *after]
        out.append(
            f'<tr><td><span class="ms-swatch" style="background:{_PALETTE[i % len(_PALETTE)]}">'
            f"</span>{_esc(name)}</td>"
            + "".join(f'<td class="num">{_esc(c)}</td>' for c in cells)
            + "</tr>"
        )
    out.append("</tbody></table></section>")
    return "".join(out)


def memory_html(plan: PlanView) -> str:
    """The per-device memory bar, split by top-level module, with its legend."""
    per = plan.bytes_per_device()
    items = [
        (f'data-module="{_esc(m["module"])}"', m["module"], m["bytes_per_device"], [m["leaves"]],
         [format_bytes(m["bytes"])])
        for m in plan.modules()
    ]  # fmt: skip
    return (
        f'<section class="ms-memory" data-bytes-per-device="{per}"'
        f' data-devices="{plan.num_devices}"><h3>Memory per device</h3>'
        f'<div class="ms-note">each of the {plan.num_devices} devices holds '
        f"{_esc(format_bytes(per))} of this state (replicated everywhere it would be "
        f"{_esc(format_bytes(plan.total_bytes))})</div>"
    ) + _bar(
        items,
        per,
        '<th>module</th><th class="num">leaves</th><th class="num">per device</th>'
        '<th class="num">share</th><th class="num">replicated</th>',
    )


def step_memory_html(plan: PlanView) -> str:
    """A step's memory per device (``plan.memory``) as a bar by part; empty without one."""
    m = plan.memory
    if m is None:
        return ""
    items = [(f'data-part="{k}"', text, n, [], []) for k, text, n in m.part_rows() if n > 0]
    source = "XLA's peak" if m.peak is not None else "XLA's argument + output + temp - alias"
    return (
        f'<section class="ms-step-memory" data-total="{m.total}"><h3>Step memory per device'
        f'</h3><div class="ms-note">{_esc(format_bytes(m.total))} per device ({_esc(source)}, '
        f"{_esc(m.platform)}, compiled in {m.compile_seconds:.1f}s); gradients are estimated "
        "as the parameters' bytes</div>"
    ) + _bar(
        items, m.total, '<th>part</th><th class="num">per device</th><th class="num">share</th>'
    )


def rows_html(plan: PlanView, fold: bool = True, filter: Any = None, tiles: bool = True) -> str:
    """The grouped table; each row's tiles (of its first leaf) open on demand."""
    rows = plan.groups(fold=fold, filter=filter)
    leaves = dict(plan.named())
    out = [
        '<section class="ms-rows"><h3>Leaves</h3><table class="ms-table"><thead><tr>'
        '<th>path</th><th class="num">leaves</th><th>shape</th><th>dtype</th><th>spec</th>'
        '<th>rule</th><th class="num">per device, each leaf</th>'
        '<th class="num">per device, row total</th>'
        "</tr></thead><tbody>"
    ]
    for r in rows:
        total = r["bytes_per_device"] * r["count"]
        spec = format_spec(spec_from_json(r["spec"]))
        out.append(
            f'<tr class="ms-row" data-path="{_esc(r["path"])}" data-count="{r["count"]}"'
            f' data-bytes-per-device="{total}"><td class="path">{_esc(r["path"])}</td>'
            f'<td class="num">{r["count"]}</td><td><code>{_esc(tuple(r["shape"]))}</code></td>'
            f"<td>{_esc(r['dtype'])}</td><td><code>{_esc(spec)}</code></td>"
            f"<td>{_esc(rule_text(r['rule'], r['logical']))}</td>"
            f'<td class="num">{_esc(format_bytes(r["bytes_per_device"]))}</td>'
            f'<td class="num">{_esc(format_bytes(total))}</td></tr>'
        )
        if tiles and r["shape"]:
            t = Tiles(plan, r["paths"][0], leaves[r["paths"][0]])
            out.append(
                '<tr class="ms-tiles-row"><td colspan="8"><details><summary>tiles on the '
                f"mesh</summary>{t.html()}</details></td></tr>"
            )
    out.append("</tbody></table></section>")
    return "".join(out)


def activation_cells(plan: PlanView) -> list[dict[str, str]]:
    """A step's activation constraints as table cells, for the terminal and the HTML."""
    return [
        {
            "name": row["name"],
            "path": row["path"] or "<root>",
            "shape": str(tuple(row["shape"])),
            "logical": logical_text(row["logical"]) or row["written"],
            "spec": format_spec(spec_from_json(row["spec"])),
            "per device": format_bytes(row["bytes_per_device"]),
        }
        for row in plan.activation_rows()
    ]


def activations_html(plan: PlanView) -> str:
    """A step's activation constraints (``plan.activations``); nothing for a plan without any."""
    rows = activation_cells(plan)
    if not rows:
        return ""
    out = [
        f'<section class="ms-activations" data-count="{len(rows)}"><h3>Activation '
        "constraints</h3><table><thead><tr><th>name</th><th>path</th><th>shape</th>"
        '<th>logical</th><th>spec</th><th class="num">per device</th></tr></thead><tbody>'
    ]
    for a in rows:
        out.append(
            f'<tr data-name="{_esc(a["name"])}"><td><code>{_esc(a["name"])}</code></td>'
            f'<td class="path">{_esc(a["path"])}</td><td><code>{_esc(a["shape"])}</code></td>'
            f"<td>{_esc(a['logical'])}</td><td><code>{_esc(a['spec'])}</code></td>"
            f'<td class="num">{_esc(a["per device"])}</td></tr>'
        )
    out.append("</tbody></table></section>")
    return "".join(out)


def plan_html(plan: PlanView, fold: bool = True, filter: Any = None, tiles: bool = True) -> str:
    """The plan as one ``<div>``, style included."""
    return (
        f'<div class="ms-plan" data-leaves="{len(plan)}" data-devices="{plan.num_devices}"'
        f' data-bytes-per-device="{plan.bytes_per_device()}"><style>{CSS}</style>'
        f'<div class="ms-summary"><b>modelshard plan</b>: {_esc(plan.summary())}</div>'
        + memory_html(plan)
        + step_memory_html(plan)
        + rows_html(plan, fold=fold, filter=filter, tiles=tiles)
        + activations_html(plan)
        + "</div>"
    )


def page(plan: PlanView, title: str = "modelshard plan", **kwargs: Any) -> str:
    """A whole HTML document around ``plan_html`` (no script, no external resource)."""
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f'<title>{_esc(title)}</title></head><body style="margin:16px">'
        + plan_html(plan, **kwargs)
        + "</body></html>\n"
    )
