"""A TensorStore reference leak on every restore through Orbax's spec, undone.

TensorStore's ``JsonToPyObject`` (0.1.86) hands each key and value of a JSON object to
``PyDict_SetItem``, which does not steal them: every dict ``to_json()`` gives keeps one
reference too many. Orbax (0.12.8) calls ``ts.KvStore.Spec(...).to_json()`` for each array
it reads (``sources.array_spec``). ``stop_leaks`` makes ``to_json`` of ``ts.KvStore.Spec``
and ``ts.Spec`` drop that reference, only where a probe conversion shows it.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

_lock = threading.Lock()
_stopped = False

_decref = ctypes.pythonapi.Py_DecRef
_decref.argtypes = [ctypes.py_object]
_decref.restype = None


def give_back(value: Any) -> None:
    """Drop the reference ``JsonToPyObject`` kept on every key and value of every dict in
    ``value`` (the dicts of a list included; a list's items are not over-counted)."""
    if isinstance(value, dict):
        for k, v in value.items():
            give_back(v)
            # the dict still holds each of them: nothing is freed while it is walked
            _decref(k)
            _decref(v)
    elif isinstance(value, list):
        for v in value:
            give_back(v)


def kept_references(convert: Callable[[], dict[str, Any]]) -> int:
    """How many references the first key and value of ``convert()`` keep once the dict is
    gone: 2 under the bug, 0 without it (``convert`` makes strings of its own, not
    interned ones)."""
    converted = convert()
    key, value = next(iter(converted.items()))
    del converted
    # each is held here and by getrefcount's argument
    return sys.getrefcount(key) + sys.getrefcount(value) - 4


def _returning_references(to_json: Any) -> Any:
    @functools.wraps(to_json)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = to_json(self, *args, **kwargs)
        give_back(out)
        return out

    return wrapper


def _plug(cls: Any, probe: Callable[[], Any]) -> None:
    """Wrap ``cls.to_json`` with ``give_back`` if ``probe()``'s conversion over-counts."""
    from .._internals import wrap_to_json

    if kept_references(lambda: probe().to_json()) == 2:
        wrap_to_json(cls, _returning_references)


def stop_leaks() -> None:
    """Stop TensorStore's conversions to Python leaking on every save and restore (see the
    module docstring); idempotent, and the first call costs two probe conversions."""
    global _stopped
    if _stopped:  # called per leaf by the stream writer: no lock once installed
        return
    with _lock:
        if _stopped:
            return
        import tensorstore as ts

        path = "/modelshard-probe-of-tensorstore-json/"
        _plug(ts.KvStore.Spec, lambda: ts.KvStore.Spec({"driver": "file", "path": path}))
        _plug(
            ts.Spec,
            lambda: ts.Spec({"driver": "zarr", "kvstore": {"driver": "file", "path": path}}),
        )
        _stopped = True
