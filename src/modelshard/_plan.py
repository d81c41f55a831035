"""``plan``: the per-leaf placement of a container on a mesh, before anything is moved."""

from __future__ import annotations

import io
import math
from collections.abc import Iterator, Sequence
from typing import Any

from jax.sharding import NamedSharding, PartitionSpec

from ._expand import ArgPlan, LeafPlan, expand_args
from ._mesh import format_mesh, mesh_sizes
from ._specs import SpecLike, entry_axes, format_spec

__all__ = ["Plan", "format_bytes", "plan"]


def format_bytes(n: float) -> str:
    """``1.50 MiB``-style text for a byte count."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


def spec_json(spec: PartitionSpec) -> list[Any]:
    """A spec as JSON: one entry per dimension, None or an axis name or a list of names."""
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def _itemsize(dtype: Any) -> int:
    size = getattr(dtype, "itemsize", None)
    return int(size) if size is not None else 0


class Plan:
    """Where every array leaf of one or more containers goes on a mesh.

    Built by :func:`plan` (one container) or by ``shard_jit`` (one per argument). A plan
    holds no arrays, so it works on abstract trees and abstract meshes.

    Attributes:
        mesh: the ``Mesh`` or ``AbstractMesh`` planned for.
        args: one :class:`~modelshard._expand.ArgPlan` per argument.
    """

    def __init__(self, args: Sequence[ArgPlan], mesh: Any):
        self.mesh = mesh
        self.args = list(args)
        self.sizes = mesh_sizes(mesh)
        self._shardings: dict[Any, NamedSharding] = {}

    # ---- per-leaf views -------------------------------------------------------------
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
        from ._errors import Problem, SpecError

        raise SpecError(
            [
                Problem(
                    arg or self.args[0].name if self.args else "plan",
                    path,
                    "no array leaf has this path in the plan",
                    hint="list paths with [leaf.path for leaf in plan]",
                )
            ]
        )

    def sharding(self, spec: PartitionSpec) -> NamedSharding:
        """The (cached) ``NamedSharding`` of ``spec`` on this plan's mesh."""
        key = tuple(spec)
        try:
            return self._shardings[key]
        except KeyError:
            s = self._shardings[key] = NamedSharding(self.mesh, spec)
            return s

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
        """Like :attr:`shardings`, with ``PartitionSpec`` leaves."""
        return self._mirror([[leaf.spec for leaf in a.leaves] for a in self.args])

    # ---- sizes ----------------------------------------------------------------------
    def shard_shape(self, leaf: LeafPlan) -> tuple[int, ...]:
        """The shape of one device's shard of ``leaf``."""
        out = list(leaf.shape)
        for d, entry in enumerate(leaf.spec):
            out[d] //= math.prod(self.sizes[a] for a in entry_axes(entry))
        return tuple(out)

    def bytes_per_device(self, leaf: LeafPlan | None = None) -> int:
        """Bytes one device holds of ``leaf`` (of every leaf when omitted)."""
        if leaf is None:
            return sum(self.bytes_per_device(x) for x in self.leaves)
        return math.prod(self.shard_shape(leaf)) * _itemsize(leaf.dtype)

    @property
    def total_bytes(self) -> int:
        """Bytes of every leaf, unsharded (what each device would hold if replicated)."""
        return sum(math.prod(x.shape) * _itemsize(x.dtype) for x in self.leaves)

    @property
    def num_devices(self) -> int:
        return math.prod(self.sizes.values()) if self.sizes else 1

    # ---- rendering ------------------------------------------------------------------
    def rows(self) -> list[dict[str, Any]]:
        """One JSON-ready dict per leaf (the CLI's ``--json``).

        ``spec`` is spelled as in a checkpoint record and ``modelshard inspect --json``:
        one entry per dimension, ``null`` for a replicated dimension, a list for several
        axes (``[["data", "fsdp"], null]``).
        """
        multi = len(self.args) > 1
        out = []
        for a in self.args:
            for leaf in a.leaves:
                out.append(
                    {
                        "path": f"{a.name}:{leaf.path}" if multi else leaf.path,
                        "shape": list(leaf.shape),
                        "dtype": str(leaf.dtype),
                        "spec": spec_json(leaf.spec),
                        "rule": leaf.rule,
                        "bytes_per_device": self.bytes_per_device(leaf),
                        "bytes": math.prod(leaf.shape) * _itemsize(leaf.dtype),
                    }
                )
        return out

    def summary(self) -> str:
        """One line: leaves, bytes per device versus replicated bytes, the mesh."""
        per, total = self.bytes_per_device(), self.total_bytes
        mesh = format_mesh(self.sizes)
        ratio = f" ({per / total:.1%} of replicated)" if total else ""
        return (
            f"{len(self)} array leaves on mesh ({mesh}), {self.num_devices} devices: "
            f"{format_bytes(per)} per device{ratio}; replicated {format_bytes(total)}"
        )

    def table(self, max_rows: int | None = 60) -> Any:
        """A ``rich.table.Table`` of the plan (first ``max_rows`` leaves, then totals)."""
        from rich.table import Table

        t = Table(title="modelshard plan", caption=self.summary(), show_lines=False)
        for col, kw in [
            ("path", {}),
            ("shape", {}),
            ("dtype", {}),
            ("spec", {}),
            ("rule", {}),
            ("per device", {"justify": "right"}),
        ]:
            t.add_column(col, **kw)
        rows = self.rows()
        shown = rows if max_rows is None else rows[:max_rows]
        for r, leaf in zip(shown, self.leaves, strict=False):
            t.add_row(
                r["path"],
                str(tuple(r["shape"])),
                r["dtype"],
                format_spec(leaf.spec),
                r["rule"],
                format_bytes(r["bytes_per_device"]),
            )
        if len(shown) < len(rows):
            t.add_row(f"... {len(rows) - len(shown)} more leaves", "", "", "", "", "")
        return t

    def __rich__(self) -> Any:
        return self.table()

    def __str__(self) -> str:
        from rich.console import Console

        console = Console(
            width=140, record=True, force_terminal=False, color_system=None, file=io.StringIO()
        )
        console.print(self.table())
        return console.export_text().rstrip()

    def __repr__(self) -> str:
        return f"<Plan: {self.summary()}>"


def plan(tree: Any, specs: SpecLike, mesh: Any) -> Plan:
    """Plan where every array leaf of ``tree`` goes on ``mesh``, checking every leaf.

    Args:
        tree: any registered container: pytree, optax state, ``TrainState``, NNX module or
            state, linen variables, Equinox module. Leaves may be arrays or
            ``jax.ShapeDtypeStruct`` (from ``jax.eval_shape``), so nothing is allocated.
        specs: one spec-like for the whole tree (``P()``, :class:`Rules`, :func:`fsdp`,
            a function, or a prefix tree of these).
        mesh: a ``jax.sharding.Mesh`` or an ``AbstractMesh`` of any size.

    Returns:
        A :class:`Plan`; ``print(plan)`` shows a table with bytes per device.

    Raises:
        SpecError: listing every leaf that cannot be placed, with the rule and a hint.

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
    return Plan(expand_args([("tree", tree, specs)], mesh), mesh)
