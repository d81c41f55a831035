"""A manager's step directories as untrusted input (``_checkpoint/manager.py``): names that are
not steps, steps linked outside, rotation, two managers on one directory."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import modelshard as ms


@pytest.mark.parametrize("step", [-1, True, 1.5, "3", "../x", None])
def test_manager_refuses_steps_that_are_not_non_negative_ints(tmp_path, step):
    with ms.CheckpointManager(tmp_path, async_save=False) as mngr:
        with pytest.raises(ms.CheckpointError) as e:
            mngr.save(step, {"w": jnp.ones(2)})
        assert str(e.value) == f"step must be a non-negative int, got {step!r}."
        assert mngr.save(np.int64(2), {"w": jnp.ones(2)})
        assert mngr.all_steps() == [2]
    assert sorted(os.listdir(tmp_path)) == [".modelshard-lock", "2"]


def test_manager_does_not_follow_a_step_linked_outside(tmp_path):

    with ms.CheckpointManager(tmp_path / "m", async_save=False) as mngr:
        mngr.save(1, {"w": jnp.ones(2)})
        shutil.move(tmp_path / "m" / "1", tmp_path / "elsewhere")
        (tmp_path / "m" / "1").symlink_to(tmp_path / "elsewhere")
        with pytest.raises(ms.CheckpointError) as e:
            mngr.restore(1)
    assert str(e.value) == (
        f"{tmp_path / 'm' / '1'} is a symbolic link to {tmp_path / 'elsewhere'}; steps are "
        f"directories of {tmp_path / 'm'}, refusing to follow it."
    )


def test_rotation_leaves_nothing_half_deleted(tmp_path):
    with ms.CheckpointManager(tmp_path, max_to_keep=1, async_save=False) as mngr:
        for step in range(4):
            mngr.save(step, {"w": jnp.full(3, step)})
        # a step a killed purge left half-deleted in the rotation area is never listed
        (tmp_path / ".modelshard-rotated" / "99" / "state").mkdir(parents=True)
        assert mngr.all_steps() == [3]
    assert sorted(os.listdir(tmp_path)) == [".modelshard-lock", ".modelshard-rotated", "3"]
    assert os.listdir(tmp_path / ".modelshard-rotated") == []  # purged on close


def _writer_message(directory: Path) -> str:
    return (
        f"another CheckpointManager is saving to {directory} (it holds "
        f"{directory / '.modelshard-lock'}); two writers would overwrite each other's steps. "
        "Save from one manager, or give each its own directory."
    )


def test_two_managers_on_one_directory_serialise_or_fail_clearly(tmp_path):
    first = ms.CheckpointManager(tmp_path, async_save=False)
    second = ms.CheckpointManager(tmp_path, async_save=False)
    assert first.save(1, {"w": jnp.full(3, 1.0)})
    with pytest.raises(ms.CheckpointError) as e:
        second.save(2, {"w": jnp.full(3, 2.0)})
    assert str(e.value) == _writer_message(tmp_path)
    assert second.restore(1)["w"][0] == 1.0  # reading needs no lock
    first.close()
    assert second.save(2, {"w": jnp.full(3, 2.0)})  # the first one is gone: serialised
    with pytest.raises(ms.CheckpointError, match="another CheckpointManager is saving"):
        first.save(3, {"w": jnp.full(3, 3.0)})  # even a closed manager cannot write now
    second.close()
    with ms.CheckpointManager(tmp_path) as third:
        assert third.all_steps() == [1, 2]
        assert third.restore(2)["w"][0] == 2.0
