"""Safetensors written by one process a tensor at a time: one file, or HF's shards and
index; each file complete and synced under a temporary name before it replaces anything."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .._base import CheckpointError, fsync_dir, size_in_bytes
from .recipe import contiguous
from .safetensors import dtype_code


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string as ``transformers`` takes them: ``"5GB"`` (10**9),
    ``"500MiB"`` (2**20), ``"100KB"``, ``"4096"``.

    Raises:
        CheckpointError: anything else, or not positive.
    """
    n = None if isinstance(size, float) else size_in_bytes(size)
    if n is None or n < 1:
        raise CheckpointError(
            f"max_shard_size={size!r}: want a positive number of bytes, as an int or a string "
            "like '5GB', '500MB' (powers of 10) or '2GiB' (powers of 2)"
        )
    return n


Entry = tuple[str, tuple[int, ...], Any]


def check_pieces(entry: Entry, got: Any) -> list[np.ndarray]:
    """``got`` (one array, or blocks of whole rows) as C-contiguous pieces;
    ``CheckpointError`` unless they are one array of the entry's shape and dtype, or blocks
    of whole rows that concatenate to it."""
    name, shape, dt = entry[0], tuple(entry[1]), np.dtype(entry[2])
    pieces = [contiguous(a) for a in (got if isinstance(got, list) else [got])]
    a = pieces[0]
    if len(pieces) == 1 and a.shape == shape and a.dtype == dt:
        return pieces
    rows_fit = (
        len(pieces) > 1
        and len(shape) > 0
        and all(p.ndim == len(shape) and p.shape[1:] == shape[1:] for p in pieces)
        and sum(p.shape[0] for p in pieces) == shape[0]
    )
    if rows_fit and all(p.dtype == dt for p in pieces):
        return pieces
    got = (
        f"{a.dtype}{list(a.shape)}"
        if len(pieces) == 1
        else " + ".join(f"{p.dtype}{list(p.shape)}" for p in pieces)
    )
    raise CheckpointError(f"{name}: computed {got}, the header says {dt}{list(shape)}")


def encode_header(
    items: list[Entry], metadata: Mapping[str, str] | None
) -> tuple[bytes, list[int]]:
    """A file's bytes before its data (length, JSON header padded to 8), and where each
    tensor starts."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    pos = 0
    starts = []
    for name, shape, dt in items:
        n = math.prod(shape) * np.dtype(dt).itemsize
        header[name] = {
            "dtype": dtype_code(dt),
            "shape": list(shape),
            "data_offsets": [pos, pos + n],
        }
        starts.append(pos)
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    return head, [len(head) + s for s in starts]


def new_token() -> str:
    """A token for temporary names, so two writers never share one."""
    return uuid.uuid4().hex[:16]


def temporary(p: Path, token: str) -> Path:
    """The temporary file a write of ``p`` fills before renaming it into place."""
    return p.with_name(f"{p.name}.{token}.partial")


def _write_partial(
    p: Path,
    items: list[Entry],
    compute: Callable[[str], Any],
    metadata: Mapping[str, str] | None,
    progress: Callable[[int], None] | None,
    token: str,
) -> Path:
    """``p``'s temporary, complete and synced: the header, then each tensor's bytes
    (``compute(name)``: an array, or blocks of whole rows in order)."""
    head, _ = encode_header(items, metadata)
    tmp = temporary(p, token)
    try:
        with open(tmp, "xb") as f:
            f.write(head)
            for entry in items:
                got = compute(entry[0])
                pieces = check_pieces(entry, got)
                for a in pieces:
                    f.write(memoryview(a.reshape(-1).view(np.uint8)) if a.size else b"")
                if progress is not None:
                    progress(sum(a.nbytes for a in pieces))
                del got, pieces
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


@dataclasses.dataclass(frozen=True)
class FileLayout:
    """The files one write produces, from names and sizes alone (the same on every
    process): each file with its tensors, the index and its text (sharded), what the write
    returns (``out``) and the ``(directory, stem)`` whose older shards it replaces."""

    files: list[tuple[Path, list[Entry]]]
    index: Path | None
    index_text: str | None
    out: Path
    stem: tuple[Path, str] | None

    @property
    def directory(self) -> Path:
        return self.out.parent


def plan_layout(
    path: str | os.PathLike[str], items: list[Entry], max_shard_size: int | str | None
) -> FileLayout:
    """The files writing ``items`` to ``path`` makes: one file, or with ``max_shard_size``
    HF's ``{stem}-0000k-of-0000n.safetensors`` and index (one shard: ``{stem}.safetensors``).
    ``CheckpointError``: one file to an index name; a malformed ``max_shard_size``."""
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
    names = [f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    total = sum(math.prod(s) * np.dtype(d).itemsize for _, s, d in items)
    doc = {
        "metadata": {"total_size": total},
        "weight_map": {name: f for f, g in zip(names, groups, strict=True) for name, _, _ in g},
    }
    index = directory / f"{stem}.safetensors.index.json"
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    files = [(directory / f, g) for f, g in zip(names, groups, strict=True)]
    return FileLayout(files, index, text, index, (directory, stem))


def prepare_directory(layout: FileLayout) -> None:
    """Create missing parent directories (as ``save_pretrained`` does); ``CheckpointError``
    where one file's path is a directory or a parent is a file."""
    if layout.stem is None and layout.out.is_dir():
        raise CheckpointError(f"{layout.out}: a directory; pass a .safetensors file name in it")
    d = layout.directory
    try:
        d.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise CheckpointError(
            f"{d}: cannot be the directory to write safetensors into (it, or a parent of "
            "it, is a file)"
        ) from None
    except PermissionError as e:
        raise CheckpointError(f"{d}: cannot create the directory to write into: {e}") from None


def write_index(layout: FileLayout, token: str) -> Path | None:
    """The index's temporary, written and synced (None: no index)."""
    if layout.index is None or layout.index_text is None:
        return None
    tmp = temporary(layout.index, token)
    with open(tmp, "x") as f:
        f.write(layout.index_text)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def commit_layout(layout: FileLayout, temps: list[Path], index_tmp: Path | None) -> Path:
    """Rename complete temporaries into place (index last), sync the directory, then
    remove the older layout's files under the stem that this one does not have."""
    for (final, _), tmp in zip(layout.files, temps, strict=True):
        os.replace(tmp, final)
    if index_tmp is not None and layout.index is not None:
        os.replace(index_tmp, layout.index)
    fsync_dir(layout.directory)
    if layout.stem is not None:
        keep = {f.name for f, _ in layout.files}
        if layout.index is not None:
            keep.add(layout.index.name)
        for f in sharded_layout(*layout.stem):  # the earlier layout's files
            if f.name not in keep:
                f.unlink(missing_ok=True)
    return layout.out


def write_layout(
    layout: FileLayout,
    compute: Callable[[str], Any],
    metadata: Mapping[str, str] | None,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Write every file of ``layout`` from this process, all complete before any replaces
    anything; a failure removes the temporaries and leaves what was there untouched."""
    prepare_directory(layout)
    token = new_token()
    temps: list[Path] = []
    index_tmp = None
    try:
        for final, group in layout.files:
            temps.append(_write_partial(final, group, compute, metadata, progress, token))
        index_tmp = write_index(layout, token)
    except BaseException:
        for t in temps:
            t.unlink(missing_ok=True)
        raise
    return commit_layout(layout, temps, index_tmp)


def write_safetensors(
    path: str | os.PathLike[str],
    entries: Iterable[Entry],
    compute: Callable[[str], np.ndarray],
    metadata: Mapping[str, str] | None = None,
    progress: Callable[[int], None] | None = None,
    max_shard_size: int | str | None = None,
) -> Path:
    """Write safetensors a tensor at a time (``compute(name)`` per entry, which may free
    it after): one file, or HF's shards with ``max_shard_size`` (``plan_layout``).
    ``CheckpointError``: a bad path (an index name, a directory, a file as parent) or a
    computed tensor that does not match its entry."""
    layout = plan_layout(path, list(entries), max_shard_size)
    return write_layout(layout, compute, metadata, progress)


def shard_groups(
    items: list[tuple[str, tuple[int, ...], Any]], max_bytes: int
) -> list[list[tuple[str, tuple[int, ...], Any]]]:
    """Tensors into shards in order, as ``huggingface_hub`` splits a state dict: a new
    shard when the next tensor would pass ``max_bytes``; a larger tensor alone."""
    groups: list[list[tuple[str, tuple[int, ...], Any]]] = []
    current: list[tuple[str, tuple[int, ...], Any]] = []
    size = 0
    for item in items:
        n = math.prod(item[1]) * np.dtype(item[2]).itemsize
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
    name = p.name
    for suffix in (".index.json", ".json", ".safetensors"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            if suffix != ".safetensors" and name.endswith(".safetensors"):
                name = name[: -len(".safetensors")]
            return p.parent, name
    return p, "model"


def sharded_layout(directory: Path, stem: str) -> list[Path]:
    """The index, lone file and shards under ``stem`` in ``directory`` now, sorted (what
    a sharded write there replaces)."""
    if not directory.is_dir():
        return []
    shard = re.compile(re.escape(stem) + r"-\d{5}-of-\d{5}\.safetensors")
    names = {f"{stem}.safetensors", f"{stem}.safetensors.index.json"}
    return sorted(f for f in directory.iterdir() if f.name in names or shard.fullmatch(f.name))
