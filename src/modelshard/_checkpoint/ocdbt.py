"""Orbax's layout of a checkpoint, built without importing Orbax (a fresh process's slowest
import, left to checkpoints only it can read): zarr v2 arrays in an OCDBT database per
writing process (``ocdbt.process_<i>/``), merged into the root's once all are written, beside
Orbax's metadata files; each JSON file and TensorStore spec equals Orbax's own
(``tests/checkpoint/test_ocdbt.py`` compares them)."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import re
import time
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import unquote

from . import urls

# Orbax's TensorStore resources (``tensorstore_utils.get_ts_context``): file reads and
# writes in flight, and a cache of OCDBT's B-tree nodes.
FILE_IO_CONCURRENCY = 128
OCDBT_NODE_CACHE_BYTES = 100_000_000

OCDBT_MANIFEST = "manifest.ocdbt"
"""The file of an OCDBT database that indexes everything in it."""

# What Orbax's writes configure an OCDBT database with (``_add_ocdbt_write_options``):
# data files of up to 2 GiB on a disk, 400 MiB on object storage.
TARGET_DATA_FILE_SIZE = 2 << 30
REMOTE_TARGET_DATA_FILE_SIZE = 400 << 20
_WRITE_CONFIG = {
    "config": {
        "max_inline_value_bytes": 1024,
        "max_decoded_node_bytes": 100_000_000,
        "manifest_kind": "single",
    },
    "assume_config": True,
}

# What Orbax's specs add on object storage (``is_remote_storage``): adjacent reads merged.
_COALESCING = {
    "experimental_read_coalescing_threshold_bytes": 1_000_000,
    "experimental_read_coalescing_merged_bytes": 500_000_000_000,
    "experimental_read_coalescing_interval": "1ms",
}

Tree = str | dict[str, Any]
"""Where a checkpoint's arrays live: a TensorStore kvstore (``urls.kvstore``), or the path
of a local directory."""

# Orbax's names of a zarr v2 array's metadata and chunk keys (``ocdbt_utils``).
_ZARRAY = re.compile(r"(?:^|/)\.zarray$")
_CHUNK = re.compile(r"(?:^|/)\d+(\.\d+)*$")


def metadata_entries(tree_metadata: Any) -> list[tuple[tuple[str, ...], Any]]:
    """Each entry of Orbax's ``_METADATA`` (parsed), in its order: its storage key and its
    value metadata. A file not of Orbax's shape raises ``KeyError``, ``TypeError`` or
    ``AttributeError``."""
    return [
        (tuple(str(k["key"]) for k in entry["key_metadata"]), entry["value_metadata"])
        for entry in tree_metadata["tree_metadata"].values()
    ]


def array_keys(tree_metadata: Any) -> list[tuple[str, ...]]:
    """The storage keys of the arrays ``_METADATA`` lists: what plain Orbax reads by."""
    return [k for k, v in metadata_entries(tree_metadata) if v["value_type"] == "jax.Array"]


def context(cache_bytes: int = 0, *, sync: bool = True) -> Any:
    """A TensorStore context like Orbax's: ``cache_bytes`` of decoded chunks (0: none);
    without ``sync``, files written are not synced as each OCDBT commit writes them (the
    writer syncs the store itself, once)."""
    import tensorstore as ts

    spec: dict[str, Any] = {
        "file_io_concurrency": {"limit": FILE_IO_CONCURRENCY},
        "cache_pool#ocdbt": {"total_bytes_limit": OCDBT_NODE_CACHE_BYTES},
    }
    if cache_bytes:
        spec["cache_pool"] = {"total_bytes_limit": int(cache_bytes)}
    if not sync:
        spec["file_io_sync"] = False
    return ts.Context(spec)


def _base(tree: Tree, sub: str = "") -> dict[str, Any]:
    """The kvstore of ``tree`` (or of its folder ``sub``), its path as Orbax's specs give
    it: a local directory's with a trailing ``/``, an object store's without."""
    kv = {"driver": "file", "path": os.path.normpath(tree) + "/"} if isinstance(tree, str) else tree
    path = str(kv.get("path", ""))
    if sub:
        path = f"{path.rstrip('/')}/{sub}" if path.strip("/") else sub
    if kv["driver"] == "file":
        path = path.rstrip("/") + "/"
    return {**kv, "path": path}


def _kvstore(tree: Tree, *, write: bool, sub: str = "") -> dict[str, Any]:
    """Orbax's OCDBT kvstore of ``tree`` (``build_kvstore_tspec``), to read or to write."""
    base = _base(tree, sub)
    if base["driver"] == "file":
        # data files written in place, the manifest (what commits them) atomically
        spec: dict[str, Any] = {
            "driver": "ocdbt",
            "base": {**base, "file_io_locking": {"mode": "non_atomic"}},
            "manifest": base,
        }
        size = TARGET_DATA_FILE_SIZE
    else:
        spec = {"driver": "ocdbt", "base": base, **_COALESCING}
        size = REMOTE_TARGET_DATA_FILE_SIZE
    if write:
        spec.update(target_data_file_size=size, **_WRITE_CONFIG)
    return spec


def read_spec(tree_dir: Tree, name: str) -> dict[str, Any]:
    """The TensorStore spec of the stored array ``name`` (Orbax's name of its key) in the
    OCDBT database of ``tree_dir`` (a local path or a kvstore), zarr v2 chunks: the spec
    Orbax's read path opens."""
    return {
        "driver": "zarr",
        "kvstore": {
            **_kvstore(tree_dir, write=False),
            "path": name,
            "cache_pool": "cache_pool#ocdbt",
        },
        "recheck_cached_data": False,
        "recheck_cached_metadata": False,
        "fill_missing_data_reads": False,
    }


def write_spec(
    tree_dir: Tree,
    name: str,
    *,
    shape: tuple[int, ...],
    chunk: tuple[int, ...],
    dtype: Any,
    process: int,
    compress: bool,
) -> dict[str, Any]:
    """The TensorStore spec Orbax's ``ArrayWriteSpec`` gives the array ``name`` (``dtype`` a
    NumPy dtype), in chunks of ``chunk`` (under ``TARGET_DATA_FILE_SIZE`` bytes: Orbax keeps
    the shape it is given), in the database of ``process`` under ``tree_dir``."""
    kv = _kvstore(tree_dir, write=True, sub=f"ocdbt.process_{process}")
    return {
        "driver": "zarr",
        "kvstore": {**kv, "path": name, "cache_pool": "cache_pool#ocdbt"},
        "recheck_cached_data": False,
        "recheck_cached_metadata": False,
        "store_data_equal_to_fill_value": True,
        "metadata": {
            "shape": list(shape),
            "chunks": list(chunk),
            "compressor": {"id": "zstd", "level": 1} if compress else None,
        },
        "dtype": dtype.name,
    }


def sharding_json(sharding: Any) -> str | None:
    """``sharding`` as Orbax's ``_sharding`` file holds it: a ``NamedSharding`` or a
    ``SingleDeviceSharding``; None for another kind, which Orbax does not record either."""
    import jax

    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        (device,) = sharding.device_set
        return json.dumps({"sharding_type": "SingleDeviceSharding", "device_str": str(device)})
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    mesh: Any = sharding.mesh
    data = {
        "sharding_type": "NamedSharding",
        "shape": [int(n) for n in mesh.shape.values()],
        "axis_names": list(mesh.axis_names),
        "axis_types": [str(t) for t in mesh.axis_types],
        "partition_spec": list(sharding.spec),
        "device_mesh": {"mesh": _ids(mesh.devices.tolist())},
    }
    return json.dumps(data)


def _ids(devices: Any) -> Any:
    if isinstance(devices, list):
        return [_ids(d) for d in devices]
    return {"id": int(devices.id)}


def sharding_file(arrays: Iterable[tuple[str, Any]]) -> dict[str, str]:
    """Orbax's ``_sharding`` file of ``arrays``, ``(name, NamedSharding)`` pairs: each
    array's entry (``sharding_json``) under its name in URL-safe base64."""
    return {
        base64.urlsafe_b64encode(name.encode()).decode(): entry
        for name, sharding in arrays
        if (entry := sharding_json(sharding)) is not None
    }


def tree_metadata(arrays: Iterable[tuple[Sequence[str], Sequence[int]]]) -> dict[str, Any]:
    """Orbax's ``_METADATA`` of a PyTree save of ``arrays``, ``(key, chunk)`` pairs: each
    array's storage key (a nested dict's keys) and the shape of its chunks."""
    entries = {
        str(tuple(key)): {
            "key_metadata": [{"key": k, "key_type": 2} for k in key],
            "value_metadata": {
                "value_type": "jax.Array",
                "skip_deserialize": False,
                "write_shape": list(chunk),
            },
        }
        for key, chunk in arrays
    }
    return {
        "tree_metadata": entries,
        "use_ocdbt": True,
        "use_zarr3": False,
        "store_array_data_equal_to_fill_value": True,
        "custom_metadata": None,
    }


ARRAY_METADATAS = "array_metadatas"
SHARDING_FILE = "_sharding"
"""Orbax's folder of per-process array lists and its file of each array's sharding."""


def write_array_list(directory: Any, process: int, arrays: Iterable[tuple[str, Any]]) -> None:
    """Write Orbax's ``array_metadatas/process_<process>`` into ``directory`` (a ``Path`` or
    an ``epath.Path``): ``(name, chunk)`` of each array (every process lists every array;
    Orbax's finalize checks that the lists agree)."""
    listed = [
        {
            "array_metadata": {
                "param_name": name,
                "write_shape": list(chunk),
                "chunk_shape": list(chunk),
                "ext_metadata": None,
            }
        }
        for name, chunk in arrays
    ]
    (directory / ARRAY_METADATAS).mkdir(exist_ok=True)
    (directory / ARRAY_METADATAS / f"process_{process}").write_text(
        json.dumps({"array_metadatas": listed})
    )


def checkpoint_metadata(
    handler: str | dict[str, str], start_ns: int, custom: dict[str, Any]
) -> dict[str, Any]:
    """Orbax's ``_CHECKPOINT_METADATA`` of a checkpoint written by ``handler`` (the dotted
    name of an Orbax handler class, or of each item's by item name) from ``start_ns`` to
    now, with ``custom`` metadata."""
    return {
        "item_handlers": handler,
        "metrics": {},
        "performance_metrics": {},
        "init_timestamp_nsecs": start_ns,
        "commit_timestamp_nsecs": time.time_ns(),
        "custom_metadata": dict(custom),
    }


_PROCESS = "ocdbt.process_"


def _databases(tree_dir: Tree) -> list[str]:
    """The per-process databases under ``tree_dir`` (``ocdbt.process_<i>``), sorted."""
    import tensorstore as ts

    base = _base(tree_dir)
    if base["driver"] == "s3" or base["driver"].startswith("gcs"):
        # listed through epath, as every other object-storage folder is, not TensorStore
        scheme = "s3" if base["driver"] == "s3" else "gs"
        url = f"{scheme}://{base['bucket']}/{base['path'].strip('/')}".rstrip("/")
        urls.forget_listings(url)
        return sorted(p.name for p in urls.location(url).iterdir() if p.name.startswith(_PROCESS))
    store = ts.KvStore.open({**base, "path": base["path"].rstrip("/") + "/"}).result()
    keys = store.list(ts.KvStore.KeyRange(_PROCESS, "ocdbt.process`")).result()
    return sorted({k.decode().split("/", 1)[0] for k in keys if b"/" in k})


def merge(tree_dir: Tree, names: Iterable[str]) -> None:
    """Orbax's finalize of an OCDBT save: every ``ocdbt.process_<i>`` database under
    ``tree_dir`` copied into the root's in one atomic transaction, once every array of
    ``names`` is seen with its zarr metadata and chunks (else a ValueError lists what is
    missing)."""
    import tensorstore as ts

    ctx = context()
    base = _base(tree_dir)
    children = _databases(tree_dir)
    opening = [
        ts.KvStore.open(_kvstore(tree_dir, write=False, sub=d), context=ctx) for d in children
    ]
    parent = ts.KvStore.open(_kvstore(tree_dir, write=True), context=ctx).result()
    txn = ts.Transaction(atomic=True)
    into = parent.with_transaction(txn)
    for done in [child.result().experimental_copy_range_to(into) for child in opening]:
        done.result()
    with_meta, with_chunks = set(), set()
    for key in into.list().result():
        k = key.decode()
        if _ZARRAY.search(k):
            with_meta.add(_ZARRAY.sub("", k))
        else:
            with_chunks.add(_CHUNK.sub("", k))
    wanted = set(names)
    missing = sorted((wanted - with_meta) | (wanted - with_chunks))
    if missing:
        txn.abort()
        where = tree_dir if isinstance(tree_dir, str) else base["path"]
        raise ValueError(
            f"{where}: {len(missing)} of {len(wanted)} arrays are missing their zarr "
            f"metadata or chunks after the merge: {', '.join(missing)}"
        )
    txn.commit_async().result()


# A place in a database's files, as TensorStore's ``ocdbt.dump`` names it
# (``LabeledIndirectDataReference``): ``<kind>:<base path>:<relative path>:<offset>:<length>``,
# both paths percent-encoded and relative to the database's directory.
_FILE = re.compile(r"[^:]+:([^:]*):([^:]*)")


@dataclasses.dataclass
class LostFile:
    """A file of an OCDBT database that its index refers to but that is missing or cut short."""

    path: str  # absolute
    size: int | None  # None: missing
    needed: int  # the end of the furthest byte range the index refers to in it
    names: list[str]  # the arrays (Orbax's names) with a chunk or metadata in it, sorted
    index: bool  # it holds nodes of the index (the arrays indexed under them are unknown)


def lost_files(tree_dir: str) -> list[LostFile]:
    """The files the latest version of the OCDBT database in ``tree_dir`` refers to that are
    missing or shorter than the ranges it refers to, in path order: the manifest and the
    index's nodes are read, every other file only stat'ed (what cannot be decoded is left
    to the reads, which name it)."""
    import tensorstore as ts

    root = os.path.normpath(tree_dir)
    kv = ts.KvStore.open({"driver": "file", "path": root + "/"}).result()
    try:
        versions = ts.ocdbt.dump(kv).result()["versions"]
    except ValueError:
        return []
    top = versions[-1]["root"].get("location") if versions else None
    sizes: dict[str, int | None] = {}  # by path
    paths: dict[str, str | None] = {}  # a reference's "<kind>:<base>:<relative>" -> path
    ends: dict[str, int] = {}  # by that head: the furthest byte referred to
    keys: dict[str, list[bytes]] = {}  # by that head: the keys of values stored there
    nodes: set[str] = set()  # heads of B-tree nodes

    def size(head: str) -> int | None:
        if head not in paths:
            m = _FILE.fullmatch(head)
            paths[head] = path = m and os.path.join(root, unquote(m[1]), unquote(m[2]))
            if path is not None and path not in sizes:
                try:
                    sizes[path] = os.stat(path).st_size
                except (FileNotFoundError, NotADirectoryError):
                    sizes[path] = None
        path = paths[head]
        return sizes[path] if path is not None else None

    def note(location: str) -> tuple[str, int]:
        head, offset, length = location.rsplit(":", 2)
        end = int(offset) + int(length)
        if end > ends.get(head, 0):
            ends[head] = end
        return head, end

    # the B-tree a level at a time, each level's nodes read together; a node's keys are
    # relative to the prefixes above it
    level = [(top, b"")] if top else []
    while level:
        reads = []
        for location, prefix in level:
            head, end = note(location)
            nodes.add(head)
            held = size(head)
            if held is not None and held >= end:
                reads.append((ts.ocdbt.dump(kv, location), prefix))
        level = []
        for read, prefix in reads:
            try:
                entries = read.result()["entries"]
            except ValueError:
                continue
            for e in entries:
                if "location" in e:
                    level.append((e["location"], prefix + e.get("subtree_common_prefix", b"")))
                elif "indirect_value" in e:
                    head, _ = note(e["indirect_value"])
                    keys.setdefault(head, []).append(prefix + e["key"])
    lost: dict[str, LostFile] = {}
    for head, end in ends.items():
        held = size(head)
        path = paths[head]
        if path is None or (held is not None and held >= end):
            continue
        f = lost.setdefault(path, LostFile(path, held, 0, [], False))
        f.needed = max(f.needed, end)
        f.index = f.index or head in nodes
        f.names.extend(_array_name(k) for k in keys.get(head, ()))
    for f in lost.values():
        f.names = sorted(set(f.names))
    return sorted(lost.values(), key=lambda f: f.path)


def _array_name(key: bytes) -> str:
    """The array a key of the database belongs to (its zarr metadata or a chunk)."""
    text = key.decode(errors="replace")
    return _CHUNK.sub("", _ZARRAY.sub("", text))
