"""``plan``: the per-leaf placement of a container on a mesh, before anything is moved."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from jax.sharding import NamedSharding, PartitionSpec

from .._base import (
    SHOW_ALL,
    current_mesh,
    dtype_name,
    format_bytes,
    format_mesh,
    format_spec,
    literal,
    mesh_sizes,
    size_in_bytes,
    spec_error,
    spec_from_json,
    spec_json,
    vocabulary,
    write_durable,
)
from .._base import fold as fold_paths
from .._specs import ArgPlan, LeafPlan, SpecLike, expand_args
from .constraints import ActivationConstraint, nbytes, shard_shape
from .plan_html import Tiles, activation_cells, page, plain_text, plan_html, rule_text


class Plan:
    """Where every array leaf of one or more containers goes on a mesh.

    Built by [`plan`][modelshard.plan] or ``shard_jit``; it holds no arrays.

    Attributes:
        mesh: the ``Mesh`` or ``AbstractMesh`` planned for.
        args: one [`ArgPlan`][modelshard.ArgPlan] per argument.
        activations: for a step's plan, every
            [`ActivationConstraint`][modelshard.ActivationConstraint] its trace placed.
        memory: for a plan made by [`step_memory`][modelshard.step_memory], the step's
            [`StepMemory`][modelshard.StepMemory]; None otherwise.
    """

    def __init__(self, args: Sequence[ArgPlan], mesh: Any):
        self.mesh = mesh
        self.args = list(args)
        self.sizes = mesh_sizes(mesh)
        self.activations: list[ActivationConstraint] = []
        self.memory: Any = None
        self._shardings: dict[Any, NamedSharding] = {}

    @property
    def leaves(self) -> list[LeafPlan]:
        """Every leaf plan, across all arguments, in order."""
        return [leaf for a in self.args for leaf in a.leaves]

    def __iter__(self) -> Iterator[LeafPlan]:
        return iter(self.leaves)

    def __len__(self) -> int:
        return sum(len(a.leaves) for a in self.args)

    def __getitem__(self, path: str) -> LeafPlan:
        """The plan of the leaf at ``path`` (``"arg:path"`` when there are several args)."""
        arg, _, rest = path.rpartition(":") if len(self.args) > 1 else ("", "", path)
        for a in self.args:
            if arg and a.name != arg:
                continue
            for leaf in a.leaves:
                if leaf.path == rest:
                    return leaf
        where = arg or self.args[0].name if self.args else "plan"
        hint = "list paths with [leaf.path for leaf in plan]"
        raise spec_error(where, path, "no array leaf has this path in the plan", hint=hint)

    def sharding(self, spec: PartitionSpec) -> NamedSharding:
        """The (cached) ``NamedSharding`` of ``spec`` on this plan's mesh."""
        key = tuple(spec)
        if key not in self._shardings:
            self._shardings[key] = NamedSharding(self.mesh, spec)
        return self._shardings[key]

    def flat_shardings(self, arg: int = 0) -> list[NamedSharding]:
        """One ``NamedSharding`` per array leaf of argument ``arg``, in flatten order."""
        return [self.sharding(leaf.spec) for leaf in self.args[arg].leaves]

    def _mirror(self, values: Sequence[Sequence[Any]]) -> Any:
        trees = [a.flat.rebuild(v, mirror=True) for a, v in zip(self.args, values, strict=True)]
        return trees[0] if len(trees) == 1 else tuple(trees)

    @property
    def shardings(self) -> Any:
        """The container (NNX modules: their ``nnx.State``) with a ``NamedSharding`` per
        array leaf; static leaves are kept. A tuple of these for several arguments."""
        return self._mirror([self.flat_shardings(i) for i in range(len(self.args))])

    @property
    def specs(self) -> Any:
        """Like ``shardings``, with ``PartitionSpec`` leaves."""
        return self._mirror([[leaf.spec for leaf in a.leaves] for a in self.args])

    def shard_shape(self, leaf: LeafPlan) -> tuple[int, ...]:
        """The shape of one device's shard of ``leaf``."""
        return shard_shape(leaf.shape, leaf.spec, self.sizes)

    def bytes_per_device(self, leaf: LeafPlan | None = None) -> int:
        """Bytes one device holds of ``leaf`` (of every leaf when omitted)."""
        if leaf is None:
            return sum(self.bytes_per_device(x) for x in self.leaves)
        return nbytes(self.shard_shape(leaf), leaf.dtype)

    @property
    def total_bytes(self) -> int:
        """Bytes of every leaf, unsharded (what each device would hold if replicated)."""
        return sum(nbytes(x.shape, x.dtype) for x in self.leaves)

    @property
    def num_devices(self) -> int:
        return math.prod(self.sizes.values()) if self.sizes else 1

    def named(self, filter: str | re.Pattern[str] | None = None) -> list[tuple[str, LeafPlan]]:
        """``(displayed path, leaf)`` of every leaf whose displayed path matches ``filter``."""
        multi = len(self.args) > 1
        out = [
            (f"{a.name}:{leaf.path}" if multi else leaf.path, leaf)
            for a in self.args
            for leaf in a.leaves
        ]
        if filter is None:
            return out
        rx = re.compile(filter) if isinstance(filter, str) else filter
        return [(p, leaf) for p, leaf in out if rx.search(p)]

    def groups(
        self, fold: bool = True, filter: str | re.Pattern[str] | None = None
    ) -> list[dict[str, Any]]:
        """Rows of the plan as JSON-ready dicts (``rows``' keys, ``count`` and ``paths``): with
        ``fold``, leaves planned alike whose paths differ only in layer numbers are one row
        (``layers_{0..61}/mlp/kernel``); ``filter`` is a regex searched in each path."""
        named = self.named(filter)
        if not fold:
            groups = [(p, leaf, [p]) for p, leaf in named]
        else:
            folded = fold_paths(
                named,
                lambda x: x[0],
                key=lambda x: (
                    x[1].shape,
                    str(x[1].dtype),
                    tuple(x[1].spec),
                    x[1].rule,
                    x[1].logical,
                ),
            )
            groups = [(g.path, g.items[0][1], g.paths) for g in folded]  # type: ignore[index]
        return [
            {"path": path, "count": len(paths), **self._leaf_json(leaf), "paths": paths}
            for path, leaf, paths in groups
        ]

    def modules(self, filter: str | re.Pattern[str] | None = None) -> list[dict[str, Any]]:
        """One summary per top-level module: leaves, bytes and bytes per device."""
        out: dict[str, dict[str, Any]] = {}
        for path, leaf in self.named(filter):
            arg, colon, rest = path.rpartition(":") if len(self.args) > 1 else ("", "", path)
            top = (arg + colon) + (rest.split("/", 1)[0] or "<root>")
            m = out.setdefault(top, {"module": top, "leaves": 0, "bytes": 0, "bytes_per_device": 0})
            m["leaves"] += 1
            m["bytes"] += nbytes(leaf.shape, leaf.dtype)
            m["bytes_per_device"] += self.bytes_per_device(leaf)
        return list(out.values())

    def check_budget(self, budget: int | float | str, top: int = 5) -> None:
        """Raise if one device would hold more than ``budget`` bytes of this plan.

        Args:
            budget: bytes, or text such as ``"16GiB"``, ``"80 GB"``, ``"512MiB"``.
            top: how many of the largest rows (folded) to name.

        Raises:
            SpecError: one problem, ``bytes per device > budget``, naming the top-level
                modules and the rows that contribute most.
        """
        limit = parse_bytes(budget)
        per = self.bytes_per_device()
        if per <= limit:
            return
        rows = sorted(self.groups(), key=lambda r: -r["bytes_per_device"] * r["count"])
        biggest = "; ".join(
            f"{r['path']} {format_bytes(r['bytes_per_device'] * r['count'])}"
            + (f" ({r['count']} leaves)" if r["count"] > 1 else "")
            for r in rows[:top]
        )
        modules = ", ".join(
            f"{m['module']} {format_bytes(m['bytes_per_device'])}" for m in self.modules()
        )
        what = f"{format_bytes(per)} per device > budget {format_bytes(limit)} "
        what += f"(by module: {modules}); largest per device: {biggest}"
        hint = (
            "shard the largest leaves over more mesh axes (--rules, or a bigger --mesh), or "
            "write them in a smaller dtype: modelshard reshard SRC DST --dtype bfloat16"
            if vocabulary() == "cli"
            else "shard the largest leaves over more mesh axes (or a bigger mesh), or keep a "
            "smaller dtype"
        )
        header = "the plan does not fit the memory budget:"
        cause = "bytes per device > budget"
        # ``path`` None: the whole plan, no single leaf
        raise spec_error("budget", None, what, header, mesh=self.sizes, hint=hint, cause=cause)

    def rows(self, filter: str | re.Pattern[str] | None = None) -> list[dict[str, Any]]:
        """One JSON-ready dict per leaf (the CLI's ``--json``); ``filter``: a regex. ``spec`` is
        one entry per dimension (``[["data", "fsdp"], null]``); ``logical`` per dimension the
        names that mapped it, or null."""
        return [{"path": path, **self._leaf_json(leaf)} for path, leaf in self.named(filter)]

    def _leaf_json(self, leaf: LeafPlan) -> dict[str, Any]:
        return {
            "shape": list(leaf.shape),
            "dtype": dtype_name(leaf.dtype),
            "spec": spec_json(leaf.spec),
            "rule": leaf.rule,
            "logical": logical_json(leaf.logical),
            "bytes_per_device": self.bytes_per_device(leaf),
            "bytes": nbytes(leaf.shape, leaf.dtype),
        }

    def summary(self) -> str:
        """One line: leaves, bytes per device versus replicated bytes, the mesh."""
        per, total = self.bytes_per_device(), self.total_bytes
        mesh = format_mesh(self.sizes)
        ratio = f" ({per / total:.1%} of replicated)" if total else ""
        return (
            f"{len(self)} array leaves on mesh ({mesh}), {self.num_devices} devices: "
            f"{format_bytes(per)} per device{ratio}; replicated {format_bytes(total)}"
        )

    def table(
        self,
        max_rows: int | None = 60,
        fold: bool = True,
        filter: str | re.Pattern[str] | None = None,
    ) -> PlanTable:
        """The plan as a table for ``print``, ``rich.print`` and notebooks alike.

        Args:
            max_rows: show at most this many rows (then a line counting the rest);
                ``None`` shows every row.
            fold: fold leaves that differ only in layer numbers into one row.
            filter: a regex; only leaves whose path it matches are shown.
        """
        return PlanTable(self, max_rows=max_rows, fold=fold, filter=filter)

    def tiles(self, path: str) -> Any:
        """Which device holds which slice of the leaf at ``path``: a ``Tiles`` (``tiles``,
        ``parts``, ``replicas``, ``describe()``), a grid in a terminal and HTML in notebooks.

        Example:
            >>> import jax, jax.numpy as jnp
            >>> from jax.sharding import PartitionSpec as P
            >>> import modelshard as ms
            >>> mesh = ms.make_mesh({"data": 4, "model": 2}, abstract=True)
            >>> p = ms.plan({"w": jax.ShapeDtypeStruct((8, 6), jnp.float32)}, P("data"), mesh)
            >>> t = p.tiles("w")
            >>> len(t.tiles), t.replicas, t.tiles[1]
            (4, 2, ((1, 0), (slice(2, 4, None), slice(0, 6, None)), [2, 3]))
        """
        return Tiles(self, path, self[path])

    def html(
        self, fold: bool = True, filter: str | re.Pattern[str] | None = None, tiles: bool = True
    ) -> str:
        """The plan as the HTML fragment notebooks show (inline CSS, no script)."""
        return plan_html(self, fold=fold, filter=filter, tiles=tiles)

    def to_html(
        self,
        path: str | os.PathLike[str],
        fold: bool = True,
        filter: str | re.Pattern[str] | None = None,
        title: str = "modelshard plan",
    ) -> Path:
        """Write ``html`` as a self-contained page (opens offline); returns the path.

        Example:
            >>> import tempfile, jax, jax.numpy as jnp
            >>> from jax.sharding import PartitionSpec as P
            >>> import modelshard as ms
            >>> mesh = ms.make_mesh({"data": 8}, abstract=True)
            >>> p = ms.plan({"w": jax.ShapeDtypeStruct((8, 2), jnp.float32)}, P("data"), mesh)
            >>> p.to_html(tempfile.mkdtemp() + "/plan.html").read_text().startswith("<!DOCTYPE")
            True
        """
        out = Path(path)
        write_durable(out, page(self, title=title, fold=fold, filter=filter))
        return out

    def _repr_html_(self) -> str:
        return self.html()

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        """treescope (if installed) shows the same HTML as the notebook repr."""
        from treescope import rendering_parts

        return rendering_parts.embedded_iframe(
            embedded_html=self.html(), fallback_in_text_mode=rendering_parts.text(repr(self))
        )

    def __rich__(self) -> Any:
        return self.table().__rich__()

    def __str__(self) -> str:
        return str(self.table())

    def __repr__(self) -> str:
        return f"<Plan: {self.summary()}>"

    def activation_rows(self) -> list[dict[str, Any]]:
        """One JSON-ready dict per activation constraint of a step."""
        return [
            {
                **vars(a),
                "shape": list(a.shape),
                "logical": logical_json(a.logical),
                "spec": spec_json(a.spec),
            }
            for a in self.activations
        ]


def logical_json(via: Any) -> list[list[dict[str, Any]]] | None:
    """A leaf's logical names per dimension as JSON; None when no logical name was mapped."""
    if not via or not any(via):
        return None
    return [[{"name": n, "axes": list(t), "rule": lab} for n, t, lab in dim] for dim in via]


RULE_WRAP = 40
"""A plan table's rule cells wrap beyond this many characters rather than drop the column."""


def longest_rule(cells: list[dict[str, str]]) -> int:
    return max([len("rule")] + [len(c["rule"]) for c in cells if "rule" in c])


def _plain(title: str | None, columns: list[str], right: Sequence[str], rows: Iterable[Any]) -> Any:
    """A table without borders, the ``right`` columns right-justified."""
    from rich.table import Table

    t = Table(title=title, box=None, pad_edge=False, title_justify="left")
    for c in columns:
        t.add_column(c, justify="right" if c in right else "left")
    for row in rows:
        t.add_row(*row)
    return t


class PlanTable:
    """A plan rendered as a table: ``str()`` is plain text, ``__rich__`` a rich renderable."""

    def __init__(
        self,
        plan: Plan,
        max_rows: int | None = 60,
        fold: bool = True,
        filter: str | re.Pattern[str] | None = None,
    ):
        self.plan = plan
        self.rows = plan.groups(fold=fold, filter=filter)
        self.modules = plan.modules(filter=filter)
        self.max_rows = max_rows
        self.filter = filter

    def renderable(self, width: int | None = None) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        p = self.plan
        shown = self.rows if self.max_rows is None else self.rows[: self.max_rows]
        cells = self._cells(shown)
        cols = list(cells[0]) if cells else ["path", "shape", "dtype", "spec", "per device", "rule"]
        if width is not None:  # narrow: drop the least useful columns, never cut paths
            for col in ("rule", "dtype", "leaves"):
                if self._width(cells, cols) > width and col in cols:
                    cols.remove(col)
        t = Table(title="modelshard plan", show_lines=False, title_justify="left")
        longest = max((len(c["path"]) for c in cells), default=4)
        t.add_column("path", overflow="fold", ratio=1, min_width=min(longest, 30))
        names = cols[1:]
        for col in names:
            right = col in ("leaves", "per device")
            if col == "rule":  # long rule cells (logical names) wrap between words
                t.add_column(col, overflow="fold", min_width=min(longest_rule(cells), RULE_WRAP))
            else:
                t.add_column(col, no_wrap=True, justify="right" if right else "left")
        for c in cells:  # user text (paths, rule patterns): shown literally, never as markup
            t.add_row(literal(c["path"]), *[literal(c[n]) for n in names])
        parts: list[Any] = [t]
        if len(shown) < len(self.rows):
            rest = self.rows[len(shown) :]
            n = sum(r["count"] for r in rest)
            show_all = SHOW_ALL if vocabulary() == "cli" else "max_rows=None shows all"
            parts.append(Text(f"... {len(rest)} more rows ({n} leaves); {show_all}"))
        if self.filter is not None:
            n = sum(r["count"] for r in self.rows)
            pattern = getattr(self.filter, "pattern", self.filter)
            parts.append(Text(f"filter {pattern}: {n} of {len(p)} leaves"))
        right = ("leaves", "replicated", "per device", "share")
        if len(self.modules) > 1:
            rows = [
                (
                    literal(m["module"]),
                    str(m["leaves"]),
                    format_bytes(m["bytes"]),
                    format_bytes(m["bytes_per_device"]),
                )
                for m in self.modules
            ]
            parts.append(
                _plain(None, ["module", "leaves", "replicated", "per device"], right, rows)
            )
        acts = activation_cells(self.plan)
        if acts:
            rows = [tuple(map(literal, row.values())) for row in acts]
            parts.append(_plain("activation constraints", list(acts[0]), ("per device",), rows))
        if p.memory is not None:
            title = "step memory per device (XLA)"
            parts.append(_plain(title, ["part", "per device", "share"], right, p.memory.lines()))
            parts.append(Text(p.memory.summary()))
        parts.append(Text(p.summary()))
        return Group(*parts)

    @staticmethod
    def _cells(rows: list[dict[str, Any]]) -> list[dict[str, str]]:
        folded = any(r["count"] > 1 for r in rows)
        return [
            {
                "path": r["path"],
                **({"leaves": str(r["count"])} if folded else {}),
                "shape": str(tuple(r["shape"])),
                "dtype": r["dtype"],
                "spec": format_spec(spec_from_json(r["spec"])),
                "per device": format_bytes(r["bytes_per_device"])
                + (f" x{r['count']}" if r["count"] > 1 else ""),
                "rule": rule_text(r["rule"], r.get("logical")),
            }
            for r in rows
        ]

    @staticmethod
    def _width(cells: list[dict[str, str]], cols: list[str], wrap: bool = True) -> int:
        """Characters a table of these columns needs (``wrap``: rule cells wrap)."""
        widths = [
            min(longest_rule(cells), RULE_WRAP)
            if col == "rule" and wrap
            else max([len(col)] + [len(c[col]) for c in cells])
            for col in cols
        ]
        return sum(widths) + 3 * len(cols) + 1

    def __rich_console__(self, console: Any, options: Any) -> Any:
        yield self.renderable(options.max_width)

    def __rich__(self) -> Any:
        return self

    def __str__(self) -> str:
        cells = self._cells(self.rows if self.max_rows is None else self.rows[: self.max_rows])
        acts = activation_cells(self.plan)
        width = max(
            100,
            self._width(cells, list(cells[0]), wrap=False) if cells else 0,
            self._width(acts, list(acts[0])) if acts else 0,
        )
        return plain_text(self.renderable(width), width)

    def __repr__(self) -> str:
        return str(self)


def parse_bytes(value: int | float | str) -> int:
    """``"16GiB"`` -> 17179869184; ``"80GB"`` -> 80e9; ``"512 MiB"``; a number is bytes."""
    n = size_in_bytes(value)
    if n is not None:
        return n
    hint = "write bytes or a number with a unit: 16GiB, 80GB, 512MiB"
    raise spec_error(
        "budget", None, f"{value!r} is not a size", "invalid memory budget:", hint=hint
    )


def plan(tree: Any, specs: SpecLike, mesh: Any = None) -> Plan:
    """Plan where every array leaf of ``tree`` goes on ``mesh``, checking every leaf.

    Args:
        tree: any registered container; leaves may be ``jax.ShapeDtypeStruct``.
        specs: one spec-like for the whole tree (``P()``, [`Rules`][modelshard.Rules], [`fsdp`][modelshard.fsdp],
            a function, or a prefix tree of these).
        mesh: a ``jax.sharding.Mesh`` or an ``AbstractMesh`` of any size; default: the
            mesh set by ``jax.set_mesh``.

    Returns:
        A [`Plan`][modelshard.Plan]; ``print(plan)`` shows a table with bytes per device.

    Raises:
        SpecError: listing every leaf that cannot be placed, with the rule and a hint.
        MeshError: ``mesh`` is omitted and no mesh is active.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> import modelshard as ms
        >>> mesh = ms.make_mesh({"data": 32, "model": 8}, abstract=True)
        >>> params = {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)}
        >>> p = ms.plan(params, ms.Rules([("w$", P("data", "model"))]), mesh)
        >>> p.bytes_per_device()
        262144
    """
    if mesh is None:
        mesh = current_mesh(concrete=True)
    return Plan(expand_args([("tree", tree, specs)], mesh), mesh)
