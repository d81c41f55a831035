"""Checkpoint locations: local paths, and object-storage URLs through ``etils.epath``.

A location is a local path (made absolute), a ``gs://`` URL (epath needs ``gcsfs``) or an
``s3://`` one (``s3fs``; ``s3.enable``); any other ``scheme://`` is refused by name. epath
serves a URL through fsspec or TensorFlow's file system; ``reaching`` turns either client's
failure into one ``CheckpointError`` naming the server (``client_failure`` tells them apart
by name: TensorFlow is never imported here).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .._base import CheckpointError

OBJECT_SCHEMES = {"gs": ("gcsfs", "gcs"), "s3": ("s3fs", "s3")}
"""The URL schemes checkpoints may use, with the package epath needs for each and the
modelshard extra that installs it."""

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_CLIENTS = ("botocore.", "aiobotocore.", "s3fs.", "gcsfs.", "google.auth.", "google.api_core.")
"""Modules whose exceptions mean an object store's client could not do a request."""


def client_failure(e: BaseException) -> str | None:
    """``"fsspec"`` or ``"tensorflow"``: the storage client whose failure ``e`` is (by
    its type's module and name; nothing is imported), or None for any other error."""
    module = type(e).__module__ or ""
    if module.startswith(_CLIENTS):
        return "fsspec"
    # TensorFlow's errors live in ``tensorflow.python.framework.errors_impl``
    if module.startswith("tensorflow.") and type(e).__name__.endswith("Error"):
        return "tensorflow"
    return None


def is_missing(e: BaseException) -> bool:
    """Whether ``e`` says a file or folder is not there, from either client (TensorFlow's
    ``NotFoundError`` where etils.epath does not turn it into ``FileNotFoundError``)."""
    if isinstance(e, FileNotFoundError | NotADirectoryError):
        return True
    return client_failure(e) == "tensorflow" and type(e).__name__ == "NotFoundError"


def scheme_of(directory: Any) -> str | None:
    """The URL scheme of ``directory`` (``"gs"``), or None for a local path."""
    if isinstance(directory, str | os.PathLike) and not isinstance(directory, Path):
        m = _URL.match(os.fspath(directory))
        if m:
            return m.group(1).lower()
    if type(directory).__module__.startswith("etils"):
        m = _URL.match(str(directory))
        return m.group(1).lower() if m else None
    return None


def location(directory: str | os.PathLike[str]) -> Any:
    """A ``pathlib.Path`` (absolute) for a local path, an ``epath.Path`` for a URL.

    Raises:
        CheckpointError: the URL's scheme is not one of ``OBJECT_SCHEMES``, or the
            package epath needs for it is not installed.
    """
    scheme = scheme_of(directory)
    if scheme is None:
        return Path(directory).expanduser().absolute()
    text = str(directory)
    if scheme not in OBJECT_SCHEMES:
        raise CheckpointError(
            f"unsupported URL scheme {scheme!r} in {text!r}: checkpoints go to a local "
            f"path or to {', '.join(s + '://' for s in OBJECT_SCHEMES)}."
        )
    package, extra = OBJECT_SCHEMES[scheme]
    import importlib.util

    if importlib.util.find_spec(package) is None:
        raise CheckpointError(
            f"{text!r} needs the {package!r} package (etils.epath reads {scheme}:// "
            f"through it): pip install 'modelshard[{extra}]'."
        )
    if scheme == "s3":
        from .s3 import enable

        enable()
    from etils import epath

    return epath.Path(text)


def is_remote(path: Any) -> bool:
    """Whether ``path`` (from ``location``) is on object storage."""
    return not isinstance(path, Path)


def kvstore(path: Any) -> dict[str, Any]:
    """TensorStore's kvstore of the directory ``path`` (from ``location``), as Orbax's specs
    hold it: ``file``, ``gcs`` (or ``TENSORSTORE_GCS_BACKEND``'s driver) or ``s3``
    (``s3.kvstore_spec``)."""
    if not is_remote(path):
        return {"driver": "file", "path": os.path.normpath(path) + "/"}
    bucket, _, key = str(path).split("://", 1)[1].partition("/")
    key = os.path.normpath(key).lstrip("/") if key.strip("/") else ""
    if scheme_of(path) == "s3":
        from .s3 import kvstore_spec

        return kvstore_spec(bucket, key)
    return {
        "driver": os.environ.get("TENSORSTORE_GCS_BACKEND", "gcs"),
        "bucket": bucket,
        "path": key,
    }


def forget_listings(path: Any) -> None:
    """Drop the folder listings s3fs and gcsfs keep for the life of the process, so that the
    next look at ``path`` asks the server and sees what other processes wrote or removed."""
    if not is_remote(path):
        return
    backend = getattr(path, "_backend", None)  # etils.epath's client for this path
    fs = getattr(backend, "fs", None)
    if fs is None:
        return
    with contextlib.suppress(Exception):  # a client without a cache has nothing to forget
        fs(str(path)).invalidate_cache()


def server_of(path: Any, client: str | None = None) -> str:
    """Which server requests for the object-storage ``path`` go to, and what chose it;
    ``client="tensorflow"`` when TensorFlow's file system served them."""
    if client == "tensorflow":
        if scheme_of(path) == "s3":
            where, ignored, package = "S3", "AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL", "s3fs"
        else:
            where, ignored, package = "Google Cloud Storage", "STORAGE_EMULATOR_HOST", "gcsfs"
        return (
            f"{where} through TensorFlow's file system (etils.epath uses it because "
            f"TensorFlow is importable and EPATH_USE_TF is not false; it does not read "
            f"{ignored}: set EPATH_USE_TF=false to go through {package})"
        )
    if scheme_of(path) == "s3":
        from .s3 import endpoint

        url = endpoint()
        if url is None:
            return "AWS S3 (neither AWS_ENDPOINT_URL_S3 nor AWS_ENDPOINT_URL is set)"
        return f"the S3 server {url} (from AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL)"
    host = os.environ.get("STORAGE_EMULATOR_HOST")
    if host:
        return f"the GCS server {host} (from STORAGE_EMULATOR_HOST)"
    return "Google Cloud Storage"


@contextlib.contextmanager
def reaching(path: Any) -> Iterator[None]:
    """Turn an object-storage client's failure in the block (fsspec's or TensorFlow's) into a
    ``CheckpointError`` naming the server and the settings that chose it (a missing object:
    ``FileNotFoundError``); anything else, and any error on a local path, passes unchanged."""
    try:
        yield
    except Exception as e:
        client = client_failure(e)
        if not is_remote(path) or client is None:
            raise
        if is_missing(e):
            raise FileNotFoundError(f"{path}: {e}") from e
        raise CheckpointError(
            f"cannot reach {path} on {server_of(path, client)}: {type(e).__name__}: {e}"
        ) from e


def check_bucket(path: Any) -> None:
    """Refuse an object-storage ``path`` whose bucket does not exist: s3fs and gcsfs
    would create it on the first write, so a misspelt bucket would become a new one.

    Raises:
        CheckpointError: the bucket does not exist, or its server cannot be reached.
    """
    from etils import epath

    scheme, rest = str(path).split("://", 1)
    bucket = f"{scheme}://{rest.split('/', 1)[0]}"
    with reaching(path):
        # the path first: its request fails loudly where the bucket probe says "no"
        there = path.exists() or epath.Path(bucket).exists()
    if not there:
        raise CheckpointError(
            f"bucket {bucket} does not exist on {server_of(path)}: create it first "
            f"(modelshard does not create buckets; the storage client would, on the first "
            f"write to {path})."
        )
