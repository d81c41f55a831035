"""The safetensors format, read a slice at a time and written a tensor at a time.

A safetensors file is an 8-byte little-endian header length, a JSON header (tensor name
-> ``dtype``, ``shape``, ``data_offsets`` into the data that follows; optional
``__metadata__`` of strings), then the tensors' bytes, C order. A sharded checkpoint adds
``model.safetensors.index.json`` with ``weight_map``: tensor name -> file.

A device's slice along the first axis (rows ``[lo, hi)`` of a C-order tensor, one
contiguous byte range) is one positioned read (``os.preadv``) into a buffer of its own,
which JAX then owns: exactly its bytes, copied once. Not a memory map of the file: mapped
pages count in the process's resident memory for as long as the map is open, so mapping
the whole file peaks at the file *plus* the device copies (``safetensors``' ``safe_open``
maps it). A slice across the rows (a transposed leaf's device block) is a strided view
of a map of that one tensor, open while its leaf is placed: JAX's host-to-device copy
reads it straight from the page cache. Dtypes map through ``ml_dtypes`` (bf16 and every
fp8 variant), which the ``safetensors`` package's NumPy backend cannot return for fp8.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import re
import struct
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from .._base import CheckpointError, size_in_bytes
from . import hub
from .recipe import contiguous, host_empty

DTYPES: dict[str, Any] = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "U16": np.uint16,
    "I16": np.int16,
    "U32": np.uint32,
    "I32": np.int32,
    "U64": np.uint64,
    "I64": np.int64,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F32": np.float32,
    "F64": np.float64,
    "C64": np.complex64,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E4M3FNUZ": ml_dtypes.float8_e4m3fnuz,
    "F8_E5M2FNUZ": ml_dtypes.float8_e5m2fnuz,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
}
"""Every safetensors dtype code with a NumPy dtype of one or more bytes per element."""
_CODES = {np.dtype(v): k for k, v in DTYPES.items()}
MAX_HEADER = 100 << 20  # the safetensors library's own limit
INDEX_NAME = "model.safetensors.index.json"


def dtype_code(dtype: Any) -> str:
    try:
        return _CODES[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise CheckpointError(
            f"dtype {dtype} has no safetensors code (known: {', '.join(DTYPES)})"
        ) from None


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """Where one stored tensor lives: file, byte offset of its data, shape, dtype."""

    name: str
    file: Path
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    code: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _read_header(path: Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise CheckpointError(
                f"{path}: not a safetensors file (header length {n} does not fit the "
                f"{size}-byte file)"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: the safetensors header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    base = 8 + n
    out: dict[str, TensorEntry] = {}
    bad: list[str] = []
    for name, h in header.items():
        try:
            code, shape, (lo, hi) = h["dtype"], tuple(int(d) for d in h["shape"]), h["data_offsets"]
        except (KeyError, TypeError, ValueError):
            bad.append(f"  {name}: malformed entry {h!r}")
            continue
        if code not in DTYPES:
            bad.append(f"  {name}: dtype {code!r} is not supported (known: {', '.join(DTYPES)})")
            continue
        dt = np.dtype(DTYPES[code])
        if hi - lo != math.prod(shape) * dt.itemsize or lo < 0 or base + hi > size:
            bad.append(
                f"  {name}: data_offsets [{lo}, {hi}] do not hold {code}{list(shape)} "
                f"inside the {size}-byte file"
            )
            continue
        out[name] = TensorEntry(name, path, base + lo, shape, dt, code)
    if bad:
        raise CheckpointError(
            f"{path}: {len(bad)} unreadable tensor entr{'ies' if len(bad) != 1 else 'y'}:\n"
            + "\n".join(bad)
        )
    return out, {str(k): str(v) for k, v in dict(meta).items()}


class SafetensorsFiles:
    """One safetensors file or a sharded checkpoint (an index and its files), header only.

    Attributes:
        path: the file, or the index file.
        tensors: name -> ``TensorEntry``, in stored order.
        metadata: the ``__metadata__`` strings (of every file, merged).
    """

    def __init__(self, path: Path, tensors: dict[str, TensorEntry], metadata: dict[str, str]):
        self.path = path
        self.tensors = tensors
        self.metadata = metadata
        self._fds: dict[Path, int] = {}

    @property
    def files(self) -> list[Path]:
        return sorted({t.file for t in self.tensors.values()})

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def table(self) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]:
        """name -> (shape, dtype): what a mapping is resolved against."""
        return {n: (t.shape, t.dtype) for n, t in self.tensors.items()}

    def _fd(self, file: Path) -> int:
        fd = self._fds.get(file)
        if fd is None:
            fd = self._fds[file] = os.open(file, os.O_RDONLY)
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> SafetensorsFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_rows(self, name: str, lo: int, hi: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``[lo, hi)`` of the first axis (a scalar: all of it), one positioned read
        (into ``out``, a C-contiguous array of that shape and dtype, when given)."""
        t = self.tensors[name]
        shape = t.shape
        if not shape:
            lo, hi, row_shape = 0, 1, ()
        else:
            row_shape = shape[1:]
        row = math.prod(row_shape) * t.dtype.itemsize
        if out is None:
            out = host_empty(((hi - lo), *row_shape) if shape else (), t.dtype)
        view = memoryview(out.reshape(-1).view(np.uint8)) if out.size else memoryview(b"")
        fd, pos, done = self._fd(t.file), t.offset + lo * row, 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], pos + done)
            if n <= 0:
                raise CheckpointError(f"{t.file}: file ends inside tensor {name}")
            done += n
        return out

    def mapped(self, name: str) -> np.ndarray:
        """The stored tensor as a read-only array over a memory map of its bytes only.

        For slices across the rows (a transposed leaf's device block): the slice is
        copied straight out of the page cache, where a read would first copy the whole
        tensor into a buffer. The mapped pages count in RSS only while the map lives; the
        map is closed when the last view of it is dropped (``fetch``'s cache holds it for
        one leaf).
        """
        t = self.tensors[name]
        if t.nbytes == 0:
            return np.empty(t.shape, t.dtype)
        start = t.offset - t.offset % mmap.ALLOCATIONGRANULARITY
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(
            self._fd(t.file),
            t.offset - start + t.nbytes,
            flags=flags,
            prot=mmap.PROT_READ,
            offset=start,
        )
        return np.frombuffer(mm, t.dtype, math.prod(t.shape), t.offset - start).reshape(t.shape)

    def fetch(self, cache: dict[Any, np.ndarray]) -> Callable[[str, tuple[slice, ...]], np.ndarray]:
        """A ``fetch(name, index)`` for recipes. A slice of whole rows is one positioned
        read of its bytes; any other slice is a read-only view of the tensor's memory map
        (kept in ``cache``, which the caller drops after each leaf), copied once by the
        recipe's last step. ``fetch(name, index, out)``: whole rows are read straight
        into ``out`` (a C-contiguous block of a larger buffer: a stacked leaf's part)."""

        def fetch(name: str, index: tuple[slice, ...], out: np.ndarray | None = None) -> np.ndarray:
            t = self.tensors[name]
            if not index:
                return self.read_rows(name, 0, 1, out)
            first, rest = index[0], index[1:]
            if all(s.start == 0 and s.stop == d for s, d in zip(rest, t.shape[1:], strict=True)):
                return self.read_rows(name, first.start, first.stop, out)
            whole = cache.get(name)
            if whole is None:
                whole = cache[name] = self.mapped(name)
            return whole[index]

        fetch.reads_into = True  # type: ignore[attr-defined]
        return fetch


def is_safetensors(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a safetensors checkpoint: a ``.safetensors`` file, an
    ``*.index.json`` file, a directory holding either (and no Orbax metadata), or an
    ``hf://`` repository id (resolved when opened)."""
    if hub.is_hub(path):
        return True
    p = Path(path)
    if p.is_file():
        return p.suffix == ".safetensors" or p.name.endswith(".index.json")
    if p.is_dir() and not (p / "_CHECKPOINT_METADATA").exists():
        return (p / INDEX_NAME).is_file() or any(p.glob("*.safetensors"))
    return False


def open_safetensors(path: str | os.PathLike[str]) -> SafetensorsFiles:
    """Read the header(s) of a safetensors file, an index file, a directory holding
    ``model.safetensors.index.json`` or one ``*.safetensors`` file, or an
    ``hf://org/name[@revision]`` repository (its snapshot directory: ``hub.resolve``).
    Nothing else is read.

    Raises:
        CheckpointError: no such file or repository, a malformed header or index, an index
            entry outside the index's directory, a tensor named in the index missing from
            its file, or one tensor in two files.
    """
    p = hub.resolve(path) if hub.is_hub(path) else Path(path)
    if p.is_dir():
        index = p / INDEX_NAME
        files = sorted(p.glob("*.safetensors"))
        if index.is_file():
            p = index
        elif len(files) == 1:
            p = files[0]
        else:
            raise CheckpointError(
                f"{p}: a directory without {INDEX_NAME} and with {len(files)} .safetensors "
                "files; pass the index or one file"
            )
    if not p.exists():
        raise CheckpointError(f"{p}: no such safetensors file or index")
    if p.name.endswith(".json"):
        return _open_index(p)
    tensors, meta = _read_header(p)
    return SafetensorsFiles(p, tensors, meta)


class _Pairs(dict[str, Any]):
    """A JSON object that remembers its repeated keys (``json`` keeps the last silently)."""

    repeated: list[tuple[str, Any, Any]]


def _pairs(pairs: list[tuple[str, Any]]) -> _Pairs:
    out = _Pairs()
    out.repeated = []
    for k, v in pairs:
        if k in out:
            out.repeated.append((k, out[k], v))
        out[k] = v
    return out


def _roots(directory: Path) -> list[Path]:
    """Where an index's files may resolve to: its directory, and for a Hugging Face cache
    snapshot (``models--org--name/snapshots/<rev>``, whose files are links into
    ``models--org--name/blobs``) that repository's blobs."""
    base = directory.resolve()
    roots = [base]
    if base.parent.name == "snapshots":
        roots.append(base.parent.parent / "blobs")
    return roots


def _escapes(directory: Path, file: str) -> str | None:
    """Why the index entry ``file`` leaves ``directory``, or ``None``."""
    if os.path.isabs(file) or Path(file).is_absolute() or file.startswith(("/", "\\")):
        return "an absolute path"
    if ".." in re.split(r"[/\\]", file):
        return "a path through '..'"
    target = (directory / file).resolve()
    if not any(target.is_relative_to(r) for r in _roots(directory)):
        return f"a link to {target}"
    return None


def _open_index(p: Path) -> SafetensorsFiles:
    try:
        doc = json.loads(p.read_text(), object_pairs_hook=_pairs)
        weight_map = doc["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{p}: not a safetensors index (want a JSON object with weight_map: "
            f"name -> file): {type(e).__name__}: {e}"
        ) from None
    problems = [
        f"  {name}: the index puts it in two files, {first} and {second}"
        for name, first, second in getattr(weight_map, "repeated", [])
    ]
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(str(file), []).append(name)
    tensors: dict[str, TensorEntry] = {}
    meta: dict[str, str] = {}
    headers: dict[str, dict[str, TensorEntry]] = {}
    for file, names in by_file.items():
        why = _escapes(p.parent, file)
        if why is not None:
            problems.append(
                f"  {file}: outside the index's directory ({why}), named for "
                f"{names[0]}{f' and {len(names) - 1} more' if len(names) > 1 else ''}; "
                "refused"
            )
            continue
        f = p.parent / file
        if not f.is_file():
            problems.append(f"  {file}: listed in the index, no such file")
            continue
        headers[file], m = _read_header(f)
        meta.update(m)
    holder: dict[str, str] = {}
    twice = {name for name, _, _ in getattr(weight_map, "repeated", [])}
    for file, h in headers.items():
        for name in h:
            other = holder.setdefault(name, file)
            if other != file and name not in twice:
                problems.append(f"  {name}: held by two files, {other} and {file}")
    for name, file in weight_map.items():
        h = headers.get(str(file))
        if h is None:
            continue
        if name not in h:
            problems.append(f"  {name}: the index puts it in {file}, which does not hold it")
            continue
        tensors[name] = h[name]
    if problems:
        n = len(problems)
        raise CheckpointError(
            f"{p}: {n} problem{'s' if n != 1 else ''} in the index:\n" + "\n".join(problems)
        )
    return SafetensorsFiles(p, tensors, meta)


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


def _make_dir(d: Path) -> None:
    try:
        d.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise CheckpointError(
            f"{d}: cannot be the directory to write safetensors into (it, or a parent of "
            "it, is a file)"
        ) from None
    except PermissionError as e:
        raise CheckpointError(f"{d}: cannot create the directory to write into: {e}") from None


def check_pieces(
    name: str, pieces: list[np.ndarray], shape: tuple[int, ...], dt: np.dtype[Any]
) -> None:
    """A computed tensor: one array of the entry's shape, or blocks of whole rows that
    concatenate to it, all of the entry's dtype."""
    a = pieces[0]
    if len(pieces) == 1 and a.shape == shape and a.dtype == dt:
        return
    rows_fit = (
        len(pieces) > 1
        and len(shape) > 0
        and all(p.ndim == len(shape) and p.shape[1:] == shape[1:] for p in pieces)
        and sum(p.shape[0] for p in pieces) == shape[0]
    )
    if rows_fit and all(p.dtype == dt for p in pieces):
        return
    got = (
        f"{a.dtype}{list(a.shape)}"
        if len(pieces) == 1
        else " + ".join(f"{p.dtype}{list(p.shape)}" for p in pieces)
    )
    raise CheckpointError(f"{name}: computed {got}, the header says {dt}{list(shape)}")


Entry = tuple[str, tuple[int, ...], Any]


def encode_header(
    items: list[Entry], metadata: Mapping[str, str] | None
) -> tuple[bytes, list[int]]:
    """What a file holds before its data (the 8-byte length and the JSON header, padded
    to 8 bytes), and where each tensor's bytes start in the file."""
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
    """A token no other write draws: temporary files carry it, so two writers (two
    processes, two runs) never write under one temporary name."""
    return uuid.uuid4().hex[:16]


def temporary(p: Path, token: str) -> Path:
    """The temporary file a write of ``p`` fills before renaming it into place."""
    return p.with_name(f"{p.name}.{token}.partial")


def fsync_dir(d: Path) -> None:
    """Make the renames into ``d`` durable."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_partial(
    p: Path,
    items: list[Entry],
    compute: Callable[[str], Any],
    metadata: Mapping[str, str] | None,
    progress: Callable[[int], None] | None,
    token: str,
) -> Path:
    """``p``'s temporary (``temporary(p, token)``), complete and synced: the header, then
    each tensor's bytes (``compute(name)``: the tensor, or a list of blocks of whole rows
    in order, written one after the other: a leaf sharded along its first axis, shard by
    shard)."""
    head, _ = encode_header(items, metadata)
    tmp = temporary(p, token)
    try:
        with open(tmp, "xb") as f:
            f.write(head)
            for name, shape, dt in items:
                got = compute(name)
                pieces = [contiguous(a) for a in (got if isinstance(got, list) else [got])]
                check_pieces(name, pieces, tuple(shape), np.dtype(dt))
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
class Layout:
    """The files one write produces, decided from the names and sizes alone (every
    process of a run computes the same one).

    Attributes:
        files: each final file and the tensors it holds, in order.
        index: the sharded layout's index (written last), or None.
        index_text: its contents.
        out: what the write returns: the one file, or the index.
        stem: ``(directory, stem)`` whose earlier sharded files the write replaces, or
            None (one file named by the caller).
    """

    files: list[tuple[Path, list[Entry]]]
    index: Path | None
    index_text: str | None
    out: Path
    stem: tuple[Path, str] | None

    @property
    def directory(self) -> Path:
        return self.out.parent

    def existing(self) -> list[Path]:
        """What is at the destination now that this write would replace."""
        if self.stem is None:
            p = self.out
            return [p] if p.is_file() or p.is_symlink() else []
        return sharded_layout(*self.stem)


def plan_layout(
    path: str | os.PathLike[str], items: list[Entry], max_shard_size: int | str | None
) -> Layout:
    """The files that writing ``items`` to ``path`` makes: one file, or with
    ``max_shard_size`` Hugging Face's sharded layout (see ``write_sharded``).

    Raises:
        CheckpointError: one file to an index name; a malformed ``max_shard_size``.
    """
    if max_shard_size is None:
        p = Path(path)
        if p.name.endswith(".index.json"):
            raise CheckpointError(
                f"{p}: an index file name; a safetensors file would be written under it. Pass a "
                ".safetensors file name, or max_shard_size= to write a sharded checkpoint "
                "with this index"
            )
        return Layout([(p, items)], None, None, p, None)
    directory, stem = sharded_names(path)
    groups = shard_groups(items, parse_size(max_shard_size))
    if len(groups) == 1:
        out = directory / f"{stem}.safetensors"
        return Layout([(out, items)], None, None, out, (directory, stem))
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
    return Layout(files, index, text, index, (directory, stem))


def prepare_directory(layout: Layout) -> None:
    """Check that ``layout`` can be written where it goes, creating missing parent
    directories (as ``save_pretrained`` creates its directory).

    Raises:
        CheckpointError: one file's path is a directory; a parent is a file.
    """
    if layout.stem is None and layout.out.is_dir():
        raise CheckpointError(f"{layout.out}: a directory; pass a .safetensors file name in it")
    _make_dir(layout.directory)


def write_index(layout: Layout, token: str) -> Path | None:
    """The index's temporary, written and synced (None: no index)."""
    if layout.index is None or layout.index_text is None:
        return None
    tmp = temporary(layout.index, token)
    with open(tmp, "x") as f:
        f.write(layout.index_text)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def commit_layout(layout: Layout, temps: list[Path], index_tmp: Path | None) -> Path:
    """Rename complete temporaries into place (the index last), make the renames durable,
    then remove the earlier layout's files under the same stem that this one does not
    have."""
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
    layout: Layout,
    compute: Callable[[str], Any],
    metadata: Mapping[str, str] | None,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Write every file of ``layout`` from this process: each complete (temporary,
    synced) before any is renamed into place; a failure removes the temporaries and
    leaves what was there untouched."""
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
) -> Path:
    """Write a safetensors file a tensor at a time: the header from ``entries`` (name,
    shape, dtype), then each tensor's bytes from ``compute(name)``, which may free it
    after. The file appears under ``path`` only once complete (a temporary of its own,
    synced, renamed); missing parent directories are created.

    Raises:
        CheckpointError: ``path`` ends ``.index.json`` or is a directory; a parent is a
            file; a computed tensor does not match its entry.
    """
    return write_layout(plan_layout(path, list(entries), None), compute, metadata, progress)


def shard_groups(
    items: list[tuple[str, tuple[int, ...], Any]], max_bytes: int
) -> list[list[tuple[str, tuple[int, ...], Any]]]:
    """Tensors into shards in order, as ``huggingface_hub``/``transformers`` split a state
    dict: a new shard when the next tensor would take the current one over ``max_bytes``;
    a tensor larger than that alone in a shard of its own."""
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
    """``(directory, stem)`` of a sharded write: a directory (stem ``model``), a
    ``name.safetensors`` or a ``name.safetensors.index.json`` (stem ``name``). Shards
    are ``{stem}-00001-of-0000n.safetensors``, the index ``{stem}.safetensors.index.json``;
    a checkpoint that fits one shard is ``{stem}.safetensors`` alone."""
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
    """The files of the sharded layout under ``stem`` that ``directory`` holds now, sorted:
    the index ``{stem}.safetensors.index.json``, a lone ``{stem}.safetensors`` and shards
    ``{stem}-0000k-of-0000n.safetensors`` (what a sharded write there replaces)."""
    if not directory.is_dir():
        return []
    shard = re.compile(re.escape(stem) + r"-\d{5}-of-\d{5}\.safetensors")
    names = {f"{stem}.safetensors", f"{stem}.safetensors.index.json"}
    return sorted(f for f in directory.iterdir() if f.name in names or shard.fullmatch(f.name))


def write_sharded(
    path: str | os.PathLike[str],
    entries: Iterable[Entry],
    compute: Callable[[str], np.ndarray],
    metadata: Mapping[str, str] | None,
    max_shard_size: int | str,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Hugging Face's sharded layout: ``{stem}-0000k-of-0000n.safetensors`` of at most
    ``max_shard_size`` bytes each (a larger tensor alone) and ``{stem}.safetensors.index.json``
    (``metadata.total_size``, ``weight_map``), the names and index ``transformers`` writes;
    one shard: ``{stem}.safetensors`` alone.

    Every shard is written complete (a temporary, synced) before any is renamed into
    place; the index goes last. Shard files of an earlier layout under the same stem (and
    a lone ``{stem}.safetensors``, or a stale index) are removed once the new checkpoint is
    complete. Returns the index (or the one file).
    """
    layout = plan_layout(path, list(entries), max_shard_size)
    return write_layout(layout, compute, metadata, progress)
