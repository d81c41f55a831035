"""``hf://org/name[@revision]`` resolved to a local snapshot by ``huggingface_hub``."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, TypeGuard

from .._base import CheckpointError

PREFIX = "hf://"
PATTERNS = ["*.safetensors", "*.json"]  # weights, their index and config.json
_REPO = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def is_hub(path: Any) -> TypeGuard[str]:
    """Whether ``path`` is an ``hf://`` repository id."""
    return isinstance(path, str) and path.startswith(PREFIX)


def complete(snapshot: Path) -> bool:
    """Whether a snapshot holds a checkpoint, not a download interrupted part-way."""
    index = snapshot / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            return True  # malformed: open_safetensors says how
        return all((snapshot / str(f)).is_file() for f in files)
    return any(snapshot.glob("*.safetensors"))


def resolve(url: str) -> Path:
    """The local snapshot directory: a complete cached one, else a download of
    ``PATTERNS`` (none under ``HF_HUB_OFFLINE``). ``CheckpointError``: none to be had."""
    repo, at, revision = url[len(PREFIX) :].partition("@")
    if not _REPO.fullmatch(repo) or ".." in repo or (at and not revision):
        raise CheckpointError(
            f"{url}: not a Hub repository id (want hf://org/name or hf://org/name@revision)"
        )
    try:
        import huggingface_hub
    except ImportError:
        raise CheckpointError(
            f"{url}: hf:// paths need huggingface_hub (pip install 'modelshard[hf]')"
        ) from None
    at = f" at revision {revision}" if revision else ""
    # the environment as it is now: huggingface_hub reads it once, at its import
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or (env.get("HF_HOME") and os.path.join(env["HF_HOME"], "hub"))
    kw: dict[str, Any] = {
        "revision": revision or None,
        "cache_dir": cache or None,
        "allow_patterns": PATTERNS,
    }
    try:
        local = Path(huggingface_hub.snapshot_download(repo, local_files_only=True, **kw))
        if complete(local):
            return local
    except Exception as e:
        cached: Exception | None = e
    else:
        cached = None
    if env.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "on", "yes", "true"}:
        why = "not complete" if cached is None else "not"
        raise CheckpointError(
            f"{url}: repository {repo}{at} is {why} in the Hugging Face cache "
            f"({cache or 'the default cache'}) and HF_HUB_OFFLINE is set: nothing was "
            "downloaded"
        )
    try:
        got = Path(huggingface_hub.snapshot_download(repo, **kw))
    except Exception as e:
        raise CheckpointError(
            f"{url}: repository {repo}{at} could not be downloaded: {type(e).__name__}: {e}"
        ) from None
    if not complete(got):
        raise CheckpointError(
            f"{url}: repository {repo}{at} holds no complete safetensors checkpoint (its "
            "*.safetensors and *.json files were fetched; weights only in PyTorch .bin files "
            "cannot be read)"
        )
    return got
