"""A manager root that already holds another tool's steps (``_checkpoint/manager.py``,
``listing.py``): Orbax's own ``CheckpointManager`` wrote steps 10, 15 and 20 there, as a
user moving to modelshard has them. The manager lists and restores them beside its own,
never removes nor replaces them, warns about what it cannot restore, and removes one only
when asked by name; its own interrupted saves are still cleaned."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import modelshard as ms
from helpers import launch_argv
from modelshard._checkpoint import list_steps

ORBAX_STEPS = (10, 15, 20)


def write_orbax_steps(root: Path, steps=ORBAX_STEPS) -> None:
    """Steps saved by Orbax's own CheckpointManager, as its guides show."""
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(root) as mngr:
        for s in steps:
            mngr.save(
                s,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave({"w": jnp.full((4,), float(s))}),
                    metadata=ocp.args.JsonSave({"step": s}),
                ),
            )
        mngr.wait_until_finished()


def snapshot(path: Path, only=None) -> dict[str, bytes | None]:
    """Every folder (None) and file (its bytes) under ``path``, read without modelshard;
    ``only``: under these names of ``path`` alone."""
    out: dict[str, bytes | None] = {}
    for folder, _, files in os.walk(path):
        rel = os.path.relpath(folder, path)
        if only is not None and rel.split(os.sep)[0] not in only:
            continue
        out[rel] = None
        for f in files:
            out[os.path.join(rel, f)] = Path(folder, f).read_bytes()
    return out


def orbax_snapshot(root: Path) -> dict[str, bytes | None]:
    return snapshot(root, only={str(s) for s in ORBAX_STEPS})


def orbax_restores(root: Path, step: int) -> float:
    """Orbax's own manager still restores ``step`` (the user's checkpoint is whole)."""
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(root) as mngr:
        got = mngr.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore({"w": jnp.zeros((4,))}),
                metadata=ocp.args.JsonRestore(),
            ),
        )
    assert got["metadata"] == {"step": step}
    return float(got["state"]["w"][0])


@pytest.fixture(scope="module")
def orbax_steps(tmp_path_factory) -> Path:
    """Orbax's steps written once for the module; each test gets its own copy."""
    root = tmp_path_factory.mktemp("orbax") / "run"
    write_orbax_steps(root)
    return root


@pytest.fixture
def root(tmp_path, orbax_steps) -> Path:
    root = tmp_path / "run"
    shutil.copytree(orbax_steps, root)
    return root


def opened(root: Path, **kw) -> ms.CheckpointManager:
    """The manager on ``root``: Orbax's complete steps it restores give no warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return ms.CheckpointManager(root, async_save=False, handle_signals=False, **kw)


def test_orbaxs_complete_steps_are_listed_and_restored_as_its_own(root):
    with opened(root) as mngr:
        assert (mngr.latest_step(), mngr.all_steps()) == (20, [10, 15, 20])
        assert float(mngr.restore()["w"][0]) == 20.0
        assert float(mngr.restore(15, like={"w": jnp.zeros(4)})["w"][0]) == 15.0
        assert mngr.items() == {"metadata": {"step": 20}}  # its JsonSave item
        assert mngr.items(10) == {"metadata": {"step": 10}}
        assert (mngr.metadata(20), mngr.metrics(20)) == ({}, None)
        assert repr(mngr) == f"CheckpointManager({str(root)!r}, steps=[10, 15, 20])"
    assert ms.read_items(root / "20") == {"metadata": {"step": 20}}


def test_opening_warns_once_naming_what_it_does_not_restore(root):
    _unfinished(root / "10", root / "31.orbax-checkpoint-tmp")
    (root / "32").write_text("notes")
    with pytest.warns(ms.ForeignStepsWarning) as said:
        mngr = ms.CheckpointManager(root, handle_signals=False)
    assert [str(w.message) for w in said] == [
        f"{root} holds steps another tool wrote that this CheckpointManager does not "
        "restore: 31 (unfinished, Orbax); 32 (another tool). It never removes or replaces "
        "them, and does not save over their numbers (should_save is False for them, save "
        "raises ForeignStepError); latest_step() is 20. "
        f"`modelshard steps {root}` lists them."
    ]
    assert said[0].filename == __file__  # points at the user's line
    with mngr:
        assert mngr.all_steps() == [10, 15, 20]
        assert not mngr.should_save(31) and not mngr.should_save(32)
        with pytest.raises(ms.ForeignStepError) as e:
            mngr.restore(31)
        assert str(e.value) == (
            f"cannot restore step 31: {root / '31.orbax-checkpoint-tmp'} is an unfinished "
            "save by another tool (Orbax); this CheckpointManager restores its own complete "
            "steps and Orbax's complete steps that hold a state item (`state`, or a single "
            "tree item); here: 10, 15, 20."
        )
    empty = root.parent / "empty"
    _unfinished(root / "10", empty / "31.orbax-checkpoint-tmp")
    with pytest.warns(ms.ForeignStepsWarning), ms.CheckpointManager(empty) as mngr:
        with pytest.raises(ms.CheckpointError) as e:
            mngr.restore()
        assert str(e.value) == (
            f"no checkpoint in {empty}: no step was saved yet (steps 31 there were written "
            "by another tool, and are not steps this CheckpointManager restores)."
        )
    with warnings.catch_warnings():  # a root of its own steps alone: no warning
        warnings.simplefilter("error")
        ms.CheckpointManager(root.parent / "mine", handle_signals=False).close()


@pytest.mark.parametrize("force", [False, True])
def test_saving_over_an_orbax_step_is_refused_and_leaves_it_byte_identical(root, force):
    before = orbax_snapshot(root)
    with opened(root) as mngr:
        assert not mngr.should_save(20)
        assert mngr.should_save(21)
        with pytest.raises(ms.ForeignStepError) as e:
            mngr.save(20, {"w": jnp.ones(4)}, force=force)
        assert isinstance(e.value, ValueError) and e.value.step == 20
        assert str(e.value).splitlines() == [
            f"cannot save step 20: {root / '20'} is a complete step written by another tool "
            "(Orbax), and this CheckpointManager never removes or replaces what it did not "
            "write.",
            f"Save under another step number, move {root / '20'} out of {root}, or, to "
            "replace it, remove it by name with delete(20) first.",
        ]
        assert mngr.all_steps() == [10, 15, 20]
    assert orbax_snapshot(root) == before
    assert len(before) > 30 and sorted(os.listdir(root)) == [
        ".modelshard-lock",
        *map(str, ORBAX_STEPS),
    ]
    assert orbax_restores(root, 20) == 20.0


def test_a_loop_keeping_two_steps_never_deletes_the_orbax_steps(root):
    before = orbax_snapshot(root)
    with opened(root, max_to_keep=2) as mngr:
        saved = []
        for step in range(5, 26):
            if mngr.should_save(step):
                assert mngr.save(step, {"w": jnp.full((4,), float(step))})
                saved.append(step)
        assert mngr.all_steps() == [10, 15, 20, 24, 25]
        assert float(mngr.restore()["w"][0]) == 25.0
    assert saved == [s for s in range(5, 26) if s not in ORBAX_STEPS]
    assert orbax_snapshot(root) == before
    assert sorted(os.listdir(root)) == [
        ".modelshard-lock",
        ".modelshard-rotated",
        "10",
        "15",
        "20",
        "24",
        "25",
    ]
    assert [orbax_restores(root, s) for s in ORBAX_STEPS] == [10.0, 15.0, 20.0]


def test_delete_by_name_replaces_an_orbax_step(root):
    with opened(root) as mngr:
        mngr.delete(20)
        assert mngr.should_save(20)
        assert mngr.all_steps() == [10, 15]
        assert mngr.save(20, {"w": jnp.full((4,), 7.0)})
        assert mngr.all_steps() == [10, 15, 20]
        assert float(mngr.restore(20)["w"][0]) == 7.0
        assert mngr.items(20) == {}  # its own step now: Orbax's items went with Orbax's
        with pytest.raises(ms.CheckpointError) as e:
            mngr.delete(30)
        assert str(e.value) == f"no step 30 in {root}: nothing there carries that number."
        mngr.delete(20)  # one of its own, outside its keep rules
        assert mngr.all_steps() == [10, 15]
    assert sorted(n for n in os.listdir(root) if n[0].isdigit()) == ["10", "15"]
    assert [orbax_restores(root, s) for s in (10, 15)] == [10.0, 15.0]


def _unfinished(step_dir: Path, into: Path) -> None:
    """``step_dir`` as it was mid-save: renamed to Orbax's staging name ``into``, each item
    under its temporary name, ``_CHECKPOINT_METADATA`` as Orbax writes it when a save starts
    (no custom metadata, no commit yet)."""
    shutil.copytree(step_dir, into)
    for item in [p for p in into.iterdir() if p.is_dir()]:
        item.rename(into / f"{item.name}.orbax-checkpoint-tmp-1234")
    (into / "commit_success.txt").unlink(missing_ok=True)
    (into / "_CHECKPOINT_METADATA").write_text('{"init_timestamp_nsecs": 1796000000000000000}')


def test_interrupted_saves_are_told_apart_ours_cleaned_orbaxs_kept(root):
    with opened(root) as mngr:
        mngr.save(1, {"w": jnp.ones(4)})
        # an interrupted save of ours (step 30), and one of Orbax's (step 31)
        _unfinished(root / "1", root / "30.orbax-checkpoint-tmp")
        _unfinished(root / "10", root / "31.orbax-checkpoint-tmp")
        # an empty folder and a bare start of a save hold nothing to lose
        (root / "32").mkdir()
        (root / "33.orbax-checkpoint-tmp").mkdir()
        (root / "33.orbax-checkpoint-tmp" / "_CHECKPOINT_METADATA").write_text(
            '{"init_timestamp_nsecs": 1796000000000000000}'
        )
        # a save of ours killed while writing its first file, and one killed before its
        # items: its metadata names our record item (a SIGKILL test met both)
        (root / "34.orbax-checkpoint-tmp").mkdir()
        (root / "34.orbax-checkpoint-tmp" / "_CHECKPOINT_METADATA").write_text("")
        (root / "35.orbax-checkpoint-tmp").mkdir()
        (root / "35.orbax-checkpoint-tmp" / "_CHECKPOINT_METADATA").write_text(
            '{"item_handlers": {"state": "x", "modelshard": "y"}, "init_timestamp_nsecs": 1}'
        )
        (root / "36.orbax-checkpoint-tmp" / "items.orbax-checkpoint-tmp").mkdir(parents=True)
        (root / "36.orbax-checkpoint-tmp" / "_CHECKPOINT_METADATA").write_text(
            '{"item_handlers": null, "init_timestamp_nsecs": 1, "commit_timestamp_nsecs": null}'
        )
        listed = {e.path.name: (e.status, e.owner, e.complete, e.why) for e in list_steps(root)}
        assert listed == {
            "1": ("complete", "modelshard", True, ""),
            "10": ("complete", "orbax", True, "written by another tool (Orbax)"),
            "15": ("complete", "orbax", True, "written by another tool (Orbax)"),
            "20": ("complete", "orbax", True, "written by another tool (Orbax)"),
            "30.orbax-checkpoint-tmp": (
                "leftover",
                "modelshard",
                False,
                "staging folder of an interrupted save",
            ),
            "31.orbax-checkpoint-tmp": (
                "foreign",
                "orbax",
                False,
                "written by another tool (Orbax)",
            ),
            "32": ("leftover", None, False, "interrupted save"),
            "33.orbax-checkpoint-tmp": (
                "leftover",
                None,
                False,
                "staging folder of an interrupted save",
            ),
            "34.orbax-checkpoint-tmp": (
                "leftover",
                None,
                False,
                "staging folder of an interrupted save",
            ),
            "35.orbax-checkpoint-tmp": (
                "leftover",
                "modelshard",
                False,
                "staging folder of an interrupted save",
            ),
            "36.orbax-checkpoint-tmp": (
                "leftover",
                "modelshard",
                False,
                "staging folder of an interrupted save",
            ),
        }
        kept = snapshot(root / "31.orbax-checkpoint-tmp")
        for step in (30, 32, 33, 34, 35, 36):
            assert mngr.save(step, {"w": jnp.full((4,), float(step))})
        with pytest.raises(ms.ForeignStepError) as e:
            mngr.save(31, {"w": jnp.ones(4)})
        assert str(e.value).splitlines()[0] == (
            f"cannot save step 31: {root / '31.orbax-checkpoint-tmp'} is an unfinished save by "
            "another tool (Orbax), and this CheckpointManager never removes or replaces what "
            "it did not write."
        )
        assert mngr.all_steps() == [1, 10, 15, 20, 30, 32, 33, 34, 35, 36]
    assert snapshot(root / "31.orbax-checkpoint-tmp") == kept
    assert sorted(n for n in os.listdir(root) if n[0].isdigit()) == [
        "1",
        "10",
        "15",
        "20",
        "30",
        "31.orbax-checkpoint-tmp",
        "32",
        "33",
        "34",
        "35",
        "36",
    ]


def test_a_step_of_ours_whose_record_item_was_removed_is_not_taken_for_orbaxs(tmp_path):
    """A committed step of ours keeps its marker: damaged, it is still ours (a leftover
    the next save of its number replaces), never another tool's."""
    with ms.CheckpointManager(tmp_path, async_save=False, handle_signals=False) as mngr:
        mngr.save(3, {"w": jnp.ones(4)})
        shutil.rmtree(tmp_path / "3" / "modelshard")
    [entry] = list_steps(tmp_path)
    assert (entry.status, entry.owner) == ("leftover", "modelshard")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing of another tool's here
        mngr = ms.CheckpointManager(tmp_path, async_save=False, handle_signals=False)
    with mngr:
        assert mngr.should_save(3)
        assert mngr.save(3, {"w": jnp.full((4,), 2.0)})
        np.testing.assert_array_equal(mngr.restore(3)["w"], np.full((4,), 2.0))


@pytest.mark.multiprocess
@pytest.mark.skipif(sys.platform != "linux", reason="multi-process tests run on Linux")
def test_two_processes_agree_on_the_other_tools_steps(root, tmp_path):
    """Process 0 lists and decides, the others follow: on both processes Orbax's steps are
    listed and restored, the loop skips 10, 15 and 20, ``save(20)`` raises the same
    ``ForeignStepError``, and ``delete(20)`` then ``save(20)`` replace it; nothing warns."""
    script = Path(__file__).parent / "manager_scripts" / "foreign_steps.py"
    before = orbax_snapshot(root)
    cmd = launch_argv(sys.executable, str(script), str(root), str(tmp_path), timeout=150)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    results = [json.loads((tmp_path / f"result_{i}.json").read_text()) for i in range(2)]
    refused = {
        "type": "ForeignStepError",
        "message": (
            f"cannot save step 20: {root / '20'} is a complete step written by another tool "
            "(Orbax), and this CheckpointManager never removes or replaces what it did not "
            f"write.\nSave under another step number, move {root / '20'} out of {root}, or, "
            "to replace it, remove it by name with delete(20) first."
        ),
        "step": 20,
    }
    for me, r in enumerate(results):
        assert r == {
            "warned": [],
            "orbax 20": 20.0,
            "items 20": {"metadata": {"step": 20}},
            "saved": [s for s in range(5, 26) if s not in ORBAX_STEPS],
            "raised": refused,
            "steps": [10, 15, 20, 24, 25],
            "steps after": [10, 15, 20, 24, 25],
            "restored 20": 99.0,
        }, (me, r)
    after = orbax_snapshot(root)
    assert {k: v for k, v in after.items() if not k.startswith("20")} == {
        k: v for k, v in before.items() if not k.startswith("20")
    }
    assert [orbax_restores(root, s) for s in (10, 15)] == [10.0, 15.0]


def _s3_tree(url: str) -> dict[str, bytes]:
    """Every object under ``url`` and its bytes, read without modelshard."""
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    base = url.removeprefix("s3://")
    return {p[len(base) + 1 :]: fs.cat_file(p) for p in fs.find(base)}


def test_on_object_storage_orbax_steps_are_told_by_their_commit_file(
    tmp_path, s3_root, orbax_steps
):
    """On ``s3://`` Orbax's step is complete by its commit file: steps 10, 15, 20 as Orbax
    committed them and 30 as Orbax left it mid-save (no commit file, the metadata it
    starts with); the manager restores the first, refuses both kinds and removes neither."""
    import s3fs

    local = orbax_steps
    shutil.copytree(local / "10", tmp_path / "30")
    for done in (tmp_path / "30").rglob("commit_success.txt"):
        done.unlink()
    (tmp_path / "30" / "_CHECKPOINT_METADATA").write_text('{"init_timestamp_nsecs": 1}')
    fs = s3fs.S3FileSystem()
    base = s3_root.removeprefix("s3://")
    for s in ORBAX_STEPS:
        fs.put(str(local / str(s)), f"{base}/{s}", recursive=True)
    fs.put(str(tmp_path / "30"), f"{base}/30", recursive=True)
    before = _s3_tree(s3_root)
    with pytest.warns(ms.ForeignStepsWarning) as said:
        mngr = ms.CheckpointManager(s3_root, async_save=False, handle_signals=False)
    assert "does not restore: 30 (unfinished, Orbax). It never" in str(said[0].message)
    with mngr:
        assert [mngr.should_save(s) for s in (20, 25, 30)] == [False, True, False]
        for step, what in ((20, "is a complete step"), (30, "is an unfinished save by")):
            with pytest.raises(ms.ForeignStepError) as e:
                mngr.save(step, {"w": jnp.ones(4)}, force=True)
            assert str(e.value).startswith(f"cannot save step {step}: {s3_root}/{step} {what}")
        assert mngr.save(25, {"w": jnp.ones(4)})
        assert mngr.all_steps() == [10, 15, 20, 25]
        assert float(mngr.restore(20)["w"][0]) == 20.0
        assert mngr.items(20) == {"metadata": {"step": 20}}
    listed = [(e.step, e.status, e.owner, e.complete) for e in list_steps(s3_root)]
    assert listed == [
        *[(s, "complete", "orbax", True) for s in ORBAX_STEPS],
        (25, "complete", "modelshard", True),
        (30, "foreign", "orbax", False),
    ]
    after = _s3_tree(s3_root)
    assert {k: v for k, v in after.items() if not k.startswith("25/")} == before


def test_orbaxs_single_item_steps_metrics_and_custom_metadata_are_read(tmp_path):
    """A manager saving one item (``args.StandardSave``: its ``default`` item), tracking
    metrics (``best_fn``) and given ``custom_metadata``: restored, metrics and metadata as
    Orbax saved them, no items; ``best_step`` ranks them with the manager's own."""
    import orbax.checkpoint as ocp

    root = tmp_path / "run"
    options = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min")
    with ocp.CheckpointManager(root, options=options) as orbax_mngr:
        for s in (1, 2):
            orbax_mngr.save(
                s,
                args=ocp.args.StandardSave({"w": jnp.full((4,), float(s))}),
                metrics={"loss": 1.0 / s},
                custom_metadata={"run": "a", "step": s},
            )
    assert sorted(os.listdir(root / "2")) == [
        "_CHECKPOINT_METADATA",
        "commit_success.txt",
        "default",
        "metrics",
    ]
    with opened(root, keep_best=1, best_fn=lambda m: -m["loss"]) as mngr:
        assert mngr.all_steps() == [1, 2]
        assert float(mngr.restore()["w"][0]) == 2.0
        assert (mngr.items(2), mngr.metadata(2), mngr.metrics(2)) == (
            {},
            {"run": "a", "step": 2},
            {"loss": 0.5},
        )
        mngr.save(3, {"w": jnp.ones(4)}, metrics={"loss": 0.9})
        assert mngr.best_step() == 2
        assert mngr.all_steps() == [1, 2, 3]  # keep_best=1 rotates its own steps only
    assert ms.read_metadata(root / "2") == {"run": "a", "step": 2}


def test_orbax_steps_it_cannot_restore_or_read_are_said_so(root):
    """Two tree items and no ``state``: listed as Orbax's, not restored (which tree would
    be the state?). A JSON item whose file is gone: ``items`` says the step is damaged."""
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(root) as orbax_mngr:
        orbax_mngr.save(
            30,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave({"w": jnp.ones(4)}),
                opt=ocp.args.StandardSave({"mu": jnp.ones(4)}),
            ),
        )
    (root / "20" / "metadata" / "metadata").unlink()
    with pytest.warns(ms.ForeignStepsWarning) as said:
        mngr = ms.CheckpointManager(root, async_save=False, handle_signals=False)
    assert "does not restore: 30 (complete, Orbax). It never" in str(said[0].message)
    with mngr:
        assert mngr.all_steps() == [10, 15, 20]
        with pytest.raises(ms.ForeignStepError) as e:
            mngr.restore(30)
        assert str(e.value).startswith(
            f"cannot restore step 30: {root / '30'} is a complete step written by another "
            "tool (Orbax); this CheckpointManager restores its own complete steps and Orbax's "
            "complete steps that hold a state item"
        )
        with pytest.raises(ms.CheckpointError) as e:
            mngr.items(20)
        assert str(e.value) == (
            f"{root / '20' / 'metadata'} is missing its JSON file: Orbax's step 20 was saved "
            "with the JSON item 'metadata', so it is damaged and that item cannot be read. Its "
            "arrays still restore; restore a complete copy of the step to get it back."
        )
        assert float(mngr.restore(20)["w"][0]) == 20.0
    opt = ms.restore(root / "30" / "opt")  # another tree item, read on its own
    assert float(opt["mu"][0]) == 1.0
