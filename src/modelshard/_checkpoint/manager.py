"""``CheckpointManager``: numbered, rotating, optionally asynchronous checkpoints over Orbax's."""

from __future__ import annotations

import numbers
import os
import shutil
from pathlib import Path
from typing import Any

from .._errors import CheckpointError
from .read import restore
from .storage import MARKER, RECORD_FILE, RECORD_ITEM, STATE_ITEM
from .write import prepare

__all__ = ["CheckpointManager"]

# Orbax deletes a rotated-out step file by file, so a SIGKILL part-way left a half-deleted
# step that all_steps() still listed. Orbax renames rotated steps in here instead (one
# atomic rename) and the manager removes them whenever it is used.
ROTATED = ".modelshard-rotated"
# Held (flock) by the one manager that saves into a directory: two writers would each
# believe they wrote a step that only one of them did.
LOCK = ".modelshard-lock"


class CheckpointManager:
    """Save a training state every few steps, keep the last few, restore onto any mesh.

    A thin layer over ``orbax.checkpoint.CheckpointManager``. Each step directory holds
    two Orbax items: ``state`` (the sharded leaves, a plain Orbax PyTree checkpoint) and
    ``modelshard`` (the JSON record with paths, specs and checksums). Orbax writes a step
    into a temporary directory and renames it when complete, so an interrupted save never
    becomes :meth:`latest_step` and never touches earlier steps.

    Args:
        directory: the root directory (made absolute; created if missing).
        max_to_keep: keep at most this many steps (oldest deleted first); None keeps all.
        save_interval_steps: :meth:`save` only writes steps that are multiples of this.
        async_save: return from :meth:`save` once the arrays are copied off device and
            write in the background; :meth:`wait_until_finished` blocks until done.

    Example:
        >>> import tempfile, jax.numpy as jnp
        >>> import modelshard as ms
        >>> with ms.CheckpointManager(tempfile.mkdtemp(), max_to_keep=2) as mngr:
        ...     for step in range(3):
        ...         _ = mngr.save(step, {"w": jnp.full((4,), step)})
        ...     mngr.wait_until_finished()
        ...     mngr.all_steps(), int(mngr.restore()["w"][0])
        ([1, 2], 2)
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int | None = None,
        save_interval_steps: int = 1,
        async_save: bool = True,
    ):
        import orbax.checkpoint as ocp

        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise CheckpointError(
                f"max_to_keep must be a positive int or None, got {max_to_keep!r}."
            )
        if not isinstance(save_interval_steps, int) or save_interval_steps < 1:
            raise CheckpointError(
                f"save_interval_steps must be a positive int, got {save_interval_steps!r}."
            )
        self.directory = Path(directory).expanduser().absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_interval_steps=save_interval_steps,
            enable_async_checkpointing=async_save,
            create=True,
            todelete_subdir=ROTATED,
        )
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                STATE_ITEM: ocp.StandardCheckpointHandler(),
                RECORD_ITEM: ocp.JsonCheckpointHandler(filename=RECORD_FILE),
            },
        )
        self._lock_fd: int | None = None
        self._writer = False
        self._purge_rotated()

    def _purge_rotated(self) -> None:
        """Delete the steps Orbax rotated out (renamed into ``ROTATED``, never listed)."""
        import jax

        rotated = self.directory / ROTATED
        if jax.process_index() == 0 and rotated.is_dir():
            for step_dir in rotated.iterdir():
                shutil.rmtree(step_dir, ignore_errors=True)

    def _become_writer(self) -> None:
        """Hold ``LOCK`` until :meth:`close` (the OS drops it if the process dies)."""
        import fcntl

        import jax

        if self._lock_fd is not None or jax.process_index() != 0:
            self._writer = True
            return
        fd = os.open(self.directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CheckpointError(
                f"another CheckpointManager is saving to {self.directory} (it holds "
                f"{self.directory / LOCK}); two writers would overwrite each other's steps. "
                "Save from one manager, or give each its own directory."
            ) from None
        self._lock_fd = fd
        self._writer = True

    def save(self, step: int, state: Any, *, force: bool = False, metadata: Any = None) -> bool:
        """Save ``state`` as ``step`` if the save interval says so (or ``force``).

        Returns:
            Whether a save was started.

        Raises:
            CheckpointError: the step already exists, or the state cannot be saved.
        """
        import orbax.checkpoint as ocp

        # Orbax writes "-1", "True" or "1.5" step directories it then never lists
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise CheckpointError(f"step must be a non-negative int, got {step!r}.")
        step = int(step)
        self._become_writer()
        if step in self.all_steps():
            raise CheckpointError(
                f"step {step} already exists in {self.directory}; steps are never overwritten."
            )
        if not force and not self._manager.should_save(step):
            return False
        self._purge_rotated()
        tree, record = prepare(state, metadata)
        args = ocp.args.Composite(
            **{
                STATE_ITEM: ocp.args.StandardSave(tree),
                RECORD_ITEM: ocp.args.JsonSave(record.to_json()),
            }
        )
        return bool(self._manager.save(step, args=args, force=force, custom_metadata=MARKER))

    def step_directory(self, step: int) -> Path:
        """The directory of ``step`` (which :func:`modelshard.restore` also reads)."""
        return self.directory / str(step)

    def restore(
        self,
        step: int | None = None,
        *,
        like: Any = None,
        specs: Any = None,
        mesh: Any = None,
        dtype: Any = None,
        partial: bool = False,
        verify: bool = True,
    ) -> Any:
        """Restore ``step`` (default: the latest) exactly as :func:`modelshard.restore` does.

        Raises:
            CheckpointError: there is no such step (the message lists the steps there are).
        """
        self.wait_until_finished()
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointError(f"no checkpoint in {self.directory}: no step was saved yet.")
            step = steps[-1]
        elif step not in steps:
            raise CheckpointError(
                f"no step {step} in {self.directory}; steps there: "
                f"{', '.join(map(str, steps)) or 'none'}."
            )
        path = self.step_directory(step)
        if path.is_symlink():
            raise CheckpointError(
                f"{path} is a symbolic link to {path.resolve()}; steps are directories of "
                f"{self.directory}, refusing to follow it."
            )
        return restore(
            path,
            like=like,
            specs=specs,
            mesh=mesh,
            dtype=dtype,
            partial=partial,
            verify=verify,
        )

    def latest_step(self) -> int | None:
        """The newest complete step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """Every complete step, ascending."""
        if not self._writer:  # Orbax caches steps: another manager may have saved since
            for attempt in range(5):
                try:
                    self._manager.reload()
                    break
                except OSError as e:  # a step was rotated away while Orbax listed it
                    if attempt == 4:
                        raise CheckpointError(
                            f"cannot list the steps of {self.directory}: they kept changing "
                            f"while being read ({type(e).__name__}: {e})."
                        ) from e
        return sorted(self._manager.all_steps())

    def wait_until_finished(self) -> None:
        """Block until background saves are written."""
        self._manager.wait_until_finished()
        self._purge_rotated()

    def close(self) -> None:
        """Wait for pending saves and release Orbax's resources."""
        self._manager.close()
        self._purge_rotated()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({str(self.directory)!r}, steps={self.all_steps()})"
