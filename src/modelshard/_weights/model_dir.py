"""A model directory export: the files beside the weights."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .._base import dtype_name, write_durable
from . import hub

DEFAULT_SHARD_SIZE = "5GB"  # save_pretrained's

CARRIED = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
"""The reference's files copied unchanged beside the weights, where it has them."""


def is_model_directory(path: str | os.PathLike[str]) -> bool:
    """``path`` names a directory to export into (not a ``.safetensors`` file or an index)."""
    return not os.fspath(path).endswith((".safetensors", ".json"))


def shard_size_for(
    path: str | os.PathLike[str], max_shard_size: int | str | None
) -> int | str | None:
    """The ``max_shard_size`` given, or ``DEFAULT_SHARD_SIZE`` for a model directory."""
    if max_shard_size is None and is_model_directory(path):
        return DEFAULT_SHARD_SIZE
    return max_shard_size


def finish_model_directory(
    written: Path, reference: Any, items: Iterable[tuple[str, tuple[int, ...], Any]]
) -> None:
    """Beside ``written`` (the lone file or the index), from ``reference``'s directory:
    ``config.json`` with its dtype set to the floating dtype holding most of ``items``'
    bytes, and the ``CARRIED`` files; process 0 writes them (plain files, no collective),
    each replaced once complete. Nothing for a reference given as a container."""
    source = reference_directory(reference)
    if source is None or jax.process_index() != 0:
        return
    by: dict[str, int] = {}
    for _, shape, dt in items:
        d = np.dtype(dt)
        if np.issubdtype(d, np.floating) or d.name == "bfloat16":
            by[dtype_name(d)] = by.get(dtype_name(d), 0) + int(np.prod(shape)) * d.itemsize
    directory = written.parent
    config = source / "config.json"
    if config.is_file():
        data = json.loads(config.read_text(encoding="utf-8"))
        if by and isinstance(data, dict):
            for k in [k for k in ("dtype", "torch_dtype") if k in data] or ["dtype"]:
                data[k] = max(by, key=lambda k: by[k])
        write_durable(directory / "config.json", json.dumps(data, indent=2) + "\n")
    for name in CARRIED:
        src = source / name
        if src.is_file() and src.resolve() != (directory / name).resolve():
            write_durable(directory / name, src.read_bytes())


def reference_directory(reference: Any) -> Path | None:
    """A reference checkpoint's directory (a Hub repository's snapshot); ``None``: a container."""
    if not isinstance(reference, str | os.PathLike):
        return None
    if hub.is_hub(reference):
        return hub.resolve(reference)
    p = Path(reference)
    return p if p.is_dir() else p.parent
