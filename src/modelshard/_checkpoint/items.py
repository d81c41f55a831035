"""Named items of a manager step (JSON, data iterator states, PRNG keys) in one JSON document
inside the step, checked before any byte of it is written; each JSON item also as Orbax's
``ocp.args.JsonSave`` writes it (``orbax_json_items``), the only way a step Orbax's own
manager wrote has them (``orbax_items``)."""

from __future__ import annotations

import base64
import json
import math
import re
from collections.abc import Mapping
from typing import Any

from .._base import CheckpointError
from .codec import encode, is_key, key_impl
from .listing import orbax_state
from .sources import locate
from .storage import (
    CHECKPOINT_METADATA,
    COMMIT_FILE,
    ITEMS_FILE,
    ITEMS_ITEM,
    METRICS_FILE,
    METRICS_ITEM,
    ORBAX_TMP,
    RECORD_ITEM,
    STATE_ITEM,
    TREE_METADATA,
    read_json,
    step_metadata,
)
from .urls import location

# Tags of the non-JSON kinds inside the items document.
_TAG = "__modelshard_item__"


def _is_iterator(x: Any) -> bool:
    return callable(getattr(x, "get_state", None)) and callable(getattr(x, "set_state", None))


def _json_problems(x: Any, where: str, out: list[str]) -> None:
    if x is None or isinstance(x, bool | str):
        return
    if isinstance(x, int | float):
        if isinstance(x, float) and math.isnan(x):
            out.append(f"{where}: NaN is not JSON")
        return
    if isinstance(x, Mapping):
        for k, v in x.items():
            if not isinstance(k, str):
                out.append(f"{where}: key {k!r} is a {type(k).__name__}, JSON keys are strings")
            else:
                _json_problems(v, f"{where}[{k!r}]", out)
        return
    if isinstance(x, list | tuple):
        for i, v in enumerate(x):
            _json_problems(v, f"{where}[{i}]", out)
        return
    hint = " (use int(...) or float(...))" if hasattr(x, "dtype") else ""
    out.append(f"{where}: {type(x).__module__}.{type(x).__qualname__} is not JSON{hint}")


def _encode(name: str, value: Any, problems: list[str]) -> Any:
    import jax
    import numpy as np

    where = f"items[{name!r}]"
    if _is_iterator(value):
        try:
            state = value.get_state()
        except Exception as e:
            problems.append(f"{where}: get_state() failed: {type(e).__name__}: {e}")
            return None
        if isinstance(state, bytes):
            return {_TAG: "iterator", "bytes": base64.b64encode(state).decode("ascii")}
        _json_problems(state, f"{where}.get_state()", problems)
        return {_TAG: "iterator", "state": state}
    if isinstance(value, jax.Array | np.ndarray):
        key = is_key(value.dtype)
        if key or (value.dtype == np.uint32 and value.size <= 1024):
            data = np.asarray(encode(value) if key else value)
            kind = {_TAG: "key", "impl": key_impl(value.dtype)} if key else {_TAG: "raw_key"}
            return {**kind, "shape": list(data.shape), "data": data.ravel().tolist()}
        problems.append(
            f"{where}: an array of {value.dtype}{list(value.shape)}; put arrays in the "
            "sharded state (only PRNG keys are items)"
        )
        return None
    _json_problems(value, where, problems)
    return value


def encode_items(items: Mapping[str, Any] | None) -> dict[str, Any]:
    """The JSON document for ``items``; every item that cannot be stored is an error."""
    if items is None:
        return {}
    if not isinstance(items, Mapping):
        raise CheckpointError(f"items must be a dict of name -> item, got {type(items).__name__}.")
    problems: list[str] = []
    out: dict[str, Any] = {}
    for name, value in items.items():
        if not isinstance(name, str) or not name:
            problems.append(f"item name {name!r}: names are non-empty strings")
            continue
        out[name] = _encode(name, value, problems)
    if not problems:
        try:
            json.dumps(out, allow_nan=True)
        except (TypeError, ValueError, RecursionError) as e:
            problems.append(f"items: {type(e).__name__}: {e}")
    if problems:
        raise CheckpointError(
            "cannot save these items (nothing was written):\n"
            + "\n".join(f"  {p}" for p in problems)
            + "\nItems are JSON values, data iterators with get_state()/set_state(), or PRNG keys."
        )
    return out


_FOLDER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
"""A name an item folder of a step may take: one plain path component that no name Orbax
writes in a step (``_CHECKPOINT_METADATA``, staging names) can be."""


def orbax_json_items(items: Mapping[str, Any] | None, encoded: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON items of a step also written as Orbax's ``ocp.args.JsonSave`` writes them
    (``<step>/<name>/metadata``), for Orbax's own manager: plain JSON items (not iterators or
    keys) named as a folder (``_FOLDER``) that no item of the step takes. ``encoded``:
    ``encode_items(items)``."""
    taken = {STATE_ITEM, RECORD_ITEM, ITEMS_ITEM, METRICS_ITEM, COMMIT_FILE.lower()}
    out: dict[str, Any] = {}
    for name, value in (items or {}).items():
        if (
            isinstance(name, str)
            and _FOLDER.fullmatch(name)
            and ORBAX_TMP not in name
            and name.lower() not in taken  # one folder on a case-insensitive disk
            and not _is_iterator(value)
            and not hasattr(value, "dtype")
        ):
            out[name] = encoded[name]
            taken.add(name.lower())
    return out


def _decode(name: str, value: Any, like: Any) -> Any:
    if not (isinstance(value, dict) and _TAG in value):
        return value
    kind = value[_TAG]
    if kind == "iterator":
        state = base64.b64decode(value["bytes"]) if "bytes" in value else value.get("state")
        if like is not None and _is_iterator(like):
            like.set_state(state)
            return like
        return state
    import jax
    import numpy as np

    if kind in ("key", "raw_key"):
        data = jax.numpy.asarray(np.asarray(value["data"], np.uint32).reshape(value["shape"]))
        return jax.random.wrap_key_data(data, impl=value["impl"]) if kind == "key" else data
    raise CheckpointError(
        f"items[{name!r}] has an unknown kind {kind!r}; written by a newer modelshard?"
    )


def decode_items(doc: Mapping[str, Any], like: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Items back from their JSON document. An iterator given in ``like`` under the same
    name has its state set and is returned; otherwise its saved state is returned."""
    like = like or {}
    return {name: _decode(name, value, like.get(name)) for name, value in doc.items()}


def read_items(directory: Any, *, like: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The named items saved with a checkpoint (a [`CheckpointManager`][modelshard.CheckpointManager]
    step directory); ``{}`` if it has none. A step saved with items whose file is gone is a
    CheckpointError (a damaged step), not ``{}``.

    Args:
        directory: the step directory (``mngr.step_directory(step)``).
        like: data iterators by item name: each gets its saved state (``set_state``) and
            is returned in place of the state.

    Returns:
        A dict of name -> JSON value, iterator state (or the iterator from ``like``), or
        PRNG key.

    Example:
        >>> import tempfile, jax.numpy as jnp
        >>> import modelshard as ms
        >>> with ms.CheckpointManager(tempfile.mkdtemp()) as mngr:
        ...     _ = mngr.save(5, {"w": jnp.ones(2)}, items={"config": {"lr": 0.1}})
        ...     mngr.wait_until_finished()
        ...     ms.read_items(mngr.step_directory(5))
        {'config': {'lr': 0.1}}
    """
    source = locate(directory)
    # Orbax's own manager's step: its JSON items, beside the item read as its state
    orbax = source.record.source == "orbax" and source.tree_dir != source.path
    return step_items(source.path, source.tree_dir.name if orbax else None, like)


def step_items(
    step_dir: Any, state: str | None, like: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The items of a manager step, or of Orbax's own manager's step of state item ``state``;
    CheckpointError where the step was saved with items whose file is gone (not ``{}``: the
    run would lose its RNG and data position without a word)."""
    if state is not None:
        return decode_items(orbax_items(step_dir, state), like)
    path = step_dir / ITEMS_ITEM / ITEMS_FILE
    doc = read_json(path)
    if doc is None:
        meta = read_json(step_dir / CHECKPOINT_METADATA)
        handlers = meta.get("item_handlers") if isinstance(meta, dict) else None
        if (step_dir / ITEMS_ITEM).is_dir() or (
            isinstance(handlers, dict) and ITEMS_ITEM in handlers
        ):
            raise CheckpointError(
                f"{path} is missing: the step was saved with its items, so it is damaged and "
                "they cannot be read. Its arrays still restore (their checksums are verified); "
                "restore a complete copy of the step to get the items back."
            )
        return {}
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path} is a JSON {type(doc).__name__}, not an object.")
    return decode_items(doc, like)


def extras_json(directory: Any) -> dict[str, Any]:
    """A manager step's items (as stored: JSON, keys and iterator states tagged) and
    metrics, for ``modelshard inspect --json``; ``{}`` for a checkpoint without them. A step
    of Orbax's own manager gives its JSON items (``orbax_items``) and its metrics."""
    root = location(directory)
    out: dict[str, Any] = {}
    items = read_json(root / ITEMS_ITEM / ITEMS_FILE)
    if items is None and not (root / RECORD_ITEM).exists() and step_metadata(root):
        state = orbax_state(root, sorted(c.name for c in root.iterdir()))
        found = orbax_items(root, state) if state is not None else {}
        items = found or None
    if items is not None:
        out["items"] = items
    metrics = read_json(root / METRICS_ITEM / METRICS_FILE)
    if metrics is not None:
        out["metrics"] = metrics
    return out


def read_metadata(directory: Any) -> dict[str, Any]:
    """The user metadata saved with a checkpoint (``save(..., metadata=...)``, or a
    manager step's; for a step Orbax's own manager wrote, its ``custom_metadata``), without
    reading any array.

    Example:
        >>> import tempfile, jax.numpy as jnp
        >>> import modelshard as ms
        >>> path = ms.save(tempfile.mkdtemp() + "/ck", {"w": jnp.ones(2)}, metadata={"step": 3})
        >>> ms.read_metadata(path)
        {'step': 3}
    """
    source = locate(directory)
    if source.record.source == "orbax" and source.tree_dir != source.path:
        # a step of Orbax's own manager: the custom_metadata its save was given
        return dict((step_metadata(source.path) or {}).get("custom_metadata") or {})
    return dict(source.record.metadata)


ORBAX_JSON_FILE = "metadata"
"""The file Orbax's ``JsonCheckpointHandler`` writes by default, in its item folder."""


def orbax_items(step_dir: Any, state: str) -> dict[str, Any]:
    """The JSON items of a step Orbax's own ``CheckpointManager`` wrote, by name, not
    ``state`` or ``metrics``: each its metadata gives Orbax's JSON handler (no handler names:
    each folder without tree metadata); CheckpointError where one's file is gone or not JSON."""
    handlers = (step_metadata(step_dir) or {}).get("item_handlers")
    if isinstance(handlers, dict):
        listed = sorted(n for n, h in handlers.items() if str(h).endswith("JsonCheckpointHandler"))
    else:
        listed = [
            c.name
            for c in sorted(step_dir.iterdir())
            if ORBAX_TMP not in c.name and c.is_dir() and not (c / TREE_METADATA).exists()
        ]
    out: dict[str, Any] = {}
    for name in listed:
        if name in (state, METRICS_ITEM):
            continue
        item = step_dir / name
        files = (
            sorted(c.name for c in item.iterdir() if c.name != COMMIT_FILE) if item.is_dir() else []
        )
        file = (
            ORBAX_JSON_FILE if ORBAX_JSON_FILE in files else files[0] if len(files) == 1 else None
        )
        if file is None:
            raise CheckpointError(
                f"{item} is missing its JSON file: Orbax's step {step_dir.name} was saved with "
                f"the JSON item {name!r}, so it is damaged and that item cannot be read. Its "
                "arrays still restore; restore a complete copy of the step to get it back."
            )
        out[name] = read_json(item / file)
    return out
