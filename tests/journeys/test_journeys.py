"""The journey matrix: every public entry point that touches arrays, on 1 process x 8 devices
and on 2 processes x 4, for every kind of leaf (replicated, split within a process, spanning
processes, process-local), tiny and 2 MiB, bit-exact.

Each topology is one job started once (``journey_worker.py`` runs every case in a loop and
writes one JSON result per case and process); the tests here read those results. The 1 x 8
job runs first, the 2 x 4 job reads back what it wrote (``peer_*`` cases), and this process
(8 devices) reads back what the 2 x 4 job wrote. A hang fails within a minute with every
process's Python stacks, never after the 600 s barrier timeout. Run alone:
``.venv/bin/python -m pytest tests/journeys/test_journeys.py -q``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import modelshard as ms
from modelshard._runtime import launch as _launch

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(sys.platform != "linux", reason="multi-process tests run on Linux"),
]

WORKER = Path(__file__).with_name("journey_worker.py")
_spec = importlib.util.spec_from_file_location("journey_worker", WORKER)
assert _spec is not None and _spec.loader is not None
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

# A barrier inside a case gives up after this long, so that a process that failed fast
# and one that waits for it both go on to the next case (whose start barrier waits longer).
BARRIER_TIMEOUT_S = 10
# No case started or finished for this long: the job hangs. Every process's stacks are dumped, then
# it is killed. Above the worker's own per-case bound (CASE_TIMEOUT_S), which fires first.
STALL_S = 55.0
JOB_S = 900  # the launcher's bound on a whole job, far above a healthy run

TOPOLOGIES = {"1x8": (1, 8), "2x4": (2, 4)}
NAMES = [name for name, _ in worker.CASES]


@dataclass
class Job:
    out: Path
    processes: int
    rc: int | None
    log: str
    seconds: float
    stalled: bool

    def stacks(self) -> str:
        return "\n".join(
            f"===== process {p} stacks =====\n{_read(self.out / f'stacks.p{p}.txt')}"
            for p in range(self.processes)
        )

    def current(self) -> list[str]:
        return [_read(self.out / f"current.p{p}").strip() for p in range(self.processes)]


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return "(none)"


def _progress(out: Path) -> tuple[int, tuple[str, ...]]:
    """How far a job has come: the cases finished, and the case each process is in (a
    process still starting up, importing under load, has not begun one yet)."""
    results = out / "results"
    done = sum(1 for _ in results.glob("*.json")) if results.is_dir() else 0
    current = tuple(p.read_text() for p in sorted(out.glob("current.p*")))
    return done, current


def run_job(out: Path, topology: str, peer: Path | None = None) -> Job:
    """Start one job of the matrix and wait for it; kill it (after dumping every process's
    stacks) as soon as no case has started or finished for ``STALL_S``."""
    n, devices = TOPOLOGIES[topology]
    out.mkdir(parents=True)
    cmd = [
        sys.executable, _launch.__file__, "-n", str(n), "--devices-per-process", str(devices),
        "--timeout", str(JOB_S), "--grace", "2", "--",
        sys.executable, str(WORKER), str(out), *(["--peer", str(peer)] if peer else []),
    ]  # fmt: skip
    env = {**os.environ, ms.distributed.ENV_BARRIER_TIMEOUT: str(BARRIER_TIMEOUT_S)}
    log = out / "job.log"
    t0 = time.monotonic()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        seen, last, stalled = _progress(out), time.monotonic(), False
        while proc.poll() is None:
            time.sleep(0.2)
            now = _progress(out)
            if now != seen:
                seen, last = now, time.monotonic()
            elif time.monotonic() - last > STALL_S:
                stalled = True
                _kill(proc, out, n)
                break
        rc = proc.wait()
    return Job(out, n, None if stalled else rc, _read(log), time.monotonic() - t0, stalled)


def _kill(proc: subprocess.Popen, out: Path, n: int) -> None:
    """Ask every worker for its stacks (SIGUSR1: faulthandler), then SIGKILL them all."""
    pids = []
    for p in range(n):
        with contextlib.suppress(FileNotFoundError, ValueError):
            pids.append(int((out / f"pid.p{p}").read_text()))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
    time.sleep(1.0)
    for pid in [*pids, proc.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, Job]:
    """Both jobs, each started once: 1 x 8 first, then 2 x 4 reading back its files."""
    root = tmp_path_factory.mktemp("journeys")
    one = run_job(root / "1x8", "1x8")
    two = run_job(root / "2x4", "2x4", peer=one.out)
    print(f"journey jobs: 1x8 {one.seconds:.1f} s, 2x4 {two.seconds:.1f} s")
    return {"1x8": one, "2x4": two}


def _cases() -> list:
    out = []
    for topology in TOPOLOGIES:
        for name in NAMES:
            if name.startswith("peer_") and topology == "1x8":
                continue
            out.append(pytest.param(topology, name, id=f"{topology}-{name}"))
    return out


@pytest.mark.parametrize(("topology", "name"), _cases())
def test_journey(jobs, topology, name):
    job = jobs[topology]
    for p in range(job.processes):
        path = job.out / "results" / f"{name}.p{p}.json"
        if not path.exists():
            how = (
                f"hung (no case started or finished for {STALL_S:g} s; killed)"
                if job.stalled
                else f"ended with exit status {job.rc}"
            )
            pytest.fail(
                f"{name} did not finish on process {p} of {topology}: the job {how} while its "
                f"processes were in {job.current()}.\n{job.stacks()}\n"
                f"----- job output (last 6000 characters) -----\n{job.log[-6000:]}",
                pytrace=False,
            )
        r = json.loads(path.read_text())
        if not r["ok"]:
            pytest.fail(f"{name} failed on process {p} of {topology}:\n{r['trace']}", pytrace=False)


# ---- what two processes wrote, read by one ------------------------------------------------


def _want(layout: str, size: str, salt: int = 0) -> dict[str, np.ndarray]:
    extra = {"v": worker.value(size, 1)} if layout == "local" and salt == 0 else {}
    return {"w": worker.value(size, salt)} | extra


def _same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        g = np.asarray(got[k])
        assert g.dtype == w.dtype and g.shape == w.shape, k
        assert np.array_equal(g.view(np.uint8), w.view(np.uint8)), k


READERS = {
    "save": lambda d, lay, s: (ms.restore(d / f"save-{lay}-{s}"), _want(lay, s)),
    "reshard": lambda d, lay, s: (ms.restore(d / f"reshard-{lay}-{s}"), _want(lay, s)),
    "reshard_cli": lambda d, lay, s: (ms.restore(d / f"reshard_cli-{lay}-{s}"), _want(lay, s)),
    "manager": lambda d, lay, s: (
        worker.manager_step(d / f"manager-async-{lay}-{s}", 3),
        _want(lay, s),
    ),
    "preemption": lambda d, lay, s: (
        worker.manager_step(d / f"preempt-{lay}-{s}", 3),
        _want(lay, s),
    ),
    "convert": lambda d, lay, s: (ms.restore(d / f"convert-{lay}-{s}"), _want(lay, s, 2)),
    "save_safetensors": lambda d, lay, s: (
        ms.load_safetensors(d / f"out-{lay}-{s}.safetensors", progress=False),
        _want(lay, s),
    ),
}


@pytest.mark.parametrize("size", list(worker.SIZES))
@pytest.mark.parametrize("layout", list(worker.LAYOUTS))
@pytest.mark.parametrize("what", list(READERS))
def test_written_by_two_processes_read_by_one(jobs, what, layout, size):
    mesh = ms.make_mesh({"data": 8})
    got, want = READERS[what](jobs["2x4"].out / "files", layout, size)
    _same(ms.distributed.to_host(got), want)
    # and placed on another mesh of this process's 8 devices
    if what in ("save", "reshard", "convert"):
        name = {"save": "save", "reshard": "reshard", "convert": "convert"}[what]
        placed = ms.restore(
            jobs["2x4"].out / "files" / f"{name}-{layout}-{size}",
            specs=ms.fsdp("data", min_size=0),
            mesh=mesh,
        )
        _same(ms.distributed.to_host(placed), want)
