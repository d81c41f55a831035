"""CheckpointManager exit safety: every way a training script ends, in a real subprocess.

Each child saves steps 0 and 1, then step 2 asynchronously with Orbax's finalize held
back, so step 2 is still being written when the script ends. Before this guard, a
script's end lost step 2 (and could hang for minutes in Orbax's signalling threads)
while exiting 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import modelshard as ms
from helpers import launch_argv

# one worker runs this file (its module fixtures start processes once)
pytestmark = pytest.mark.xdist_group("manager-exit")

CHILD = Path(__file__).parent / "manager_scripts" / "exit_child.py"
N = 1 << 16
LIMIT_S = 90


def run_child(root, mode, send=None):
    """Run the child to its end (SIGKILL after LIMIT_S); ``send`` a signal after READY."""
    return run_script([str(CHILD), str(root), mode], send)


def run_script(argv, send=None):
    """Run ``python *argv`` to its end (SIGKILL after LIMIT_S), sending ``send`` after it
    prints READY: its exit status, stdout lines, stderr and wall time."""
    proc = subprocess.Popen(
        [sys.executable, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    timer = threading.Timer(LIMIT_S, proc.kill)
    timer.start()
    start = time.monotonic()
    try:
        out = []
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line.strip())
            if line.strip() == "READY" and send is not None:
                os.kill(proc.pid, send)
        err = proc.stderr.read() if proc.stderr else ""
        proc.wait(timeout=LIMIT_S)
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wall = time.monotonic() - start
    return proc.returncode, out, err, wall


# These endings run side by side, once per session (each child mostly waits on its held
# back save, so together they take about as long as the slowest one).
SIGNALS = {"sigterm": signal.SIGTERM, "cooperative": signal.SIGTERM, "sigint": signal.SIGINT}
TOGETHER = [
    "end",
    "with_raises",
    "exit3",
    "raises",
    "sigterm",
    "sigint",
    "cooperative",
    "lost",
    "fails",
]


@pytest.fixture(scope="module")
def ended(tmp_path_factory):
    from concurrent.futures import ThreadPoolExecutor

    roots = {mode: tmp_path_factory.mktemp(mode) for mode in TOGETHER}
    with ThreadPoolExecutor(4) as pool:
        futures = {
            mode: pool.submit(run_child, roots[mode], mode, SIGNALS.get(mode)) for mode in TOGETHER
        }
        return {mode: (roots[mode], *f.result()) for mode, f in futures.items()}


def child(ended, mode):
    root, code, out, err, wall = ended[mode]
    assert wall < LIMIT_S, f"{mode}: killed after {wall:.0f} s (a hang)"
    return root, code, out, err, wall


def assert_step(root, step):
    """``step`` is complete and holds exactly what the child saved."""
    with ms.CheckpointManager(root, handle_signals=False) as mngr:
        assert step in mngr.all_steps()
        out = mngr.restore(step)
    np.testing.assert_array_equal(np.asarray(out["w"]), np.arange(N, dtype=np.float32) + step)
    want = jax.random.key_data(jax.random.fold_in(jax.random.key(0), step))
    np.testing.assert_array_equal(jax.random.key_data(out["k"]), want)


@pytest.mark.parametrize(("mode", "rc"), [("end", 0), ("with_raises", 1)])
def test_script_end_finishes_the_pending_save(ended, mode, rc):
    root, code, out, err, _ = child(ended, mode)
    assert code == rc, err
    assert out[-1] == "READY"
    assert_step(root, 2)
    assert ms.CheckpointManager(root, handle_signals=False).all_steps() == [0, 1, 2]
    if mode != "end":
        assert "RuntimeError: the training step failed" in err


@pytest.mark.parametrize(("mode", "rc"), [("exit3", 3), ("raises", 1)])
def test_sys_exit_or_an_uncaught_error_keeps_its_status_and_the_save(ended, mode, rc):
    root, code, _, err, _ = child(ended, mode)
    assert code == rc, err
    assert_step(root, 2)


def test_sigterm_finishes_the_pending_save_then_dies_of_it(ended):
    root, code, _, _, _ = child(ended, "sigterm")
    # the default action of the signal, after the save: what the scheduler expects
    assert code in (-signal.SIGTERM, 128 + signal.SIGTERM)
    assert_step(root, 2)


def test_sigint_finishes_the_pending_save_then_dies_of_it(ended):
    root, code, _, _, _ = child(ended, "sigint")
    assert code in (-signal.SIGINT, 128 + signal.SIGINT)
    assert_step(root, 2)


@pytest.mark.slow
def test_a_self_sent_sigterm(tmp_path):
    code, _, _, wall = run_child(tmp_path, "kill_self")
    assert wall < LIMIT_S
    assert code in (-signal.SIGTERM, 128 + signal.SIGTERM)
    assert_step(tmp_path, 2)


def test_cooperative_loop_saves_the_step_it_was_stopped_at(ended):
    root, code, out, err, _ = child(ended, "cooperative")
    stopped = int(out[-1].removeprefix("PREEMPTED "))
    assert stopped >= 3
    assert code == 128 + signal.SIGTERM, err  # sys.exit(0) after a stop is not success
    assert ms.CheckpointManager(root, handle_signals=False).all_steps() == [0, stopped]
    assert_step(root, stopped)


def test_save_that_cannot_be_finished_is_reported_and_fails_the_exit(ended):
    root, code, _, err, _ = child(ended, "lost")
    assert code == 1
    assert f"step 2 of {root} is still being written" in err
    assert "LOST" in err
    assert ms.CheckpointManager(root, handle_signals=False).all_steps() == [0, 1]


def test_failed_background_save_fails_the_exit_and_names_the_step(ended):
    root, code, _, err, _ = child(ended, "fails")
    assert code == 1
    assert f"NOT SAVED (the main module ended): step 2 was not saved to {root}: " in err
    assert "No space left on device" in err
    with ms.CheckpointManager(root, handle_signals=False) as mngr:
        assert mngr.all_steps() == [0, 1]
    assert_step(root, 1)


RESUME = Path(__file__).parent / "manager_scripts" / "resume_child.py"


def _run_resume(root, send=None):
    code, out, err, _ = run_script([str(RESUME), str(root)], send)
    return code, out, err


def _uninterrupted(total=30):
    """resume_child.py's run, never stopped, in this process (the same jitted steps)."""
    import jax.numpy as jnp

    @jax.jit
    def update(w, key, pos):
        return w * 0.99 + jax.random.normal(key, w.shape) * 0.01 + pos * 1e-4

    w, key = jnp.zeros((256,), jnp.float32), jax.random.key(0)
    for pos in range(total):
        key, sub = jax.random.split(key)
        w = update(w, sub, pos)
    return np.asarray(w), key


def test_preempted_and_resumed_run_ends_bit_exact(tmp_path):
    code, out, err = _run_resume(tmp_path, send=signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, err
    at = int(out[-1].removeprefix("PREEMPTED "))
    assert 5 < at < 30
    assert ms.CheckpointManager(tmp_path, handle_signals=False).all_steps() == [at]
    code, out, err = _run_resume(tmp_path)
    assert code == 0, err
    assert out[0] == f"RESUMED {at}" and out[-1] == "DONE"
    mngr = ms.CheckpointManager(tmp_path, handle_signals=False)
    assert mngr.latest_step() == 30
    got, items = np.asarray(mngr.restore()["w"]), mngr.items()
    want, key = _uninterrupted()
    assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist()
    assert items["data"] == {"pos": 30}
    np.testing.assert_array_equal(jax.random.key_data(items["rng"]), jax.random.key_data(key))


def _launch(root, *extra):
    cmd = launch_argv(
        sys.executable, str(CHILD.parent / "preempt_mp.py"), str(root), *extra,
        devices=2, timeout=150,
    )  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.slow
def test_preemption_under_launch_saves_one_step_everywhere_and_resumes_bit_exact(tmp_path):
    """SIGTERM to one of two jax.distributed processes: JAX's preemption sync point makes
    both save the same step and exit 143; the resumed run ends where an unstopped one does."""
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    rc, out = _launch(whole)
    assert rc == 0, out
    rc, out = _launch(stopped, "--stop")
    assert rc == 128 + signal.SIGTERM, out
    at = {line.split()[-1] for line in out.splitlines() if "PREEMPTED" in line}
    assert len(at) == 1, out  # the same step on both processes
    (step,) = at
    assert ms.CheckpointManager(stopped, handle_signals=False).all_steps() == [int(step)]
    rc, out = _launch(stopped)
    assert rc == 0, out
    assert f"[process 0] RESUMED {step}" in out and f"[process 1] RESUMED {step}" in out
    a = ms.CheckpointManager(whole, handle_signals=False)
    b = ms.CheckpointManager(stopped, handle_signals=False)
    assert a.latest_step() == b.latest_step() == 40
    wa, wb = np.asarray(a.restore()["w"]), np.asarray(b.restore()["w"])
    assert wa.view(np.uint32).tolist() == wb.view(np.uint32).tolist()
    ka, kb = a.items()["rng"], b.items()["rng"]
    np.testing.assert_array_equal(jax.random.key_data(ka), jax.random.key_data(kb))
