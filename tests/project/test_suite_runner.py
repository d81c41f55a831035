"""How the suite itself runs: what `make test`'s speed rests on."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.xdist_group("suite-runner")


def test_a_grouped_test_carries_its_group_under_loadgroup(request: pytest.FixtureRequest) -> None:
    """`make test` runs ``--dist loadgroup`` so that a file whose module fixtures start
    processes (the journey matrix, the examples) runs on one worker, and its fixtures once.
    pytest-xdist sends a group to one worker by the ``@group`` its worker appends to each
    grouped test's id; pytest 9.2 ignores that suffix, and each group was then split over
    both workers, every process-starting fixture run twice. The lock pins a pytest that
    keeps it (requirements/lock.in)."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("runs under pytest-xdist's --dist loadgroup (make test)")
    assert request.node.nodeid.endswith("@suite-runner"), (
        f"{request.node.nodeid!r} carries no xdist group: this pytest "
        f"({pytest.__version__}) drops pytest-xdist's group suffix, so --dist loadgroup "
        "splits every group over the workers"
    )
