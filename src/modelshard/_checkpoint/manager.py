"""``CheckpointManager``: numbered, rotating, optionally asynchronous checkpoints. Under
several processes process 0 makes every decision that depends on storage and broadcasts it,
and every process enters every wait in one order."""

from __future__ import annotations

import numbers
import os
import signal
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax

from .._base import CheckpointError, DistributedError, ForeignStepError
from .._runtime import barrier, broadcast, gather
from . import guard
from .items import encode_items, step_items
from .listing import (
    Foreign,
    adopted_steps,
    complete_steps,
    foreign_steps,
    is_complete_step,
    refusal,
    restorable_steps,
    warn_foreign,
)
from .policy import KeepPolicy
from .removal import delete_step, purge_rotated, remove_numbered, remove_partial
from .restoring import restore
from .shards import held_sums, take
from .step_writer import json_or_error, json_parts, write_step
from .storage import (
    LOCK,
    METRICS_FILE,
    METRICS_ITEM,
    RECORD_FILE,
    RECORD_ITEM,
    read_json,
    step_metadata,
)
from .urls import check_bucket, forget_listings, is_remote, location, reaching
from .write import check_compression, prepare

# every wait of a background step is named so: never paired with the main thread's waits
_BACKGROUND = "modelshard:manager:step"


class CheckpointManager:
    """Save a training state every few steps, keep the ones that matter, restore anywhere.

    Each step directory holds the sharded state (a plain Orbax PyTree checkpoint that
    [`modelshard.restore`][modelshard.restore] reads), modelshard's record, and optionally named
    ``items`` and ``metrics``, all written as one step in Orbax's layout: a step appears
    complete or not at all. Pending asynchronous saves are finished when the program ends, when an
    exception leaves a ``with`` block, and on SIGTERM/SIGINT; a save that cannot be
    finished is reported with its step and the exit status is non-zero.

    Rotation keeps the union of the rules given (none given: keep every step), and
    always the newest complete step of its own.

    What another tool wrote into the root is never removed or replaced. Orbax's own
    complete steps (its manager names steps as this one does) are listed and restored but
    never rotated; other entries are neither, and opening the manager warns naming them
    (``ForeignStepsWarning``). ``save`` refuses their numbers (``ForeignStepError``);
    ``delete(step)`` removes one by name.

    Example:
        >>> import tempfile, jax.numpy as jnp
        >>> import modelshard as ms
        >>> with ms.CheckpointManager(tempfile.mkdtemp(), max_to_keep=2) as mngr:
        ...     for step in range(3):
        ...         _ = mngr.save(step, {"w": jnp.full((4,), step)}, items={"data": {"pos": step}})
        ...     mngr.wait_until_finished()
        ...     mngr.all_steps(), int(mngr.restore()["w"][0]), mngr.items()["data"]
        ([1, 2], 2, {'pos': 2})
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int | None = None,
        keep_period: int | None = None,
        keep_best: int | None = None,
        best_fn: Callable[[Mapping[str, Any]], float] | None = None,
        best_mode: str = "max",
        keep_steps: Iterable[int] | None = None,
        save_interval_steps: int = 1,
        async_save: bool = True,
        handle_signals: bool = True,
        compression: str | None = None,
    ):
        """Open (creating it if needed) the manager's root ``directory``.

        Args:
            directory: the root: a local path (made absolute, created if missing), or a
                ``gs://`` / ``s3://`` URL.
            max_to_keep: keep the newest N steps.
            keep_period: also keep every step that is a multiple of K.
            keep_best: also keep the N best steps by ``best_fn(metrics)``; needs ``best_fn``.
            best_fn: metrics dict (as passed to ``save``) -> number.
            best_mode: ``"max"`` or ``"min"``: which end of ``best_fn`` is best.
            keep_steps: steps never deleted.
            save_interval_steps: ``should_save`` and ``save`` accept the steps that
                are multiples of this (step 0 included, no other first step); ``force=True``
                saves any step.
            async_save: return from ``save`` once the arrays are copied off device and
                write in the background; ``wait_until_finished`` blocks until done.
            handle_signals: install the SIGTERM/SIGINT handler that turns a signal into a
                stop request (see ``should_save``) or, if the loop never polls,
                finishes pending saves before the process dies of the signal.
            compression: how each step's arrays are stored, as in
                [`modelshard.save`][modelshard.save]: None (default) each chunk's raw
                bytes, ``"zstd"`` compressed as Orbax does by default. Restoring reads
                either, so steps saved with one restore under the other.

        Raises:
            CheckpointError: an option is out of range (``save_interval_steps``,
                ``compression``, the keep rules), or the local ``directory`` cannot be
                created.

        Warns:
            ForeignStepsWarning: the root holds entries another tool wrote that are not
                Orbax's complete steps (an unfinished save): named, on process 0, once.
        """
        if (
            isinstance(save_interval_steps, bool)
            or not isinstance(save_interval_steps, int)
            or save_interval_steps < 1
        ):
            raise CheckpointError(
                f"save_interval_steps must be a positive int, got {save_interval_steps!r}."
            )
        self.policy = KeepPolicy(
            max_to_keep=max_to_keep,
            keep_period=keep_period,
            keep_best=keep_best,
            best_fn=best_fn,
            best_mode=best_mode,
            keep_steps=frozenset(keep_steps or ()),
        )
        self._compress = check_compression(compression)
        self.compression = compression
        self.save_interval_steps = save_interval_steps
        self.async_save = async_save
        self.directory = location(directory)
        self._remote = is_remote(self.directory)
        if self._remote:
            check_bucket(self.directory)  # object stores have no folders to create
        elif self._primary():
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise CheckpointError(
                    f"cannot create or reach {self.directory}: {type(e).__name__}: {e}"
                ) from e
        # async steps, one at a time (its thread starts with the first)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="modelshard-manager")
        self._job: Future[None] | None = None
        self._pending: int | None = None
        self._polled = False
        self._last_saved: int | None = None
        self._lock_fd: int | None = None
        self._writer_agreed = False
        self._metrics: dict[int, Any] = {}
        self._closed = False
        self._foreign: list[Foreign] | None = None  # as process 0 last listed them
        self._purge_rotated()
        if self._primary():
            warn_foreign(self.directory, stacklevel=3)
        guard.watch(self, handle_signals=handle_signals)

    # -- what the exit guard needs ---------------------------------------------------------

    def pending_step(self) -> int | None:
        """The step being written in the background, or None."""
        return self._pending

    def unfinished_step(self) -> int | None:
        """The pending step unless it is complete on storage by now."""
        step = self._pending
        if step is None:
            return None
        try:
            return None if is_complete_step(self.step_directory(step)) else step
        except Exception:  # at interpreter shutdown anything may fail: count it lost
            return step

    def has_polled(self) -> bool:
        """Whether the training loop asks ``should_save`` (it then handles stops)."""
        return self._polled

    @staticmethod
    def _primary() -> bool:
        return jax.process_index() == 0

    def _agreed_steps(self) -> list[int]:
        """The complete steps as process 0 lists them, on every process (a collective), and
        another tool's, kept for ``should_save``."""
        listing = None
        if self._primary():
            steps = complete_steps(self.directory)
            others = foreign_steps(self.directory, steps)
            steps = sorted({*steps, *adopted_steps(others)})  # Orbax's complete steps too
            listing = {"steps": steps, "foreign": [f.to_json() for f in others]}
        agreed = broadcast(listing, "modelshard:manager:steps")
        forget_listings(self.directory)  # every process reads those steps afresh
        self._foreign = [Foreign.from_json(f) for f in agreed["foreign"]]
        return [int(s) for s in agreed["steps"]]

    def _adopted(self, step: int) -> Foreign | None:
        """Orbax's step ``step`` the manager restores, as process 0 last listed it, or None."""
        return next((f for f in self._foreign or () if f.step == step and f.restorable), None)

    def _purge_rotated(self) -> None:
        """Process 0 deletes the steps rotation moved aside (``removal.purge_rotated``)."""
        if self._primary():
            purge_rotated(self.directory)

    def _writing(self, step: Any) -> int:
        """``step`` as an int, checked, once this manager is the root's writer and open."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise CheckpointError(f"step must be a non-negative int, got {step!r}.")
        self._become_writer()  # first: another writer is the error to report
        if self._closed:
            self._release_lock()
            raise CheckpointError(f"this CheckpointManager of {self.directory} is closed.")
        return int(step)

    def _become_writer(self) -> None:
        """Process 0 holds ``LOCK`` until ``close`` (dropped if it dies) and tells the others."""
        if self._writer_agreed:
            return
        refused = None
        if self._lock_fd is None and not self._remote and self._primary():
            import fcntl

            fd = os.open(self.directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._lock_fd = fd
            except BlockingIOError:
                os.close(fd)
                refused = (
                    f"another CheckpointManager is saving to {self.directory} (it holds "
                    f"{self.directory / LOCK}); two writers would overwrite each other's "
                    "steps. Save from one manager, or give each its own directory."
                )
        refused = broadcast(refused, "modelshard:manager:writer")
        if refused is not None:
            raise CheckpointError(refused)
        self._writer_agreed = True

    def _release_lock(self) -> None:
        self._writer_agreed = False
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _rotate(self) -> None:
        """Process 0 applies the keep policy to what it lists; every process waits for it."""
        if self._primary() and not self.policy.keeps_everything:
            steps = complete_steps(self.directory)
            if len(steps) > 1:
                metrics = {s: m for s in steps if (m := self.metrics(s)) is not None}
                kept = self.policy.keep(steps, metrics)
                for s in steps:
                    if s not in kept:
                        delete_step(self.directory, s)
                        self._metrics.pop(s, None)
        barrier("modelshard:manager:rotated")

    def _save_verdict(self, step: int) -> None:
        """Process 0 decides whether ``step`` may be written (leftovers removed) and tells the
        others: every process raises the same error, or none does."""
        error: Exception | None = None
        listing = None
        if self._primary():
            try:
                steps = complete_steps(self.directory)
                if step in steps:
                    raise CheckpointError(
                        f"step {step} already exists in {self.directory}; steps are never "
                        "overwritten."
                    )
                others = foreign_steps(self.directory, steps)
                listing = [f.to_json() for f in others]
                held = [f for f in others if f.step == step]
                if held:
                    raise ForeignStepError(refusal(step, self.directory, held), step=step)
                with reaching(self.directory):
                    remove_partial(self.directory, step)
            except CheckpointError as e:
                error = e
            except Exception as e:  # told to every process, which all raise it
                error = CheckpointError(
                    f"cannot save step {step} to {self.directory}: {type(e).__name__}: {e}"
                )
                error.__cause__ = e
        said = None if error is None else str(error)
        verdict = broadcast(
            {"refused": said, "foreign": isinstance(error, ForeignStepError), "listing": listing},
            "modelshard:manager:save",
        )
        if verdict["listing"] is not None:
            self._foreign = [Foreign.from_json(f) for f in verdict["listing"]]
        # every process writes into the step afresh: ask storage, not a cache
        forget_listings(self.directory)
        if error is not None:
            raise error  # process 0: the error itself, with its cause
        if verdict["foreign"]:
            raise ForeignStepError(verdict["refused"], step=step)
        if verdict["refused"] is not None:
            raise CheckpointError(verdict["refused"])

    def reached_preemption(self, step: int) -> bool:
        """Whether the process was asked to stop: a SIGTERM/SIGINT on this host, or, under
        ``jax.distributed``, JAX's preemption sync point at ``step`` (every process gets
        True at the same step; call it at every step on every process)."""
        self._polled = True
        if guard.stop_signal() is not None:
            return True
        if jax.process_count() == 1:
            return False
        from jax.experimental import multihost_utils

        try:
            reached = bool(multihost_utils.reached_preemption_sync_point(step))
        except RuntimeError:  # no preemption service in this process group
            return False
        if reached:  # every process saves this step and exits 128 + SIGTERM
            guard.request_stop(signal.SIGTERM)
        return reached

    def should_save(self, step: int) -> bool:
        """Whether ``save`` would write ``step``: a multiple of ``save_interval_steps``,
        or any step once the process was asked to stop (see ``reached_preemption``), and
        not a number another tool's step holds in the root (``save`` would refuse it).

        A loop that calls this every step handles stops itself: the first SIGTERM or
        SIGINT makes the next step a saving step; after the loop the process exits with
        ``128 + signal``. Another tool's steps are those process 0 listed last, so every
        process answers alike.
        """
        if step == self._last_saved:
            return False
        if not (self.reached_preemption(step) or step % self.save_interval_steps == 0):
            return False
        if self._foreign is None:
            self._agreed_steps()
        return not any(f.step == step for f in self._foreign or ())

    def save(
        self,
        step: int,
        state: Any,
        *,
        force: bool = False,
        metadata: Mapping[str, Any] | None = None,
        metrics: Mapping[str, Any] | None = None,
        items: Mapping[str, Any] | None = None,
    ) -> bool:
        """Save ``state`` (and ``items``, ``metrics``) as ``step`` if ``should_save``
        says so, or ``force``.

        Args:
            step: a non-negative int, not saved before.
            state: any registered container.
            force: save even if the step is not a saving step.
            metadata: JSON user metadata, in the record ([`modelshard.read_metadata`][modelshard.read_metadata]).
            metrics: JSON dict of numbers; ``best_fn`` ranks steps by it.
            items: named items saved in the same step: JSON values, data iterators with
                ``get_state``/``set_state`` (grain), PRNG keys (see ``items``).

        Returns:
            Whether a save was started (it is complete once ``wait_until_finished``
            returns; during a stop request it is complete when ``save`` returns).

        Raises:
            ForeignStepError: another tool's step (Orbax's own, say) holds that number in
                the root; it is left as it is (``delete(step)`` removes it by name).
            CheckpointError: the step exists, or the state, items or metrics cannot be
                saved (checked before anything is written), or the previous
                asynchronous save failed.
            DistributedError: another process did not come to one of the save's waits
                within ``MODELSHARD_BARRIER_TIMEOUT``.
        """
        step = self._writing(step)
        stopping = guard.stop_signal() is not None
        if not (force or stopping or step % self.save_interval_steps == 0):
            return False
        if metadata is not None:
            json_or_error("metadata", dict(metadata))
        # checks the state before waiting for the previous step; nothing is written yet
        arrays, record = prepare(state, metadata)
        self.wait_until_finished()  # one save at a time; rotation of the finished one
        self._save_verdict(step)
        encoded = encode_items(items)
        if metrics is not None:
            if not isinstance(metrics, Mapping):
                raise CheckpointError(f"metrics must be a dict, got {type(metrics).__name__}.")
            json_or_error("metrics", dict(metrics))
            if self.policy.best_fn is not None:
                self.policy.score(step, metrics)
            self._metrics[step] = dict(metrics)
        parts = json_parts(items, encoded, metrics)
        # async: the one wait of the loop is for its arrays' copy (``take``); the checksums
        # sum that copy and the step is written from it, on the manager's own thread
        held = take(arrays, copy=self.async_save)
        name = _BACKGROUND if self.async_save else "modelshard:manager:step_sync"
        record.pending = held_sums([leaf.key for leaf in record.leaves], held, name)
        args = (self.directory, step, held, record, parts)
        if self.async_save:
            self._job = self._writer.submit(write_step, *args, compress=self._compress, name=name)
            self._last_saved = self._pending = step
            guard.pending_changed()
            if stopping:
                self.wait_until_finished()
            return True
        try:
            write_step(*args, compress=self._compress, name=name)
        except DistributedError:
            raise  # a process did not come to one of the step's waits: its own error
        except Exception as e:
            raise CheckpointError(
                f"step {step} was not saved to {self.directory}: {type(e).__name__}: {e}"
            ) from e
        self._last_saved = step
        self._rotate()
        return True

    def delete(self, step: int) -> None:
        """Remove step ``step`` from the root, whoever wrote it: the one way to replace a
        step another tool wrote (``delete(20)``, then ``save(20, ...)``), and to remove one
        of the manager's own outside its keep rules.

        Everything carrying that number goes (a link itself, not what it points to), a
        local step renamed aside first, so a crash leaves it whole or gone. Every process
        calls it; process 0 removes, the others wait for it.

        Raises:
            CheckpointError: nothing in the root carries that number, or it cannot be
                removed.
        """
        step = self._writing(step)
        self.wait_until_finished()  # a pending save of that step finishes first
        error = None
        if self._primary():
            try:
                with reaching(self.directory):
                    error = remove_numbered(self.directory, step)
            except OSError as e:
                error = f"cannot delete step {step} of {self.directory}: {type(e).__name__}: {e}"
        refused = broadcast(error, "modelshard:manager:deleted")
        self._metrics.pop(step, None)
        if self._last_saved == step:
            self._last_saved = None
        self._agreed_steps()  # every process lists afresh (should_save's foreign steps)
        if refused is not None:
            raise CheckpointError(refused)

    def step_directory(self, step: int) -> Any:
        """The directory of ``step`` (which [`modelshard.restore`][modelshard.restore] also reads)."""
        return self.directory / str(step)

    def _existing(self, step: int | None) -> int:
        self.wait_until_finished()
        steps = self._agreed_steps()
        others = self._foreign or []
        if step is None:
            if not steps:
                held = sorted({f.step for f in others})
                beside = (
                    f" (steps {', '.join(map(str, held))} there were written by another tool, "
                    "and are not steps this CheckpointManager restores)"
                    if held
                    else ""
                )
                raise CheckpointError(
                    f"no checkpoint in {self.directory}: no step was saved yet{beside}."
                )
            return steps[-1]
        path = self.step_directory(step)
        if step not in steps and not self._remote and path.is_symlink():
            raise CheckpointError(
                f"{path} is a symbolic link to {path.resolve()}; steps are directories of "
                f"{self.directory}, refusing to follow it."
            )
        held = [f for f in others if f.step == step]
        if step not in steps and held:
            raise ForeignStepError(
                f"cannot restore step {step}: "
                f"{'; '.join(f.describe(self.directory) for f in held)}; "
                "this CheckpointManager restores its own complete steps and Orbax's complete "
                "steps that hold a state item (`state`, or a single tree item); here: "
                f"{', '.join(map(str, steps)) or 'none'}.",
                step=step,
            )
        if step not in steps:
            raise CheckpointError(
                f"no step {step} in {self.directory}; steps there: "
                f"{', '.join(map(str, steps)) or 'none'}."
            )
        return step

    def restore(self, step: int | None = None, **options: Any) -> Any:
        """Restore ``step`` (default: the latest) exactly as [`modelshard.restore`][modelshard.restore]
        does, given its keyword arguments (``like``, ``specs``, ``mesh``, ...; ``mapping=``
        included: a step of another layout read through a [`WeightMap`][modelshard.WeightMap]).

        Raises:
            CheckpointError: there is no such step (the message lists the steps there are).
        """
        return restore(self.step_directory(self._existing(step)), **options)

    def items(
        self, step: int | None = None, *, like: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """The named items of ``step`` (default: the latest).

        A data iterator passed in ``like`` under its name gets its saved state
        (``set_state``) and is returned; PRNG keys come back as keys. A step whose items
        file is gone (damaged) raises CheckpointError rather than giving ``{}``. A step
        Orbax's own manager wrote gives its JSON items by name (``{"metadata": {...}}``).
        """
        step = self._existing(step)
        adopted = self._adopted(step)
        state = None if adopted is None else adopted.state
        return step_items(self.step_directory(step), state, like)

    def metrics(self, step: int) -> dict[str, Any] | None:
        """The metrics saved with ``step``, or None if it was saved without."""
        if step not in self._metrics:
            found = read_json(self.step_directory(step) / METRICS_ITEM / METRICS_FILE)
            if found is None:
                return None
            self._metrics[step] = found
        return self._metrics[step]

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The user metadata saved with ``step`` (default: the latest); for a step Orbax's
        own manager wrote, its ``custom_metadata``."""
        step = self._existing(step)
        if self._adopted(step) is not None:
            meta = step_metadata(self.step_directory(step)) or {}
            return dict(meta.get("custom_metadata") or {})
        record = read_json(self.step_directory(step) / RECORD_ITEM / RECORD_FILE) or {}
        return dict(record.get("metadata") or {})

    def best_step(self) -> int | None:
        """The best of ``all_steps`` by ``best_fn``, or None (no ``best_fn``, or no metrics)."""
        if self.policy.best_fn is None:
            return None
        scored = [(self.policy.score(s, m), s) for s in self.all_steps() if (m := self.metrics(s))]
        sign = 1.0 if self.policy.best_mode == "max" else -1.0
        return max(scored, key=lambda vs: (sign * vs[0], vs[1]), default=(0.0, None))[1]

    def latest_step(self) -> int | None:
        """The newest complete step, or None: process 0's on every process (``all_steps``)."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """Every complete step, ascending, read from storage: its own (see
        ``complete_steps``) and Orbax's (``listing.adopted_steps``).

        Under several processes this is process 0's listing, broadcast: every process
        calls it.

        Raises:
            DistributedError: process 0's listing did not come within
                ``MODELSHARD_BARRIER_TIMEOUT``.
        """
        return self._agreed_steps()

    def wait_until_finished(self) -> None:
        """Block until the background save is written, then apply rotation.

        Under several processes every process calls it (``save``, ``restore`` and
        ``close`` do), and all raise if any process's part failed.

        Raises:
            CheckpointError: the background save failed, on this process or another (its
                step is named; the steps already on disk are still listed and restorable).
            DistributedError: another process did not come to one of its barriers within
                ``MODELSHARD_BARRIER_TIMEOUT``.
        """
        step, self._pending = self._pending, None
        if step is None:
            self._purge_rotated()  # process 0 alone, on its disk: no waiting
            return
        guard.pending_changed()
        job, self._job = self._job, None
        failure = None if job is None else job.exception()
        if isinstance(failure, DistributedError):
            raise failure  # a process did not come: exchanging outcomes would wait too
        how = None if failure is None else f"{type(failure).__name__}: {failure}"
        ended = gather(how, "modelshard:manager:finished")
        failed = [(p, h) for p, h in enumerate(ended) if h is not None]
        if failed:
            steps = self._agreed_steps()  # every process raises the same text
            # one failure every process raised (the step's shared failure) names its process
            same = len(failed) == len(ended) and len({h for _, h in failed}) == 1
            where = "" if same else f"process {failed[0][0]}: "
            raise CheckpointError(
                f"step {step} was not saved to {self.directory}: {where}{failed[0][1].rstrip('.')}. "
                f"Steps on disk: {', '.join(map(str, steps)) or 'none'}."
            ) from failure
        self._purge_rotated()
        self._rotate()

    def close(self) -> None:
        """Wait for pending saves and stop the manager's background thread."""
        if self._closed:
            return
        try:
            self.wait_until_finished()
        finally:
            self._closed = True
            guard.unwatch(self)
            self._writer.shutdown(wait=True)
            self._release_lock()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        # this process's own listing: a repr is no place for a collective
        steps = restorable_steps(self.directory)
        return f"CheckpointManager({str(self.directory)!r}, steps={steps})"
