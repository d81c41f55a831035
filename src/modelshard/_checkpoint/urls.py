"""Checkpoint locations: local paths, and object-storage URLs through ``etils.epath``.

A location is a local path (made absolute) or a URL whose scheme Orbax and TensorStore
can write: ``gs://`` (Google Cloud Storage; epath needs ``gcsfs``) and ``s3://`` (epath
needs ``s3fs``). Any other ``scheme://`` is refused by name, instead of becoming a local
folder called ``scheme:``. Object stores have no atomic rename, so a checkpoint there is
complete only once Orbax's commit file is written (see ``storage.COMMIT_FILE``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from .._errors import CheckpointError

OBJECT_SCHEMES = {"gs": ("gcsfs", "gcs"), "s3": ("s3fs", "s3")}
"""The URL schemes checkpoints may use, with the package epath needs for each and the
modelshard extra that installs it."""

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


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
    if scheme == "s3" and not _orbax_keeps_s3_urls():
        raise CheckpointError(
            f"cannot write {text!r}: this Orbax ({_orbax_version()}) turns s3://bucket/x "
            "into s3:/bucket/x before TensorStore sees it, so every save would fail. "
            "Use gs:// or a local (or mounted) path."
        )
    from etils import epath

    return epath.Path(text)


def _orbax_version() -> str:
    from importlib.metadata import version

    return f"orbax-checkpoint {version('orbax-checkpoint')}"


def _orbax_keeps_s3_urls() -> bool:
    """Whether Orbax's TensorStore path normalisation leaves an s3:// URL intact."""
    try:
        from orbax.checkpoint._src.serialization import tensorstore_utils as tsu

        return tsu._normalize_path("s3://bucket/x") == "s3://bucket/x"  # pyright: ignore[reportPrivateUsage]
    except (ImportError, AttributeError):
        return True


def is_remote(path: Any) -> bool:
    """Whether ``path`` (from ``location``) is on object storage."""
    return not isinstance(path, Path)
