"""A JAX compilation cache that several processes share: ``use(folder)`` before compiling.

The test processes of a run share one (``conftest.py``), and so do the processes that run
the docs' code (``project/test_docs.py``). Imports nothing but JAX.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import jax


def use(folder: str) -> None:
    """Compile through a cache in ``folder``, with no size limit and every program kept;
    on a JAX whose cache is laid out otherwise, nothing changes."""
    try:
        from jax._src import lru_cache
    except ImportError:
        return
    if getattr(lru_cache, "_CACHE_SUFFIX", None) != "-cache" or not hasattr(
        lru_cache.LRUCache, "put"
    ):
        return

    def put_whole(self: Any, key: str, value: bytes) -> None:
        # jax 0.9.1 to 0.12's LRUCache.put (no size limit) writes the entry in place: a
        # process reading it meanwhile got a truncated stream, a warning (an error where a
        # test turns warnings into errors). Written aside, then renamed: whole or absent.
        path = Path(self.path) / f"{key}-cache"
        if path.exists():
            return
        part = path.with_name(f".{key}.{os.getpid()}.{threading.get_native_id()}")
        part.write_bytes(value)
        os.replace(part, path)

    lru_cache.LRUCache.put = put_whole
    jax.config.update("jax_compilation_cache_max_size", -1)  # the put above keeps no size
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
