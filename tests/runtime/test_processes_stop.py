"""``modelshard launch`` stopped by a signal: the processes get the SIGTERM and the grace to
finish their preemption save; a process killed after the grace is named and the exit status
says so; every process's exit status is reported at the end. Plain Python children (no JAX)
that "save" for a set time after SIGTERM, as a ``CheckpointManager`` loop does, and two real
JAX processes whose manager saves every step to ``s3://`` (moto)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import pytest

from modelshard._runtime import processes as _launch

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


PREEMPT_S3 = Path(__file__).parents[1] / "checkpoint" / "scripts" / "preempt_s3.py"


def _preempt_s3_initial() -> dict[str, Any]:
    """What ``preempt_s3.py`` starts from (its step s holds these plus s + 1, exactly)."""
    import numpy as np

    return {
        "w": (np.arange(1024 * 1024) % 2048).astype(np.float32).reshape(1024, 1024) / 8,
        "b": np.arange(1024, dtype=np.float32) / -8,
    }


def _read_lines(stream: IO[str], into: list[str]) -> None:
    for line in stream:
        into.append(line.rstrip("\n"))


@pytest.mark.multiprocess
@pytest.mark.skipif(sys.platform != "linux", reason="multi-process tests run on Linux")
def test_sigterm_during_a_real_save_to_s3_saves_the_step_or_says_it_was_cut_short(
    s3_root, tmp_path
):
    """``modelshard launch -n 2 --devices-per-process 4`` with its default options, two
    processes whose CheckpointManager saves every step to ``s3://`` (moto): SIGTERM to the
    launcher while they save. Every process saves the same step, which a fresh process
    restores bit-exact, and the launcher exits 143; or the grace cut the save short and
    the launcher names each process it killed and exits 137, never the status of a clean
    stop."""
    import numpy as np

    import modelshard as ms

    out = tmp_path / "out"
    out.mkdir()
    cmd = [PY, "-m", "modelshard", "launch", "-n", "2", "--devices-per-process", "4", "--"]
    launcher = subprocess.Popen(
        [*cmd, PY, str(PREEMPT_S3), s3_root, str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    stdout: list[str] = []
    stderr: list[str] = []
    readers = [
        threading.Thread(target=_read_lines, args=(s, lines), daemon=True)
        for s, lines in ((launcher.stdout, stdout), (launcher.stderr, stderr))
    ]
    for t in readers:
        t.start()
    try:
        deadline = time.monotonic() + 240  # start-up of two JAX processes on a loaded machine
        while not all((out / f"ready_{i}").exists() for i in range(2)):
            assert launcher.poll() is None, "\n".join(stderr[-40:])
            assert time.monotonic() < deadline, "\n".join(stderr[-40:])
            time.sleep(0.05)
        t0 = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        rc = launcher.wait(timeout=_launch.DEFAULT_GRACE_S + 60)
        print(f"the launcher ended {time.monotonic() - t0:.1f} s after SIGTERM: {rc}")
    finally:
        if launcher.poll() is None:  # the backstop: the children die with the launcher
            launcher.kill()
            launcher.wait()
        for t in readers:
            t.join(10)
    said = "\n".join(stdout[-20:] + stderr[-40:])
    notes = [line for line in stderr if line.startswith("[modelshard launch] ")]
    assert notes[0] == (
        "[modelshard launch] got signal 15; stopping every process (SIGTERM, then SIGKILL "
        "after --grace 30 s)"
    ), said
    with ms.CheckpointManager(s3_root, handle_signals=False) as mngr:
        steps = mngr.all_steps()
        assert steps, said
        for step in steps[-2:]:  # the latest steps are complete and bit-exact
            restored = mngr.restore(step)
            for k, want in _preempt_s3_initial().items():
                np.testing.assert_array_equal(np.asarray(restored[k]), want + np.float32(step + 1))
    if rc == 128 + signal.SIGTERM:  # every process saved the step it stopped at
        stopped = {(out / f"preempted_{i}").read_text() for i in range(2)}
        assert len(stopped) == 1, (stopped, said)
        assert steps[-1] == int(stopped.pop()), (steps, said)
        assert notes[1:] == [
            "[modelshard launch] exit status: process 0 143 (stopped on SIGTERM), process 1 "
            "143 (stopped on SIGTERM)"
        ], said
    else:  # the grace ran out mid-save: said, and not a clean stop
        assert rc == 128 + signal.SIGKILL, said
        killed = [n for n in notes if "was still running 30 s after SIGTERM" in n]
        assert killed and all(
            n.endswith(
                "was killed: whatever it was saving (a checkpoint) was cut short; give it "
                "more time with --grace"
            )
            for n in killed
        ), said
