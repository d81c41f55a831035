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
from typing import Any

import numpy as np
import pytest

import modelshard as ms
from helpers import launch_argv

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.xdist_group("journeys"),  # one worker: its module fixtures start processes once
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
# No case finished for this long: the job hangs. Every process's stacks are dumped, then
# it is killed. Above the worker's own per-case bound (CASE_TIMEOUT_S), which fires first.
STALL_S = 55.0
START_S = 180.0  # starting JAX's runtime in every process, on a loaded machine
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


def _done(results: Path) -> int:
    return sum(1 for _ in results.glob("*.json")) if results.is_dir() else 0


@dataclass
class _Running:
    out: Path
    processes: int
    proc: subprocess.Popen
    log: Any
    t0: float
    seconds: float = 0.0
    stalled: bool = False


def _start(out: Path, topology: str, peer: Path | None = None) -> _Running:
    n, devices = TOPOLOGIES[topology]
    out.mkdir(parents=True)
    cmd = launch_argv(
        sys.executable, str(WORKER), str(out), *(["--peer", str(peer)] if peer else []),
        n=n, devices=devices, timeout=JOB_S, grace=2,
    )  # fmt: skip
    env = {**os.environ, ms.distributed.ENV_BARRIER_TIMEOUT: str(BARRIER_TIMEOUT_S)}
    log = open(out / "job.log", "wb")  # noqa: SIM115 - closed by run_jobs
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    return _Running(out, n, proc, log, time.monotonic())


def run_jobs(jobs: dict[str, _Running]) -> dict[str, Job]:
    """Wait for the jobs; kill them all (after dumping every process's stacks) as soon as
    no case of any has finished for ``STALL_S`` (one job may wait for the other's files)."""
    seen, last = 0, time.monotonic()
    while any(j.proc.poll() is None for j in jobs.values()):
        time.sleep(0.2)
        for j in jobs.values():
            if j.proc.poll() is not None and not j.seconds:
                j.seconds = time.monotonic() - j.t0
        # progress: a process started its loop (JAX is up), or a case finished
        done = sum(
            _done(j.out / "results") + len(list(j.out.glob("pid.p*"))) for j in jobs.values()
        )
        if done != seen:
            seen, last = done, time.monotonic()
        elif time.monotonic() - last > (STALL_S if seen else START_S):
            for j in jobs.values():
                if j.proc.poll() is None:
                    j.stalled = True
                    _kill(j.proc, j.out, j.processes)
            break
    out = {}
    for name, j in jobs.items():
        rc = j.proc.wait()
        j.log.close()
        seconds = j.seconds or time.monotonic() - j.t0
        out[name] = Job(j.out, j.processes, None if j.stalled else rc, _read(j.out / "job.log"),
                        seconds, j.stalled)  # fmt: skip
    return out


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
    """Both jobs, each started once: 2 x 4 reads back what 1 x 8 wrote."""
    root = tmp_path_factory.mktemp("journeys")
    t0 = time.monotonic()
    # side by side: the 2 x 4 job's peer_* cases wait for the 1 x 8 job to finish
    done = run_jobs({
        "1x8": _start(root / "1x8", "1x8"),
        "2x4": _start(root / "2x4", "2x4", peer=root / "1x8"),
    })  # fmt: skip
    print(
        f"journey jobs: 1x8 {done['1x8'].seconds:.1f} s, 2x4 {done['2x4'].seconds:.1f} s, "
        f"both {time.monotonic() - t0:.1f} s"
    )
    return done


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
                f"hung (no case finished for {STALL_S:g} s; killed)"
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
