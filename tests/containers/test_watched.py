"""Dict watchers: a generation count that moves with every change of a watched dict."""

from __future__ import annotations

import subprocess
import sys

import pytest

from modelshard._containers import watched

pytestmark = pytest.mark.skipif(
    sys.version_info < (3, 12) or sys.implementation.name != "cpython",
    reason="dict watchers are CPython 3.12+",
)

EDITS = {
    "setitem": lambda d: d.__setitem__("a", 2),
    "new key": lambda d: d.__setitem__("z", 0),
    "update": lambda d: d.update(b=3),
    "del": lambda d: d.__delitem__("a"),
    "pop": lambda d: d.pop("b"),
    "popitem": lambda d: d.popitem(),
    "setdefault of a new key": lambda d: d.setdefault("n", 1),
    "clear": lambda d: d.clear(),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_every_change_of_a_watched_dict_moves_the_generation(edit):
    d = {"a": 1, "b": 2}
    assert watched.watch([d])
    before = watched.generation()
    assert before is not None
    d["a"]  # reads move nothing
    assert watched.generation() == before
    EDITS[edit](d)
    assert watched.generation() != before


def test_storing_the_very_same_value_is_no_change():
    d = {"a": 1}
    assert watched.watch([d])
    before = watched.generation()
    d["a"] = d["a"]  # CPython skips the store, and so the watcher: the dict is unchanged
    assert watched.generation() == before
    d["a"] = 2
    assert watched.generation() != before


def test_unwatched_dicts_and_copies_move_nothing():
    d = {"a": 1}
    assert watched.watch([d])
    copy = dict(d)
    before = watched.generation()
    copy["a"] = 2
    {"x": 1}.update(y=2)
    assert watched.generation() == before


def test_only_plain_dicts_are_watched():
    assert watched.watch([[1, 2]]) is False


def test_a_process_exits_cleanly_with_watched_dicts_alive():
    # dicts freed during finalisation must not call a watcher whose module is gone
    code = (
        "from modelshard._containers import watched\n"
        "keep = [{'k': i} for i in range(1000)]\n"
        "assert watched.watch(keep)\n"
        "keep[0]['k'] = -1\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert (out.returncode, out.stdout.strip(), out.stderr) == (0, "ok", "")


def test_attribute_watching_is_probed_as_this_interpreter_behaves():
    """``watches_attributes`` says whether an attribute set on an object whose ``vars()``
    is watched moves the generation; where it says so, an NNX module's does too."""
    from flax import nnx

    class M(nnx.Module):
        def __init__(self):
            self.a = 1

    m = M()
    assert watched.watch([vars(m)])
    before = watched.generation()
    m.a = 2
    moved = watched.generation() != before
    assert moved is watched.watches_attributes()
    if sys.version_info[:2] == (3, 12):
        assert moved  # the tested default stores attributes in the watched dict
