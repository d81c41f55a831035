"""What a manager root holds on storage (``_checkpoint/listing.py``): which entries are
complete steps, whose each numbered entry is (the manager's, Orbax's, another tool's, or
nothing to lose), the item of Orbax's step restored as its state, and what a directory
given to the CLI is (a checkpoint, a step, a root at its latest step)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import modelshard as ms
from modelshard._checkpoint import checkpoint_kind, manager_step
from modelshard._checkpoint.listing import (
    ORBAX,
    OTHER,
    OURS,
    Foreign,
    complete_steps,
    entry_owner,
    foreign_steps,
    is_complete_step,
    orbax_state,
    restorable_steps,
)


def _w(step):
    return {"w": jnp.arange(8.0) + step}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> Path:
    """A root holding Orbax's complete step 10 (``state`` and a JSON item, as its guides
    save) and the manager's steps 0 and 2."""
    import orbax.checkpoint as ocp

    root = tmp_path_factory.mktemp("listing") / "run"
    with ocp.CheckpointManager(root) as orbax_mngr:
        orbax_mngr.save(
            10,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave({"w": jnp.full((4,), 10.0)}),
                config=ocp.args.JsonSave({"step": 10}),
            ),
        )
        orbax_mngr.wait_until_finished()
    with ms.CheckpointManager(root, async_save=False, handle_signals=False) as mngr:
        mngr.save(0, _w(0))
        mngr.save(2, _w(2))
    return root


def test_empty_or_foreign_numbered_folders_are_not_steps(tmp_path):
    with ms.CheckpointManager(tmp_path, async_save=False) as mngr:
        mngr.save(0, _w(0))
        (tmp_path / "7").mkdir()
        (tmp_path / "8").mkdir()
        (tmp_path / "8" / "notes.txt").write_text("mine")
        (tmp_path / "007").mkdir()
        assert mngr.all_steps() == [0]
        np.testing.assert_array_equal(mngr.restore()["w"], np.arange(8.0))
        assert mngr.save(7, _w(7))  # an empty folder of that name is replaced
        with pytest.raises(ms.ForeignStepError) as e:
            mngr.save(8, _w(8))
        assert str(e.value).splitlines() == [
            f"cannot save step 8: {tmp_path / '8'} was put there by another tool or by hand "
            "(no step of modelshard's or Orbax's), and this CheckpointManager never removes "
            "or replaces what it did not write.",
            f"Save under another step number, move {tmp_path / '8'} out of {tmp_path}, or, "
            "to replace it, remove it by name with delete(8) first.",
        ]
        assert mngr.all_steps() == [0, 7]
    assert (tmp_path / "8" / "notes.txt").read_text() == "mine"


def test_complete_steps_are_the_managers_own_and_restorable_ones_add_orbaxs(mixed, tmp_path):
    assert complete_steps(mixed) == [0, 2]
    assert foreign_steps(mixed, [0, 2]) == [Foreign(10, "10", ORBAX, True, "state")]
    assert restorable_steps(mixed) == [0, 2, 10]
    assert complete_steps(tmp_path / "missing") == [] == restorable_steps(tmp_path / "missing")


def test_a_step_without_its_record_or_behind_a_link_is_not_complete(mixed, tmp_path):
    root = tmp_path / "run"
    shutil.copytree(mixed / "2", root / "2")
    assert is_complete_step(root / "2")
    (root / "3").symlink_to(root / "2")
    shutil.copytree(mixed / "2", root / "4")
    (root / "4" / "modelshard" / "modelshard.json").unlink()
    shutil.copytree(mixed / "2", root / "5")
    (root / "5" / "_CHECKPOINT_METADATA").unlink()
    (root / "6").write_text("")
    assert [is_complete_step(root / n) for n in ("3", "4", "5", "6", "7")] == [False] * 5
    assert complete_steps(root) == [2]


def _entry(root: Path, name: str, files: dict[str, str]) -> Path:
    """A numbered entry holding ``files`` (a name ending in ``/``: an empty folder)."""
    path = root / name
    path.mkdir(parents=True)
    for rel, text in files.items():
        if rel.endswith("/"):
            (path / rel).mkdir(parents=True)
        else:
            (path / rel).parent.mkdir(parents=True, exist_ok=True)
            (path / rel).write_text(text)
    return path


def test_entry_owner_tells_whose_each_numbered_entry_is(mixed, tmp_path):
    orbax_meta = (mixed / "10" / "_CHECKPOINT_METADATA").read_text()
    assert json.loads(orbax_meta)["commit_timestamp_nsecs"]  # committed, not marked
    uncommitted = json.dumps({"item_handlers": {"state": "x", "modelshard": "y"}})
    started = json.dumps({"item_handlers": {"state": "x", "default": "y"}})
    entries = {
        "ours, complete": (mixed / "0", OURS),
        "Orbax's, complete": (mixed / "10", ORBAX),
        "ours, record item being written": (
            _entry(tmp_path, "20", {"modelshard.orbax-checkpoint-tmp-7/": ""}),
            OURS,
        ),
        "ours, record announced": (
            _entry(tmp_path, "21", {"_CHECKPOINT_METADATA": uncommitted}),
            OURS,
        ),
        "ours, items alone (items made in name order)": (
            _entry(tmp_path, "22", {"items/": ""}),
            OURS,
        ),
        "a process's share, no metadata yet": (_entry(tmp_path, "23", {"state/d/x": "1"}), OURS),
        "empty": (_entry(tmp_path, "24", {}), None),
        "metadata cut short": (_entry(tmp_path, "25", {"_CHECKPOINT_METADATA": ""}), None),
        "Orbax's, started": (_entry(tmp_path, "26", {"_CHECKPOINT_METADATA": started}), ORBAX),
        "Orbax's, committed, with notes": (
            _entry(tmp_path, "27", {"_CHECKPOINT_METADATA": orbax_meta, "notes.txt": "x"}),
            ORBAX,
        ),
        "Orbax's, committed, a user's item named items": (
            _entry(tmp_path, "32", {"_CHECKPOINT_METADATA": orbax_meta, "items/": ""}),
            ORBAX,
        ),
        "another tool's files": (_entry(tmp_path, "28", {"notes.txt": "mine"}), OTHER),
        "state beside other files, no metadata": (
            _entry(tmp_path, "29", {"state/": "", "notes.txt": "x"}),
            OTHER,
        ),
    }
    (tmp_path / "30").write_text("a file")
    entries["a file"] = (tmp_path / "30", OTHER)
    (tmp_path / "31").symlink_to(mixed / "0")
    entries["a link to a step of ours"] = (tmp_path / "31", OTHER)
    got = {what: entry_owner(path) for what, (path, _) in entries.items()}
    assert got == {what: owner for what, (_, owner) in entries.items()}


def test_the_item_of_orbaxs_step_restored_as_its_state(mixed, tmp_path):
    def names(path):
        return sorted(p.name for p in path.iterdir())

    assert orbax_state(mixed / "10", names(mixed / "10")) == "state"
    single = tmp_path / "single"
    shutil.copytree(mixed / "10" / "state", single / "default")
    # an item Orbax had not finished writing is no candidate
    shutil.copytree(mixed / "10" / "state", single / "extra.orbax-checkpoint-tmp-1")
    assert orbax_state(single, names(single)) == "default"
    shutil.copytree(mixed / "10" / "state", single / "other")
    assert orbax_state(single, names(single)) is None  # two trees: which is the state?
    assert orbax_state(tmp_path / "none", []) is None


def test_what_a_directory_given_to_the_cli_is(mixed, tmp_path):
    ck = ms.save(tmp_path / "ck", _w(1))
    assert checkpoint_kind(mixed / "2") == "step"
    assert checkpoint_kind(mixed / "10") == "step"  # Orbax's step
    assert checkpoint_kind(ck) == "checkpoint"
    assert checkpoint_kind(mixed) is None
    assert checkpoint_kind(tmp_path / "missing") is None
    # a root reads at its latest restorable step, Orbax's included; anything else as given
    assert manager_step(mixed) == (mixed / "10", 10)
    assert manager_step(ck) == (ck, None)
    assert manager_step(mixed / "2") == (mixed / "2", None)
    assert manager_step(tmp_path / "missing") == (tmp_path / "missing", None)
    only_ours = tmp_path / "ours"
    for step in ("0", "2"):
        shutil.copytree(mixed / step, only_ours / step)
    assert manager_step(only_ours) == (only_ours / "2", 2)
    np.testing.assert_array_equal(ms.restore(manager_step(only_ours)[0])["w"], _w(2)["w"])


def test_another_tools_entries_and_the_json_process_0_sends_of_them(mixed, tmp_path):
    root = tmp_path / "run"
    shutil.copytree(mixed / "10", root / "10")
    shutil.copytree(mixed / "0", root / "0")  # the manager's: not listed
    _entry(root, "12", {"notes.txt": "x"})
    started = json.dumps({"item_handlers": {"state": "x"}})
    _entry(root, "13.orbax-checkpoint-tmp-5", {"_CHECKPOINT_METADATA": started})
    # the manager's complete steps are not looked into; a staging folder of one still is
    found = foreign_steps(root, [0, 13])
    assert found == [
        Foreign(10, "10", ORBAX, True, "state"),
        Foreign(12, "12", OTHER, False, None),
        Foreign(13, "13.orbax-checkpoint-tmp-5", ORBAX, False, None),
    ]
    assert [Foreign.from_json(json.loads(json.dumps(f.to_json()))) for f in found] == found
    assert [f.kind for f in found] == ["complete, Orbax", "another tool", "unfinished, Orbax"]
    assert [f.restorable for f in found] == [True, False, False]
    assert found[2].describe(root) == (
        f"{root / '13.orbax-checkpoint-tmp-5'} is an unfinished save by another tool (Orbax)"
    )


def test_an_entry_renamed_while_the_root_is_listed_is_not_an_error(tmp_path, monkeypatch):
    """A save renames its staging folder (or a rotation removes a step) between the
    listing of the root and the look into the entry: a reader's listing skips it (seen
    as FileNotFoundError from ``latest_step`` while a writer saved and rotated)."""

    from modelshard._checkpoint import listing

    staging = tmp_path / "3.orbax-checkpoint-tmp"
    (staging / "state").mkdir(parents=True)
    real = listing.is_marked

    def renamed_meanwhile(path):
        if path == staging:
            shutil.move(staging, tmp_path / "3")  # the writer's rename, just now
        return real(path)

    monkeypatch.setattr(listing, "is_marked", renamed_meanwhile)
    assert listing.foreign_steps(tmp_path) == []
