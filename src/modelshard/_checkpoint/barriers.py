"""Orbax's barriers in modelshard's saves, bounded by ``MODELSHARD_BARRIER_TIMEOUT``; a
failure on one process shared with the others (``sharing_failures``,
and ``carrying_failures`` and ``carrying_commit`` for a background save: its writes and
its commit).

Orbax (0.12.8) waits at coordination-service barriers of its own in every multi-process
save (its start, directory creation, the commit of an asynchronous save), each with a
timeout it fixes itself (``multihost._DEFAULT_BARRIER_TIMEOUT``, 300 s, or
``AsyncOptions.timeout_secs``); no option sets it for all of them. Every one of them gets
its waiting function from ``multihost.get_barrier_sync_fn``, and names its barrier with
the ``barrier_sync_key_prefix`` of the ``MultiprocessingOptions`` it was given.

So modelshard gives Orbax the prefix ``KEY_PREFIX`` (``write.coordinated_processes``), and
``enable`` wraps ``get_barrier_sync_fn`` once: a barrier whose name starts with that
prefix waits ``distributed.barrier_timeout_s()`` and raises the ``DistributedError`` of
modelshard's own barriers (naming the barrier and the variable) when a process does not
come; any other barrier (the user's own Orbax calls) is Orbax's, untouched.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import Any

import jax

from .._runtime import (
    barrier_timeout_s,
    exchange,
    outcome,
    raise_shared,
    shared_error,
    wait_failed,
)

KEY_PREFIX = "modelshard"
"""The ``barrier_sync_key_prefix`` of every Orbax call modelshard makes."""

COMMITTING = "committing"
"""What a background save's commit is called in the error every process raises."""

_lock = threading.Lock()
# How this thread's parts of a background save ended (``carried``: one entry per barrier
# of ours still to come on this thread, oldest first): set by ``_Carried`` once it waited
# for the writes (the write, then the commit), the commit's replaced by ``carrying_commit``
# where it failed; each barrier carries its entry to the other processes.
_outcome = threading.local()


def ours(key: str) -> bool:
    """Whether the Orbax barrier ``key`` belongs to a modelshard save."""
    return key.startswith(f"{KEY_PREFIX}_")


def _wrap(original: Any) -> Any:
    @functools.wraps(original)
    def get_barrier_sync_fn(*args: Any, **kwargs: Any) -> Any:
        sync = original(*args, **kwargs)

        def bounded(*, key: str, timeout_ms: int) -> None:
            if not ours(key):
                return sync(key=key, timeout_ms=timeout_ms)
            timeout = barrier_timeout_s()

            def wait() -> None:
                try:
                    sync(key=key, timeout_ms=max(1, int(timeout * 1000)))
                except Exception as e:  # DEADLINE_EXCEEDED, or a peer's failure
                    raise wait_failed("Orbax barrier", key, timeout, e) from e

            carried = getattr(_outcome, "carried", None)
            if not carried:
                return wait()
            failure, what = carried.pop(0)
            error = shared_error(failure, exchange(outcome(failure), key, wait), what)
            if error is not None:  # on every process: none goes on to the commit
                carried.clear()
                raise error

        return bounded

    get_barrier_sync_fn.__modelshard_wrapped__ = True  # type: ignore[attr-defined]
    return get_barrier_sync_fn


def enable() -> None:
    """Bound Orbax's barriers of modelshard's saves (idempotent; see the module doc)."""
    from .._internals import wrap_barrier_sync_fn

    with _lock:
        wrap_barrier_sync_fn(
            lambda current: (
                None if getattr(current, "__modelshard_wrapped__", False) else _wrap(current)
            )
        )


def sharing_failures(handler: Any, name: str, what: str) -> Any:
    """``handler`` (an Orbax checkpoint handler given to a synchronous ``Checkpointer``),
    whose ``save`` tells every process how this process's part ended before Orbax waits
    at its next barrier (``Checkpointer:save``).

    Without it a process whose arrays could not be written (a full disk on one host)
    raises out of Orbax's ``save`` alone, and the others wait for it at Orbax's barrier
    until ``MODELSHARD_BARRIER_TIMEOUT``; with it every process raises the same
    ``CheckpointError`` at once, naming the process (``shared_failure``). The exchange
    runs where Orbax calls ``save``: on the main thread, on every process.
    """
    if jax.process_count() == 1:
        return handler
    from .._internals import wrap_handler_save

    return wrap_handler_save(handler, lambda save: _sharing(save, name, what))


def _sharing(save: Any, name: str, what: str) -> Any:
    def save_and_share(*args: Any, **kwargs: Any) -> Any:
        failure: Exception | None = None
        out = None
        try:
            out = save(*args, **kwargs)
        except Exception as e:
            failure = e
        raise_shared(failure, name, what)
        return out

    return save_and_share


class _Carried:
    """The futures of one background save, as one Orbax future whose ``result`` waits for
    them all and never raises: how they ended is kept for the barrier Orbax waits at next
    on the same thread (``async_write_complete``, before the commit), which carries it to
    every process (``carrying_failures``)."""

    def __init__(self, futures: list[Any], what: str):
        self._futures = futures
        self._what = what

    def result(self, timeout: float | None = None) -> None:
        start = time.time()
        failure: Exception | None = None
        for f in self._futures:  # each one waited for: nothing of this save writes after
            left = None if timeout is None else max(0.0, timeout - (time.time() - start))
            try:
                f.result(timeout=left)
            except Exception as e:
                failure = failure or e
        # the barrier before the commit carries this; the one after it, the commit's end
        _outcome.carried = [(failure, self._what), (None, COMMITTING)]

    def cancel(self) -> None:
        for f in self._futures:
            with contextlib.suppress(Exception):
                f.cancel()


def carrying_failures(handler: Any, name: str, what: str) -> Any:
    """``handler`` (the Orbax checkpoint handler of an ``AsyncCheckpointer``), whose part of
    a save failing on one process fails it on every process at once.

    The part written before ``save`` returns (``async_save`` itself) is shared there, on
    the calling thread of every process, as ``sharing_failures`` does. The part written in
    the background (each process's arrays) ends on Orbax's background thread, where nothing
    that waits for every process may be added: its futures are given to Orbax as one
    (``_Carried``) that keeps how they ended instead of raising, so every process still
    comes to the barrier Orbax waits at before its commit, and that barrier carries each
    process's outcome to the others (``distributed.exchange``: values put before the wait,
    read after it). Every process then raises the same ``CheckpointError`` on that thread,
    naming the process that failed, and process 0 does not commit; the main thread raises
    it at the next ``wait_until_finished``. Without it the others wait at that barrier until
    ``MODELSHARD_BARRIER_TIMEOUT``.
    """
    if jax.process_count() == 1:
        return handler
    from .._internals import wrap_handler_async_save

    return wrap_handler_async_save(handler, lambda save: _carrying(save, name, what))


def _carrying(async_save: Any, name: str, what: str) -> Any:
    async def async_save_and_carry(*args: Any, **kwargs: Any) -> Any:
        failure: Exception | None = None
        futures = None
        try:
            futures = await async_save(*args, **kwargs)
        except Exception as e:
            failure = e
        raise_shared(failure, name, what)
        return [_Carried(list(futures or []), what)]

    return async_save_and_carry


def carrying_commit(checkpointer: Any) -> Any:
    """``checkpointer`` (an ``AsyncCheckpointer`` whose handler is ``carrying_failures``'),
    whose commit failing on the primary process fails the save on every process at once.

    Orbax commits on its background thread between its two last barriers, on the primary
    process alone: it writes the step's metadata, finalizes each item (the merge of every
    process's OCDBT database into the one index of the arrays) and renames the step into
    place (or writes its commit file). Where that raised, the primary's thread ended
    there, and the others waited at the barrier after the commit until
    ``MODELSHARD_BARRIER_TIMEOUT``. With it the failure is kept instead, the primary still
    comes to that barrier, which carries it to every process (as ``carrying_failures``'
    barrier before the commit does), and every process raises the same
    ``CheckpointError`` (``committing failed on process 0: ...``) on that thread; the main
    thread raises it at the next ``wait_until_finished``. The step is not listed: what the
    commit left is an unfinished step, which the next save of that step removes.

    It wraps Orbax's ``AsyncCheckpointer._make_on_commit_callback`` on this instance (no
    public hook runs around the whole commit).
    """
    if jax.process_count() == 1:
        return checkpointer
    from .._internals import wrap_commit_callback

    return wrap_commit_callback(checkpointer, _carrying_commit)


def _carrying_commit(make: Any) -> Any:
    def make_carrying(*args: Any, **kwargs: Any) -> Any:
        commit = make(*args, **kwargs)

        def commit_and_carry() -> None:
            try:
                commit()
            except Exception as e:
                carried = getattr(_outcome, "carried", None)
                if not carried:  # no barrier of ours to carry it: Orbax's own handling
                    raise
                carried[0] = (e, COMMITTING)

        return commit_and_carry

    return make_carrying
