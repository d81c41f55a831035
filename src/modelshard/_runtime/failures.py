"""One process's failure shared with the others: all raise at once, none waits."""

from __future__ import annotations

from collections.abc import Sequence

from .._base import CheckpointError, DistributedError
from .distributed import gather

_SHARED = "_modelshard_shared"  # set on the errors shared_error makes

Outcome = list[str] | None
"""How one process's part ended: None, or its failure's ``[class name, message]``."""


def outcome(failure: BaseException | None) -> Outcome:
    """``failure`` as it travels to the other processes (JSON)."""
    return None if failure is None else [type(failure).__name__, str(failure)]


def shared_error(
    failure: BaseException | None, ended: Sequence[Outcome], what: str
) -> BaseException | None:
    """The error every process raises from how each one's part ended; None if none failed."""
    failed = [(p, o) for p, o in enumerate(ended) if o is not None]
    if not failed:
        return None
    if failure is not None and len(failed) == len(ended):
        return failure
    p, (kind, text) = failed[0]
    known = {c.__name__: c for c in (CheckpointError, DistributedError)}
    error = known[kind](text) if kind in known else None
    if error is None:
        error = CheckpointError(f"{what} failed on process {p}: {kind}: {text}")
    error.__cause__ = failure
    setattr(error, _SHARED, True)
    return error


def is_shared(error: BaseException) -> bool:
    """Whether ``error`` came out of ``shared_error`` (every process raised it at once)."""
    return bool(getattr(error, _SHARED, False))


def raise_shared(failure: BaseException | None, name: str, what: str) -> None:
    """Gather how each process's part of ``what`` ended and raise ``shared_error``'s error:
    every process raises, or none does."""
    # already shared, or a process missed a wait (it would miss the exchange too)
    if failure is not None and (is_shared(failure) or isinstance(failure, DistributedError)):
        raise failure
    shared = shared_error(failure, gather(outcome(failure), name), what)
    if shared is not None:
        raise shared
