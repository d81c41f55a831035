"""Canonical leaf paths: the one place that turns JAX key paths into ``a/b/0/c`` strings."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

SEPARATOR = "/"

# Key entries that only say "the payload of a box" and never name anything a user wrote.
_ARTIFACTS = frozenset({"value", "raw_value", "_value"})
_ATTR = {DictKey: "key", GetAttrKey: "name", SequenceKey: "idx", FlattenedIndexKey: "key"}


def key_name(key: Any) -> str:
    """The path component for one JAX key entry (or a plain str/int)."""
    attr = _ATTR.get(type(key))
    if attr is not None:
        return str(getattr(key, attr))
    name = getattr(key, "name", None)
    if isinstance(name, str):
        return name
    inner = getattr(key, "key", None)
    if inner is not None:
        return str(inner)
    return str(key)


def format_path(keys: Iterable[Any], *, drop_artifacts: bool = False) -> str:
    """Join key entries into the canonical ``/``-separated path.

    Args:
        keys: JAX key entries (``DictKey``, ``GetAttrKey``, ...) or plain strings/ints.
        drop_artifacts: drop a trailing box-payload component such as ``value``.

    Returns:
        The canonical path, e.g. ``"layers/0/attn/kernel"``; ``""`` for the root.

    Example:
        >>> from jax.tree_util import DictKey, SequenceKey
        >>> format_path([DictKey("layers"), SequenceKey(0), DictKey("kernel")])
        'layers/0/kernel'
    """
    parts = [key_name(k) for k in keys]
    if drop_artifacts:
        while parts and parts[-1] in _ARTIFACTS:
            parts.pop()
    return SEPARATOR.join(parts)


def join(prefix: str, path: str) -> str:
    """Join two canonical paths, either of which may be empty."""
    return prefix + SEPARATOR + path if prefix and path else prefix or path


def split(path: str) -> tuple[str, ...]:
    """Split a canonical path into its components (``""`` gives ``()``)."""
    return tuple(path.split(SEPARATOR)) if path else ()
