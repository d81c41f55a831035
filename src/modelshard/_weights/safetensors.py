"""The safetensors format, read a block at a time: whole rows by one positioned read, any
other block as a view of a map of that one tensor (not of the file: mapped pages count in
RSS while the map is open)."""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from .._base import CheckpointError
from . import hub
from .recipe import host_empty

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
    """Where one stored tensor lives: its file and the byte offset of its data."""

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
    """A safetensors file or sharded checkpoint, headers only (``metadata``: every file's)."""

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
        if file not in self._fds:
            self._fds[file] = os.open(file, os.O_RDONLY)
        return self._fds[file]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> SafetensorsFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_rows(self, name: str, lo: int, hi: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``[lo, hi)`` (a scalar: all of it) by one positioned read, into ``out`` if given."""
        t = self.tensors[name]
        if not t.shape:
            lo, hi = 0, 1
        row = math.prod(t.shape[1:]) * t.dtype.itemsize
        if out is None:
            out = host_empty((hi - lo, *t.shape[1:]) if t.shape else (), t.dtype)
        view = memoryview(out.reshape(-1).view(np.uint8)) if out.size else memoryview(b"")
        fd, pos, done = self._fd(t.file), t.offset + lo * row, 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], pos + done)
            if n <= 0:
                raise CheckpointError(f"{t.file}: file ends inside tensor {name}")
            done += n
        return out

    def mapped(self, name: str) -> np.ndarray:
        """The stored tensor over a read-only map of its bytes, unmapped with its last view."""
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
        """A recipe ``fetch(name, index[, out])``; its maps go in ``cache`` (dropped per leaf)."""

        def fetch(name: str, index: tuple[slice, ...], out: np.ndarray | None = None) -> np.ndarray:
            t = self.tensors[name]
            if not index:
                return self.read_rows(name, 0, 1, out)
            first, rest = index[0], index[1:]
            if all(s.start == 0 and s.stop == d for s, d in zip(rest, t.shape[1:], strict=True)):
                return self.read_rows(name, first.start, first.stop, out)
            if name not in cache:
                cache[name] = self.mapped(name)
            return cache[name][index]

        fetch.reads_into = True  # type: ignore[attr-defined]
        return fetch


def is_safetensors(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a safetensors file, an index, a directory holding either (and
    no Orbax metadata), or an ``hf://`` repository."""
    if hub.is_hub(path):
        return True
    p = Path(path)
    if p.is_file():
        return p.suffix == ".safetensors" or p.name.endswith(".index.json")
    if p.is_dir() and not (p / "_CHECKPOINT_METADATA").exists():
        return (p / INDEX_NAME).is_file() or any(p.glob("*.safetensors"))
    return False


def open_safetensors(path: str | os.PathLike[str]) -> SafetensorsFiles:
    """The headers of a file, an index, a directory holding either, or an ``hf://``
    repository. ``CheckpointError``: missing, a malformed header or index, an entry outside
    its directory, a tensor missing or twice."""
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

    def __init__(self, pairs: list[tuple[str, Any]]):
        super().__init__()
        self.repeated: list[tuple[str, Any, Any]] = []
        for k, v in pairs:
            if k in self:
                self.repeated.append((k, self[k], v))
            self[k] = v


def _escapes(directory: Path, file: str) -> str | None:
    """Why the index entry ``file`` leaves ``directory``, or ``None``; in a Hugging Face cache
    snapshot (``models--org--name/snapshots/<rev>``) its links into ``blobs`` stay inside."""
    if os.path.isabs(file) or Path(file).is_absolute() or file.startswith(("/", "\\")):
        return "an absolute path"
    if ".." in re.split(r"[/\\]", file):
        return "a path through '..'"
    base, target = directory.resolve(), (directory / file).resolve()
    blobs = base.parent.parent / "blobs" if base.parent.name == "snapshots" else base
    if not (target.is_relative_to(base) or target.is_relative_to(blobs)):
        return f"a link to {target}"
    return None


def _open_index(p: Path) -> SafetensorsFiles:
    try:
        doc = json.loads(p.read_text(), object_pairs_hook=_Pairs)
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
