"""Which steps a [`CheckpointManager`][modelshard.CheckpointManager] saves and keeps: a step
is kept if any rule keeps it, the newest complete step always; rotation sees the manager's
own complete steps only. A saving step is ``step % save_interval_steps == 0``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._base import CheckpointError


@dataclasses.dataclass(frozen=True)
class KeepPolicy:
    """The rules that decide which complete steps survive rotation: the newest
    ``max_to_keep``, every multiple of ``keep_period``, the ``keep_best`` best by
    ``best_fn(metrics)`` (``best_mode`` ``"max"`` or ``"min"``), and ``keep_steps``."""

    max_to_keep: int | None = None
    keep_period: int | None = None
    keep_best: int | None = None
    best_fn: Callable[[Mapping[str, Any]], float] | None = None
    best_mode: str = "max"
    keep_steps: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        for name in ("max_to_keep", "keep_period", "keep_best"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise CheckpointError(f"{name} must be a positive int or None, got {value!r}.")
        if self.best_mode not in ("max", "min"):
            raise CheckpointError(f"best_mode must be 'max' or 'min', got {self.best_mode!r}.")
        if (self.keep_best is None) != (self.best_fn is None):
            raise CheckpointError(
                "keep_best and best_fn go together: keep_best=N keeps the N steps with the "
                "best best_fn(metrics); pass both or neither."
            )
        bad = [s for s in self.keep_steps if isinstance(s, bool) or not isinstance(s, int)]
        if bad:
            raise CheckpointError(f"keep_steps must be ints, got {', '.join(map(repr, bad))}.")

    @property
    def keeps_everything(self) -> bool:
        return self.max_to_keep is None and self.keep_period is None and self.keep_best is None

    def score(self, step: int, metrics: Mapping[str, Any]) -> float:
        """``best_fn(metrics)`` as a float; a clear error when it fails or is not a number."""
        fn = self.best_fn
        if fn is None:
            raise CheckpointError("this CheckpointManager has no best_fn to rank steps by.")
        try:
            value = float(fn(metrics))
        except Exception as e:
            raise CheckpointError(
                f"best_fn failed on the metrics of step {step} ({metrics!r}): "
                f"{type(e).__name__}: {e}. best_fn must return a number from the dict "
                "passed as save(..., metrics=...)."
            ) from e
        if math.isnan(value):
            raise CheckpointError(f"best_fn returned NaN for the metrics of step {step}.")
        return value

    def keep(self, steps: Sequence[int], metrics: Mapping[int, Mapping[str, Any]]) -> set[int]:
        """The subset of ``steps`` (complete, ascending) to keep; always holds the newest."""
        steps = sorted(steps)
        if not steps or self.keeps_everything:
            return set(steps)
        kept = {steps[-1]} | (set(steps) & self.keep_steps)
        if self.max_to_keep is not None:
            kept.update(steps[-self.max_to_keep :])
        if self.keep_period is not None:
            kept.update(s for s in steps if s % self.keep_period == 0)
        if self.keep_best is not None:
            scored = [(self.score(s, metrics[s]), s) for s in steps if s in metrics]
            # best first; among equal scores the newer step wins
            sign = -1.0 if self.best_mode == "max" else 1.0
            scored.sort(key=lambda vs: (sign * vs[0], -vs[1]))
            kept.update(s for _, s in scored[: self.keep_best])
        return kept
