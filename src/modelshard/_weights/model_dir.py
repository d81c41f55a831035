"""A model directory out: besides the weights, what ``from_pretrained`` needs and a Hub
repository carries, taken from the reference checkpoint's directory.

``config.json`` is copied with its dtype entry set to the dtype the weights were written
in; the generation config and the tokenizer's files are copied unchanged. Nothing else of
the reference is copied (its weights are the ones replaced).
"""

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

DEFAULT_SHARD_SIZE = "5GB"
"""A directory export's ``max_shard_size`` when none is given (``save_pretrained``'s)."""

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
    name = os.fspath(path)
    return not name.endswith((".safetensors", ".json"))


def shard_size_for(
    path: str | os.PathLike[str], max_shard_size: int | str | None
) -> int | str | None:
    """The ``max_shard_size`` an export to ``path`` writes with: the one given, or for a
    model directory ``DEFAULT_SHARD_SIZE`` (one ``model.safetensors``, an index above it,
    as ``save_pretrained`` writes); ``None`` (one file) for a ``.safetensors`` path."""
    if max_shard_size is None and is_model_directory(path):
        return DEFAULT_SHARD_SIZE
    return max_shard_size


def finish_model_directory(
    written: Path, reference: Any, items: Iterable[tuple[str, tuple[int, ...], Any]]
) -> None:
    """Beside the weights ``written`` (the lone file or the index) in a model directory:
    ``reference``'s ``config.json`` with the dtype of ``items`` and its ``CARRIED`` files
    (``write_model_files``); nothing for a reference given as a container."""
    write_model_files(written.parent, reference_directory(reference), written_dtype(items))


def reference_directory(reference: Any) -> Path | None:
    """The directory holding a reference checkpoint's ``config.json`` and tokenizer (a
    file's parent, the directory itself, a Hub repository's cached snapshot), or ``None``
    for a reference given as a container."""
    if not isinstance(reference, str | os.PathLike):
        return None
    if hub.is_hub(reference):
        return hub.resolve(reference)
    p = Path(reference)
    return p if p.is_dir() else p.parent


def written_dtype(items: Iterable[tuple[str, tuple[int, ...], Any]]) -> str | None:
    """The floating dtype holding most of the written bytes (``"bfloat16"``), or ``None``."""
    by: dict[str, int] = {}
    for _, shape, dt in items:
        d = np.dtype(dt)
        if np.issubdtype(d, np.floating) or d.name == "bfloat16":
            by[dtype_name(d)] = by.get(dtype_name(d), 0) + int(np.prod(shape)) * d.itemsize
    return max(by, key=lambda k: by[k]) if by else None


def write_model_files(directory: Path, source: Path | None, dtype: str | None) -> None:
    """``config.json`` (its dtype set to ``dtype``) and the files of ``CARRIED`` from
    ``source`` into ``directory``; process 0 writes them (plain file copies, no
    collective), each replaced once complete."""
    if source is None or jax.process_index() != 0:
        return
    config = source / "config.json"
    if config.is_file():
        data = json.loads(config.read_text(encoding="utf-8"))
        if dtype is not None and isinstance(data, dict):
            keys = [k for k in ("dtype", "torch_dtype") if k in data] or ["dtype"]
            for k in keys:
                data[k] = dtype
        write_durable(directory / "config.json", json.dumps(data, indent=2) + "\n")
    for name in CARRIED:
        src = source / name
        if src.is_file() and src.resolve() != (directory / name).resolve():
            write_durable(directory / name, src.read_bytes())
