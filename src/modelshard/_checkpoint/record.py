"""The checkpoint record: what modelshard knows of each stored leaf, as plain JSON beside the
Orbax data (``storage.RECORD_FILE``): paths, shapes, dtypes, saved specs and mesh, versions,
the state's Python values and checksums. No pickle; validated as untrusted input on read."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jax.sharding import NamedSharding, PartitionSpec

from .._base import CheckpointError, spec_from_json, spec_json
from .._specs import entry_axes, is_entry
from .checksum import CHECKSUM
from .codec import parse_dtype, stored_problem, stored_sharding
from .storage import FORMAT, name_collisions, nest, storage_key


@dataclasses.dataclass
class LeafRecord:
    """What the record says about one array leaf: its canonical path and stored key, logical
    and stored shape and dtype (``codec.encode``), PRNG impl of a typed key, saved spec
    (None: not on the recorded mesh), logical axis names of its box, and checksum."""

    path: str
    key: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    stored_shape: tuple[int, ...]
    stored_dtype: str
    key_impl: str | None = None
    spec: PartitionSpec | None = None
    names: tuple[Any, ...] | None = None
    checksum: str | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.stored_shape) * parse_dtype(self.stored_dtype).itemsize

    def stored_sharding(self, sharding: Any) -> Any:
        """The sharding of the stored array for a leaf placed with ``sharding``."""
        return stored_sharding(sharding, len(self.stored_shape) - len(self.shape))

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        names = None if self.names is None else [_json_name(n) for n in self.names]
        lists = {k: list(out[k]) for k in ("key", "shape", "stored_shape")}
        return out | lists | {"spec": spec_json(self.spec), "names": names}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LeafRecord:
        names = d.get("names")
        names = (
            None if names is None else tuple(tuple(n) if isinstance(n, list) else n for n in names)
        )
        try:
            shape, stored_shape = dims(d["shape"], "shape"), dims(d["stored_shape"], "stored_shape")
        except ValueError as e:
            raise CheckpointError(
                f"leaf {str(d.get('path')) or '<root>'!r} of the record is invalid: {e}."
            ) from e
        return cls(
            path=str(d["path"]),
            key=tuple(str(k) for k in d["key"]),
            shape=shape,
            dtype=str(d["dtype"]),
            stored_shape=stored_shape,
            stored_dtype=str(d["stored_dtype"]),
            key_impl=d.get("key_impl"),
            spec=spec_from_json(d.get("spec")),
            names=names,
            checksum=d.get("checksum"),
        )


VALUE_TYPES: dict[type, str] = {t: t.__name__ for t in (bool, int, float, complex, str, bytes)}
VALUE_TYPES[type(None)] = "none"
"""The Python values a checkpoint holds (exactly these types, not subclasses), by tag."""

_SAFE_INT = 1 << 53  # beyond it, JSON readers other than Python's lose digits
_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _float_json(x: float) -> float | str:
    return x if math.isfinite(x) else "nan" if math.isnan(x) else "inf" if x > 0 else "-inf"


def _float_value(v: Any) -> float:
    if type(v) is float or (type(v) is int and abs(v) < _SAFE_INT):
        return float(v)
    if isinstance(v, str) and v in _FLOATS:
        return _FLOATS[v]
    raise ValueError(f"{v!r} is not a float (a JSON number, 'inf', '-inf' or 'nan')")


def encode_value(x: Any) -> Any:
    """A value of ``VALUE_TYPES`` as JSON that gives it back exactly (``decode_value``)."""
    t = type(x)
    if t is int and abs(x) >= _SAFE_INT:
        return format(x, "#x")  # hex: exact, and no digit limit on reading it back
    if t is float:
        return _float_json(x)
    if t is complex:
        return [_float_json(x.real), _float_json(x.imag)]
    if t is bytes:
        return base64.b64encode(x).decode("ascii")
    return x


def decode_value(tag: str, v: Any) -> Any:
    """The value ``encode_value`` wrote for type ``tag``; ValueError if ``v`` is not one."""
    if tag not in VALUE_TYPES.values():
        raise ValueError(f"type {value_text(tag)} is not one of {sorted(VALUE_TYPES.values())}")
    if tag == "bool" and type(v) is bool:
        return v
    if tag == "int":
        if type(v) is int and abs(v) < _SAFE_INT:
            return v
        if isinstance(v, str) and len(v) <= MAX_VALUE_CHARS and _HEX.fullmatch(v):
            out = int(v, 16)
            if abs(out) >= _SAFE_INT:
                return out
        raise ValueError(f"{value_text(v)} is not an int as the record writes it")
    if tag == "float":
        return _float_value(v)
    if tag == "complex" and isinstance(v, list) and len(v) == 2:
        return complex(_float_value(v[0]), _float_value(v[1]))
    if tag == "str" and isinstance(v, str):
        return v
    if tag == "bytes" and isinstance(v, str):
        try:
            return base64.b64decode(v.encode("ascii"), validate=True)
        except (ValueError, UnicodeEncodeError) as e:
            raise ValueError(f"{value_text(v)} is not base64") from e
    if tag == "none" and v is None:
        return None
    raise ValueError(f"{value_text(v)} is not a {tag}")


MAX_VALUE_CHARS = 1 << 16
"""The longest hex int a record may hold (a 260000-bit number)."""
_HEX = re.compile(r"-?0x[0-9a-f]+")


def some(names: Sequence[str], n: int) -> str:
    """The first ``n`` of ``names``, then how many more."""
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def value_text(value: Any, limit: int = 60) -> str:
    """How ``inspect`` and error messages show a value: its repr, cut at ``limit``."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclasses.dataclass
class ValueRecord:
    """A plain Python value (``VALUE_TYPES``) kept in the record, with its storage key."""

    path: str
    key: tuple[str, ...]
    type: str
    value: Any

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "key": list(self.key),
            "type": self.type,
            "value": encode_value(self.value),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ValueRecord:
        path, key, tag = str(d["path"]), tuple(str(k) for k in d["key"]), d["type"]
        try:
            value = decode_value(tag, d["value"])
            if key != storage_key(path):
                raise ValueError(
                    f"its key {list(key)} is not the one its path gives, {list(storage_key(path))}"
                )
        except ValueError as e:
            raise CheckpointError(
                f"value {path or '<root>'!r} of the record is invalid: {e}."
            ) from e
        return cls(path=path, key=key, type=str(tag), value=value)


MAX_ELEMENTS = 1 << 56
"""The most elements a leaf of a record may have (about 7e16: far beyond any device)."""


def dims(value: Any, what: str = "shape") -> tuple[int, ...]:
    """A shape read from disk: a list of JSON integers, each and their product at most
    ``MAX_ELEMENTS`` (``Infinity``, ``1e30``, ``2.5`` or ``10**30`` are refused: ValueError)."""
    if not isinstance(value, list | tuple):
        raise ValueError(f"{what} {value!r} is not a list of integers")
    out = []
    for d in value:
        if type(d) is not int:
            raise ValueError(f"{what} {list(value)!r} has {d!r}, not an integer")
        if d > MAX_ELEMENTS:
            raise ValueError(f"{what} {list(value)!r} has the dimension {d}, out of range")
        out.append(d)  # a negative one is reported with its leaf by leaf_problem
    if math.prod(abs(d) for d in out) > MAX_ELEMENTS:
        raise ValueError(f"{what} {list(value)!r} has more than {MAX_ELEMENTS} elements")
    return tuple(out)


def leaf_problem(leaf: LeafRecord, axes: Mapping[str, int] | None) -> str | None:
    """What is wrong with one leaf of a record read from disk, or None: its key must be the
    one its path gives, its shapes and dtypes what is stored, its spec fit rank and mesh."""
    key = storage_key(leaf.path)
    if leaf.key != key:
        return f"its storage key {list(leaf.key)} is not the one its path gives, {list(key)}"
    if min((*leaf.shape, *leaf.stored_shape), default=0) < 0:
        return f"negative dimension in {list(leaf.shape)} (stored {list(leaf.stored_shape)})"
    if (problem := stored_problem(leaf)) is not None:
        return problem
    if leaf.spec is not None:
        if len(leaf.spec) > len(leaf.shape):
            return f"its spec {leaf.spec} is longer than its rank {len(leaf.shape)}"
        for entry in leaf.spec:
            if not is_entry(entry):
                return f"its spec {leaf.spec} has the entry {entry!r}, not an axis name"
            for axis in entry_axes(entry):
                if axis not in (axes or {}):
                    return f"its spec {leaf.spec} names {axis!r}, not an axis of the recorded mesh"
    return None


def _json_name(n: Any) -> Any:
    if n is None or isinstance(n, str):
        return n
    if isinstance(n, tuple | list):
        return [str(x) for x in n]
    return str(n)


@dataclasses.dataclass
class Record:
    """The whole record of one checkpoint: the container kind, the array leaves in order, the
    saving mesh (``{"axes": ..., "axis_types": ...}``), versions, metadata, ``source``
    (``"orbax"``: inferred), the Python values (None: a record predating them) and the
    checksums still ``pending`` (``shards.held_sums``)."""

    kind: str
    leaves: list[LeafRecord]
    mesh: dict[str, Any] | None = None
    versions: dict[str, str] = dataclasses.field(default_factory=dict)
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    source: str = "modelshard"
    values: list[ValueRecord] | None = None
    pending: Callable[[], list[str]] | None = dataclasses.field(default=None, repr=False)

    def resolve(self) -> None:
        """Fill in checksums still being computed (see ``shards.held_sums``)."""
        if self.pending is not None:
            for leaf, cs in zip(self.leaves, self.pending(), strict=True):
                leaf.checksum = cs
            self.pending = None

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves)

    def by_path(self) -> dict[str, LeafRecord]:
        return {leaf.path: leaf for leaf in self.leaves}

    def mesh_sizes(self) -> dict[str, int] | None:
        return None if self.mesh is None else dict(self.mesh["axes"])

    def mesh_axis_types(self) -> list[str]:
        """The saving mesh's axis types; ``"auto"`` for each where the record says none."""
        sizes = self.mesh_sizes() or {}
        saved = (self.mesh or {}).get("axis_types") or []
        types = [str(t).lower() for t in saved] if isinstance(saved, list) else []
        if len(types) != len(sizes) or not set(types) <= {"auto", "explicit"}:
            return ["auto"] * len(sizes)
        return types

    def saved_specs(self) -> Callable[[str, Any], PartitionSpec]:
        """Each leaf's saved spec (else replicated): the default of ``restore``, ``reshard``."""
        specs = {leaf.path: leaf.spec for leaf in self.leaves}

        def saved_specs(path: str, leaf: Any) -> PartitionSpec:
            return specs.get(path) or PartitionSpec()

        saved_specs.spec_source = "the specs it was saved with"  # type: ignore[attr-defined]
        return saved_specs

    def to_json(self) -> dict[str, Any]:
        if self.pending is not None:
            # resolving is a collective: here it would run on process 0 alone
            raise RuntimeError(
                "the record's checksums are still being computed: call resolve() on every "
                "process before writing it"
            )
        return {
            "format": FORMAT,
            "kind": self.kind,
            "mesh": self.mesh,
            "versions": self.versions,
            "checksum": CHECKSUM,
            "metadata": self.metadata,
            "leaves": [leaf.to_json() for leaf in self.leaves],
            **({} if self.values is None else {"values": [v.to_json() for v in self.values]}),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    @classmethod
    def from_json(cls, d: Mapping[str, Any], where: str = "") -> Record:
        if not isinstance(d, Mapping):
            raise CheckpointError(
                f"{where}: the record is a JSON {type(d).__name__}, not an object."
            )
        fmt = d.get("format")
        if fmt != FORMAT:
            raise CheckpointError(
                f"{where}: record format {fmt!r} is not {FORMAT!r}; it was "
                "written by another version of modelshard."
            )
        if d.get("checksum", CHECKSUM) != CHECKSUM:
            raise CheckpointError(f"{where}: unknown checksum algorithm {d.get('checksum')!r}.")
        try:
            leaves = [LeafRecord.from_json(x) for x in d["leaves"]]
            raw_values = d.get("values")
            values = None if raw_values is None else [ValueRecord.from_json(x) for x in raw_values]
            record = cls(
                kind=str(d["kind"]),
                leaves=leaves,
                mesh=d.get("mesh"),
                versions=dict(d.get("versions") or {}),
                metadata=dict(d.get("metadata") or {}),
                values=values,
            )
            axes = record.mesh_sizes()
            if axes is not None and not all(
                isinstance(k, str) and type(v) is int and v > 0 for k, v in axes.items()
            ):
                raise ValueError(f"mesh axes {axes} are not names and positive sizes")
        except CheckpointError as e:
            raise CheckpointError(f"{where}: {e}") from e
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(
                f"{where}: the modelshard record is malformed ({type(e).__name__}: {e})."
            ) from e
        for leaf in record.leaves:
            problem = leaf_problem(leaf, axes)
            if problem is not None:
                raise CheckpointError(
                    f"{where}: leaf {leaf.path or '<root>'!r} of the record is invalid: {problem}."
                )
        clashes = name_collisions(((leaf.path, leaf.key) for leaf in record.leaves), None)
        if clashes:
            raise CheckpointError(
                f"{where}: the record's leaves do not name distinct stored arrays:\n"
                + "\n".join(clashes)
            )
        nest([(x.key, None) for x in (*record.leaves, *(record.values or ()))], where)
        return record


def mesh_json(mesh: Any) -> dict[str, Any]:
    return {
        "axes": {str(k): int(v) for k, v in dict(mesh.shape).items()},
        "axis_types": [str(t).rsplit(".", 1)[-1] for t in getattr(mesh, "axis_types", ())],
    }


def saved_spec(x: Any, mesh: Any) -> PartitionSpec | None:
    """The spec ``x`` was placed with, if it is a NamedSharding on ``mesh``'s shape."""
    s = getattr(x, "sharding", None)
    if isinstance(s, NamedSharding) and mesh is not None and dict(s.mesh.shape) == dict(mesh.shape):
        return s.spec
    return None


def versions() -> dict[str, str]:
    """Package name -> version of the stack that writes a checkpoint (a fresh dict)."""
    return dict(_versions())


@functools.cache
def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("modelshard", "jax", "jaxlib", "orbax-checkpoint", "flax", "equinox", "optax"):
        with contextlib.suppress(PackageNotFoundError):
            out[pkg] = version(pkg)
    return out
