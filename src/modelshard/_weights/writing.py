"""The files of one write, planned from names and sizes: headers, HF's shards and index,
temporaries renamed into place once complete (``multiprocess_writing`` fills them)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._base import CheckpointError, fsync_dir, size_in_bytes
from .recipe import contiguous
from .safetensors import dtype_code

Entry = tuple[str, tuple[int, ...], Any]
"""A stored tensor to write: name, shape, dtype."""


def entry_bytes(entry: Entry) -> int:
    return math.prod(entry[1]) * np.dtype(entry[2]).itemsize


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string as ``transformers`` takes them (``"5GB"``, ``"500MiB"``);
    ``CheckpointError``: anything else, or not positive."""
    n = None if isinstance(size, float) else size_in_bytes(size)
    if n is None or n < 1:
        raise CheckpointError(
            f"max_shard_size={size!r}: want a positive number of bytes, as an int or a string "
            "like '5GB', '500MB' (powers of 10) or '2GiB' (powers of 2)"
        )
    return n


def check_pieces(entry: Entry, got: Any) -> list[np.ndarray]:
    """``got`` (an array, or blocks of whole rows) as C-contiguous pieces of the entry."""
    name, shape, dt = entry[0], tuple(entry[1]), np.dtype(entry[2])
    pieces = [contiguous(a) for a in (got if isinstance(got, list) else [got])]
    rows = (
        len(shape) > 0
        and all(p.ndim == len(shape) and p.shape[1:] == shape[1:] for p in pieces)
        and sum(p.shape[0] for p in pieces) == shape[0]
    )
    fits = all(p.dtype == dt for p in pieces) and (
        rows if len(pieces) > 1 else pieces[0].shape == shape
    )
    if fits:
        return pieces
    text = " + ".join(f"{p.dtype}{list(p.shape)}" for p in pieces)
    raise CheckpointError(f"{name}: computed {text}, the header says {dt}{list(shape)}")


def encode_header(items: Sequence[Entry], metadata: Mapping[str, str] | None) -> bytes:
    """A file's bytes before its data: the length, then the JSON header padded to 8."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    pos = 0
    for entry in items:
        n = entry_bytes(entry)
        header[entry[0]] = {
            "dtype": dtype_code(entry[2]),
            "shape": list(entry[1]),
            "data_offsets": [pos, pos + n],
        }
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def temporary(p: Path, token: str) -> Path:
    """The temporary a write of ``p`` fills before renaming it into place."""
    return p.with_name(f"{p.name}.{token}.partial")


@dataclasses.dataclass(frozen=True)
class FileLayout:
    """The files of one write (the same on every process): each with its tensors, the
    index and its text (sharded), the path returned (``out``) and the ``(directory,
    stem)`` whose older shards it replaces."""

    files: list[tuple[Path, list[Entry]]]
    index: Path | None
    index_text: str | None
    out: Path
    stem: tuple[Path, str] | None


def plan_layout(
    path: str | os.PathLike[str], items: list[Entry], max_shard_size: int | str | None
) -> FileLayout:
    """One file, or with ``max_shard_size`` HF's ``{stem}-0000k-of-0000n.safetensors`` and
    index (one shard: ``{stem}.safetensors``). ``CheckpointError``: one file to an index
    name; a malformed ``max_shard_size``."""
    if max_shard_size is None:
        p = Path(path)
        if p.name.endswith(".index.json"):
            raise CheckpointError(
                f"{p}: an index file name; a safetensors file would be written under it. Pass a "
                ".safetensors file name, or max_shard_size= to write a sharded checkpoint "
                "with this index"
            )
        return FileLayout([(p, items)], None, None, p, None)
    directory, stem = sharded_names(path)
    groups = shard_groups(items, parse_size(max_shard_size))
    if len(groups) == 1:
        out = directory / f"{stem}.safetensors"
        return FileLayout([(out, items)], None, None, out, (directory, stem))
    n = len(groups)
    files = [
        (directory / f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)
    ]
    doc = {
        "metadata": {"total_size": sum(map(entry_bytes, items))},
        "weight_map": {e[0]: f.name for f, g in files for e in g},
    }
    index = directory / f"{stem}.safetensors.index.json"
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    return FileLayout(files, index, text, index, (directory, stem))


def shard_groups(items: list[Entry], max_bytes: int) -> list[list[Entry]]:
    """Tensors into shards in order, as ``huggingface_hub`` splits a state dict: a new
    shard when the next tensor would pass ``max_bytes``; a larger tensor alone."""
    groups: list[list[Entry]] = []
    current: list[Entry] = []
    size = 0
    for item in items:
        n = entry_bytes(item)
        if n > max_bytes:
            groups.append([item])
            continue
        if current and size + n > max_bytes:
            groups.append(current)
            current, size = [], 0
        current.append(item)
        size += n
    if current or not groups:
        groups.append(current)
    return groups


def sharded_names(path: str | os.PathLike[str]) -> tuple[Path, str]:
    """``(directory, stem)`` of a sharded write: a directory (stem ``model``), or a
    ``name.safetensors`` / ``name.safetensors.index.json`` (stem ``name``)."""
    p = Path(path)
    for suffix in (".index.json", ".json", ".safetensors"):
        if p.name.endswith(suffix):
            return p.parent, p.name.removesuffix(suffix).removesuffix(".safetensors")
    return p, "model"


def sharded_layout(directory: Path, stem: str) -> list[Path]:
    """The index, lone file and shards under ``stem`` in ``directory`` now, sorted."""
    if not directory.is_dir():
        return []
    shard = re.compile(re.escape(stem) + r"-\d{5}-of-\d{5}\.safetensors")
    names = {f"{stem}.safetensors", f"{stem}.safetensors.index.json"}
    return sorted(f for f in directory.iterdir() if f.name in names or shard.fullmatch(f.name))


def prepare_directory(layout: FileLayout) -> None:
    """Create missing parents (as ``save_pretrained`` does); ``CheckpointError`` where the
    file's path is a directory or a parent is a file."""
    if layout.stem is None and layout.out.is_dir():
        raise CheckpointError(f"{layout.out}: a directory; pass a .safetensors file name in it")
    d = layout.out.parent
    try:
        d.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise CheckpointError(
            f"{d}: cannot be the directory to write safetensors into (it, or a parent of "
            "it, is a file)"
        ) from None
    except PermissionError as e:
        raise CheckpointError(f"{d}: cannot create the directory to write into: {e}") from None


def commit_layout(layout: FileLayout, temps: list[Path], token: str) -> None:
    """Write the index's temporary, rename every temporary into place (index last), sync
    the directory, then remove the older layout's files under the stem; a failure removes
    the temporaries left."""
    moves = list(zip(temps, [f for f, _ in layout.files], strict=True))
    try:
        if layout.index is not None and layout.index_text is not None:
            moves.append((temporary(layout.index, token), layout.index))
            with open(moves[-1][0], "x") as f:
                f.write(layout.index_text)
                f.flush()
                os.fsync(f.fileno())
        for tmp, final in moves:
            os.replace(tmp, final)
    except BaseException:
        for tmp, _ in moves:
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(layout.out.parent)
    if layout.stem is not None:
        keep = {final.name for _, final in moves}
        for f in sharded_layout(*layout.stem):
            if f.name not in keep:
                f.unlink(missing_ok=True)
