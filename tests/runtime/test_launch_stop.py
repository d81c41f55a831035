"""``modelshard launch`` stopped by a signal: the processes get the SIGTERM and the grace to
finish their preemption save; a process killed after the grace is named and the exit status
says so; every process's exit status is reported at the end. Plain Python children (no JAX)
that "save" for a set time after SIGTERM, as a ``CheckpointManager`` loop does."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from modelshard._runtime import launch as _launch

PY = sys.executable

# Each process writes ready<i>; on SIGTERM it "saves" for SAVE_S seconds, writes saved<i>
# and exits 128 + SIGTERM, as a training loop that polls should_save does.
CHILD = """
import os, signal, sys, time
out, save_s = sys.argv[1], float(sys.argv[2])
i = os.environ["MODELSHARD_PROCESS_ID"]
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
open(os.path.join(out, "ready" + i), "w").close()
while not stop:
    time.sleep(0.01)
time.sleep(save_s)
open(os.path.join(out, "saved" + i), "w").close()
sys.exit(128 + signal.SIGTERM)
"""


def start(tmp_path: Path, save_s: float, *options: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            PY,
            _launch.__file__,
            "-n",
            "2",
            *options,
            "--",
            PY,
            "-c",
            CHILD,
            str(tmp_path),
            str(save_s),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_ready(tmp_path: Path, launcher: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
        assert launcher.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)


def finish(launcher: subprocess.Popen[str]) -> tuple[int, list[str]]:
    try:
        _, err = launcher.communicate(timeout=90)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    return launcher.returncode, err.splitlines()


def test_the_default_grace_fits_a_preemption_save(tmp_path):
    assert _launch.DEFAULT_GRACE_S == 30.0
    assert _launch._parser().parse_args(["-n", "2", "--", "x"]).grace == 30.0
    launcher = start(tmp_path, 4.0)  # a 4 s save: more than the 3 s the grace once was
    wait_ready(tmp_path, launcher)
    launcher.send_signal(signal.SIGTERM)
    rc, err = finish(launcher)
    assert rc == 128 + signal.SIGTERM, err
    assert all((tmp_path / f"saved{i}").exists() for i in range(2)), err
    assert err == [
        "[modelshard launch] got signal 15; stopping every process (SIGTERM, then SIGKILL "
        "after --grace 30 s)",
        "[modelshard launch] exit status: process 0 143 (stopped on SIGTERM), process 1 143 "
        "(stopped on SIGTERM)",
    ]


def test_a_save_cut_short_by_the_grace_is_said_and_is_not_a_clean_stop(tmp_path):
    launcher = start(tmp_path, 60.0, "--grace", "0.5")
    wait_ready(tmp_path, launcher)
    launcher.send_signal(signal.SIGTERM)
    rc, err = finish(launcher)
    assert rc == 128 + signal.SIGKILL, err
    assert not any((tmp_path / f"saved{i}").exists() for i in range(2))
    killed = [
        f"[modelshard launch] process {i} was still running 0.5 s after SIGTERM and was "
        "killed: whatever it was saving (a checkpoint) was cut short; give it more time "
        "with --grace"
        for i in range(2)
    ]
    assert err == [
        "[modelshard launch] got signal 15; stopping every process (SIGTERM, then SIGKILL "
        "after --grace 0.5 s)",
        *killed,
        "[modelshard launch] exit status: process 0 137 (killed by SIGKILL), process 1 137 "
        "(killed by SIGKILL)",
    ]


def test_a_process_stopped_by_its_scheduler_is_not_a_failure(tmp_path):
    """SIGTERM to one process (a scheduler preempting its host): it saves and exits 143;
    the launcher stops the others the same way and reports a stop, not a failure."""
    launcher = start(tmp_path, 1.0)
    wait_ready(tmp_path, launcher)
    children = subprocess.run(
        ["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True
    ).stdout.split()
    assert len(children) == 2, children
    envs = {c: Path(f"/proc/{c}/environ").read_bytes() for c in children}
    (one,) = [c for c, e in envs.items() if b"MODELSHARD_PROCESS_ID=1\0" in e]
    subprocess.run(["kill", "-TERM", one], check=True)
    rc, err = finish(launcher)
    assert rc == 128 + signal.SIGTERM, err
    assert all((tmp_path / f"saved{i}").exists() for i in range(2)), err
    assert err == [
        "[modelshard launch] process 1 stopped on SIGTERM; stopping the others (--grace 30 s)",
        "[modelshard launch] exit status: process 0 143 (stopped on SIGTERM), process 1 143 "
        "(stopped on SIGTERM)",
    ]
