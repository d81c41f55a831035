"""Work spread over processes by bytes: the same answer on every process, unasked."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class LeastLoaded:
    """Each piece of work to the least-loaded process (ties: the lowest index)."""

    def __init__(self, processes: int) -> None:
        self.load = [0] * processes

    def pick(self, nbytes: int, among: Iterable[int] | None = None) -> int:
        """The process that takes ``nbytes`` of work, of ``among`` (default: every one)."""
        p = min(range(len(self.load)) if among is None else among, key=lambda q: (self.load[q], q))
        self.load[p] += nbytes
        return p


def assign(sizes: Sequence[int], processes: int) -> list[int]:
    """The process that writes each piece of ``sizes`` (bytes): largest first, least loaded."""
    greedy = LeastLoaded(processes)
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owner[i] = greedy.pick(sizes[i])
    return owner
