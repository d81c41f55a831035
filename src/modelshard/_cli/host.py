"""The process a streaming command runs in: simulated CPU devices and allocator settings."""

from __future__ import annotations

import ctypes
import os

import jax

from .._base import MeshError
from .._internals import backends_are_initialized
from .._runtime import ENV_COORDINATOR, initialize

# Simulating devices costs time and memory in proportion to their number.
MAX_CPU_DEVICES = 4096


def join_launch() -> None:
    """Join the run started by ``modelshard launch``: each process writes its share."""
    if os.environ.get(ENV_COORDINATOR):
        initialize()


def use_cpu_devices(n: int) -> None:
    """Simulate ``n`` CPU devices if JAX has not started yet; else check there are enough."""
    if n > MAX_CPU_DEVICES:
        raise MeshError(
            f"the target mesh has {n} devices; reshard on this host simulates at most "
            f"{MAX_CPU_DEVICES} CPU devices (more takes minutes and gigabytes). Reshard for "
            "a larger mesh on the target cluster itself (modelshard.reshard with its mesh)."
        )
    if not backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", max(n, 1))
    if jax.device_count() < n:
        raise MeshError(
            f"the target mesh needs {n} devices but JAX already started with "
            f"{jax.device_count()}; run modelshard reshard in a fresh process."
        )


# glibc's mallopt parameters
_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8


def _mallopt(*settings: tuple[int, int]) -> None:
    """Set glibc's allocator ``(parameter, value)`` pairs; without glibc, nothing."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    for parameter, value in settings:
        mallopt(parameter, value)


def return_freed_memory() -> None:
    """glibc: blocks of 128 KiB or more mapped apart (unmapped when freed), one arena."""
    _mallopt((_M_MMAP_THRESHOLD, 128 << 10), (_M_ARENA_MAX, 1))


def one_malloc_arena() -> None:
    """glibc: keep one malloc arena (``modelshard reshard``'s setting)."""
    _mallopt((_M_ARENA_MAX, 1))
