"""Knowing that dicts did not change without comparing them: CPython's dict watchers."""

from __future__ import annotations

import atexit
import ctypes
import functools
import itertools
import threading
from typing import Any

_CALLBACK = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
)

_lock = threading.Lock()
# [generation]: each change stores a value never stored before (``next`` is one C call;
# two threads' ``+= 1`` could store the same one)
_ticks = itertools.count(1)
_count = [0]
# None: not tried yet; False: unavailable; else (watch function, watcher id, callback)
_watcher: Any = None


def _changed(event: int, d: int, key: int, new: int) -> int:
    _count[0] = next(_ticks)
    return 0


def _install() -> Any:
    global _watcher
    with _lock:
        if _watcher is not None:
            return _watcher
        try:
            api = ctypes.pythonapi
            add, watch, clear = api.PyDict_AddWatcher, api.PyDict_Watch, api.PyDict_ClearWatcher
        except (AttributeError, OSError):  # before 3.12, or not CPython
            _watcher = False
            return _watcher
        add.argtypes, add.restype = [_CALLBACK], ctypes.c_int
        watch.argtypes, watch.restype = [ctypes.c_int, ctypes.py_object], ctypes.c_int
        clear.argtypes, clear.restype = [ctypes.c_int], ctypes.c_int
        callback = _CALLBACK(_changed)
        try:
            wid = add(callback)  # RuntimeError (raised by ctypes) when every slot is taken
        except (RuntimeError, OSError):
            _watcher = False
            return _watcher
        _watcher = (watch, wid, callback)
        atexit.register(_uninstall, clear, wid)
        return _watcher


def _uninstall(clear: Any, wid: int) -> None:
    global _watcher
    with _lock:
        clear(wid)
        _watcher = False


def watch(dicts: list[Any]) -> bool:
    """Watch every dict of ``dicts``; ``False`` where dict watchers are unavailable."""
    w = _watcher if _watcher is not None else _install()
    if w is False:
        return False
    fn, wid, _ = w
    try:
        for d in dicts:
            fn(wid, d)
    except (ValueError, TypeError, OSError):  # not a dict (PyDict_Watch refuses it)
        return False
    return True


class _Probe:
    def __init__(self) -> None:
        self.a = 1


class _ProbeSlot(_Probe):
    def __setattr__(self, name: str, value: Any) -> None:  # as ``nnx.Pytree`` sets them
        object.__setattr__(self, name, value)


@functools.cache
def watches_attributes() -> bool:
    """Whether changing an attribute moves ``generation`` once its ``vars()`` dict is watched."""
    for cls in (_Probe, _ProbeSlot):
        x = cls()
        if not watch([vars(x)]):
            return False
        for name, change in (("a", 2), ("b", 3), ("a", None)):
            before = generation()
            if change is None:
                delattr(x, name)
            else:
                setattr(x, name, change)
            if generation() == before:
                return False
    return True


def generation() -> int | None:
    """A count that moves whenever a watched dict changes; ``None`` without watchers."""
    return _count[0] if _watcher else None
