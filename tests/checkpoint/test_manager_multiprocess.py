"""CheckpointManager on two real JAX processes (2 x 4 CPU devices, gloo, localhost) that save
every step, the way a training run does, and a peer that dies while they do.

The processes run ``tests/mp_scripts/save_every_step.py``: a ``{"w": [512, 512], "b": [512]}``
state on a ``(data=2, model=4)`` mesh, plus one and an asynchronous save every step,
``max_to_keep=3``. They are started by ``modelshard launch`` or, as a cluster scheduler does,
each with its own ``MODELSHARD_*`` environment. Every run is bounded (SIGKILL backstop), and
each uses its own coordinator port.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import modelshard as ms
from helpers import launch_argv
from modelshard._runtime import processes as _launch

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(sys.platform != "linux", reason="multi-process tests run on Linux"),
]

SCRIPT = Path(__file__).parents[1] / "mp_scripts" / "save_every_step.py"
FAILS = Path(__file__).parent / "manager_scripts" / "background_fails.py"
STEPS = 20
LIMIT_S = 150  # a backstop for a loaded 2-core machine, not an expectation
HEARTBEAT_S = 5  # MODELSHARD_HEARTBEAT_TIMEOUT for the runs where a process dies
# The documented bound (docs/guides/multi-host.md): a survivor is stopped once the runtime
# has missed the dead process's heartbeats for HEARTBEAT_S; the rest is slack for the
# error's propagation and the process's exit on a machine shared by several test runs.
SURVIVOR_BOUND_S = HEARTBEAT_S + 25


def initial() -> dict[str, np.ndarray]:
    """What the script starts from (its step s holds these plus s + 1, exactly)."""
    return {
        "w": (np.arange(512 * 512) % 4096).astype(np.float32).reshape(512, 512) / 8,
        "b": np.arange(512, dtype=np.float32) / -8,
    }


def by_launch(root: Path, out: Path, *args: str) -> tuple[list[int], str]:
    cmd = launch_argv(sys.executable, str(SCRIPT), str(root), str(out), *args, timeout=LIMIT_S)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT_S + 30)
    return [proc.returncode], proc.stdout + proc.stderr


def by_environment(
    root: Path,
    out: Path,
    *args: str,
    extra_env: dict[str, str] | None = None,
    script: Path = SCRIPT,
    limit_s: float = LIMIT_S,
) -> tuple[list[int], list[str], list[float]]:
    """Start both processes of ``script`` as a scheduler would: each with its MODELSHARD_*
    variables and nothing watching over them (SIGKILLed after ``limit_s``). Returns each
    one's exit code, output and end time."""
    reservation = _launch.reserve_port()
    port = reservation.getsockname()[1] if reservation is not None else _launch.free_port()
    procs = []
    try:
        for i in range(2):
            env = _launch.child_env(dict(os.environ), f"127.0.0.1:{port}", 2, i, 4)
            env.update(extra_env or {})
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), str(root), str(out), *args],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        outputs = ["", ""]
        ended = [0.0, 0.0]

        def read(i: int) -> None:
            assert procs[i].stdout is not None
            outputs[i] = procs[i].stdout.read()
            procs[i].wait()
            ended[i] = time.time()

        readers = [threading.Thread(target=read, args=(i,)) for i in range(2)]
        for t in readers:
            t.start()
        for t in readers:
            t.join(limit_s)
    finally:
        for p in procs:  # the backstop: nothing outlives the test
            if p.poll() is None:
                p.kill()
                p.wait()
        if reservation is not None:
            reservation.close()
    return [p.returncode for p in procs], outputs, ended


def check_root(root: Path, *, at_most: int) -> int:
    """Read ``root`` from this fresh process (one process, 8 devices): every listed step is
    complete and restores bit-exact; return the latest."""
    with ms.CheckpointManager(root, max_to_keep=3, handle_signals=False) as mngr:
        steps = mngr.all_steps()
        assert steps, sorted(p.name for p in root.iterdir())
        assert len(steps) <= 3 and steps[-1] <= at_most, steps
        for step in steps:
            restored = mngr.restore(step)
            for k, want in initial().items():
                np.testing.assert_array_equal(np.asarray(restored[k]), want + np.float32(step + 1))
        return steps[-1]


@pytest.mark.parametrize("how", ["launch", "environment"])
def test_two_processes_save_every_step_for_a_whole_run(tmp_path, how):
    root, out = tmp_path / "run", tmp_path
    t0 = time.monotonic()
    if how == "launch":
        codes, output = by_launch(root, out, "--steps", str(STEPS))
    else:
        codes, outputs, _ = by_environment(root, out, "--steps", str(STEPS))
        output = "\n".join(outputs)
    print(f"{how}: {time.monotonic() - t0:.1f} s")
    assert codes == [0] * len(codes), output
    for i in range(2):
        result = json.loads((out / f"result_{i}.json").read_text())
        # every save completed, the last three kept, the latest restored bit-exact on the
        # (data=2, model=4) mesh of the two processes
        assert result["steps"] == [STEPS - 3, STEPS - 2, STEPS - 1], result
        assert result["bit_exact"] is True
    assert check_root(root, at_most=STEPS - 1) == STEPS - 1


def killed_while_saving(tmp_path: Path, victim: int) -> None:
    root, out = tmp_path / "run", tmp_path
    kill_at = 6
    codes, outputs, ended = by_environment(
        root,
        out,
        "--steps",
        "200",
        "--kill-at",
        str(kill_at),
        "--victim",
        str(victim),
        extra_env={"MODELSHARD_HEARTBEAT_TIMEOUT": str(HEARTBEAT_S)},
    )
    survivor = 1 - victim
    assert codes[victim] == -9, outputs[victim]
    killed = float((out / "killed").read_text())
    waited = ended[survivor] - killed
    print(f"survivor {survivor} stopped {waited:.1f} s after process {victim} was killed")
    # the survivor fails (it can never finish the run), with the runtime's reason, in time
    assert codes[survivor] != 0, outputs[survivor]
    assert (
        "Terminating process because the JAX distributed service detected fatal errors"
        in (outputs[survivor])
    ), outputs[survivor][-3000:]
    assert waited < SURVIVOR_BOUND_S, (waited, outputs[survivor][-3000:])
    assert not (out / f"result_{survivor}.json").exists()
    # a fresh process finds only complete steps (the one being written when the peer
    # died is either committed by both or not listed), the latest restores bit-exact
    latest = check_root(root, at_most=kill_at)
    assert latest >= kill_at - 1, latest


def test_a_peer_killed_while_saving_every_step_stops_the_survivor(tmp_path):
    killed_while_saving(tmp_path, victim=1)


@pytest.mark.slow
def test_the_coordinator_process_killed_while_saving_stops_the_survivor(tmp_path):
    killed_while_saving(tmp_path, victim=0)


def test_a_save_failing_on_one_process_fails_on_every_process(tmp_path):
    """Process 1's part of step 3 fails (an injected OSError once it is written): the next
    save raises on both processes, the same error, naming the process, and neither hangs."""
    root, out = tmp_path / "run", tmp_path
    codes, outputs, _ = by_environment(root, out, "--steps", "8", "--fail-after", "3")
    assert codes == [0, 0], outputs
    errors = [json.loads((out / f"result_{i}.json").read_text())["error"] for i in range(2)]
    assert errors[0] == errors[1], errors
    assert errors[0].startswith(
        f"step 3 was not saved to {root}: process 1: OSError: disk quota exceeded (injected). "
        "Steps on disk: "
    ), errors[0]


def test_a_background_step_failing_on_one_process_raises_on_every_process_at_once(tmp_path):
    """An asynchronous manager's step 1 fails on one process after ``save`` returned: its
    arrays on a full disk (process 1), or the finish of the arrays (process 0, the merge of
    the processes' OCDBT databases). Every process raises the same error from
    ``wait_until_finished`` within seconds (the barrier timeout is 120 s), naming the
    process and its cause; step 0 stays the latest step, bit-exact, and step 1 saves next."""
    root, out = tmp_path / "run", tmp_path
    env = {"MODELSHARD_BARRIER_TIMEOUT": "120", "MODELSHARD_HEARTBEAT_TIMEOUT": "10"}
    codes, outputs, _ = by_environment(root, out, extra_env=env, script=FAILS, limit_s=90)
    said = "\n".join(f"--- process {i} ---\n{o[-3000:]}" for i, o in enumerate(outputs))
    assert codes == [0, 0], said
    results = [json.loads((out / f"result_{i}.json").read_text()) for i in range(2)]
    for case in ("disk", "commit"):
        raised = [r[case]["raised"] for r in results]
        assert raised[0] == raised[1], raised  # the same error on both
        assert raised[0]["type"] == "CheckpointError", raised
        message = raised[0]["message"]
        if case == "disk":  # TensorStore's own text names the file it could not write
            assert message.startswith(
                f"step 1 was not saved to {root / case}: CheckpointError: writing "
                f"{root / case / '1.orbax-checkpoint-tmp' / 'state'} failed on process 1: "
                "ValueError: OUT_OF_RANGE: Error writing "
            ), message
            assert "ocdbt.process_1" in message and "File too large" in message, message
            assert message.endswith(". Steps on disk: 0."), message
        else:
            assert message == (
                f"step 1 was not saved to {root / case}: CheckpointError: writing step 1 "
                "failed on process 0: OSError: No space left on device (injected). Steps on "
                "disk: 0."
            ), message
        for r in results:
            assert r[f"{case} started"] is True, r  # it failed in the background
            assert r[case]["seconds"] < 30, r  # not the 120 s barrier timeout
            assert r[case]["steps"] == [0] and r[case]["bit_exact"] is True, r
            assert r[case]["steps after"] == [0, 1], r
