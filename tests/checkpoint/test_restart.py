"""Restarts after a host died: two real JAX processes (2 x 4 CPU devices) save every step
with ``CheckpointManager``, one is SIGKILLed while a step is being written, and both are
started again, three times in a row, on a local disk and on ``s3://`` (moto on 127.0.0.1).

Each restart must resume from the latest complete step (restored bit-exact) and save the
interrupted step number again: its leftovers are removed first (process 0 decides, every
process agrees), and nothing waits longer than ``MODELSHARD_BARRIER_TIMEOUT``. Every run
is bounded (SIGKILL backstop, after a dump of every thread's stack) and uses its own
coordinator port. A run that fails says what each process did and when (the script notes
each phase, timed), whether the backstop fired, and where the whole outputs are kept
(``run_<n>.log`` in the test's temporary folder).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

import modelshard as ms
from helpers import two_processes
from modelshard._checkpoint import list_steps
from modelshard._checkpoint.storage import staging_dir

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(sys.platform != "linux", reason="multi-process tests run on Linux"),
]

SCRIPTS = Path(__file__).parent / "scripts"
SCRIPT = SCRIPTS / "restart_run.py"
LIMIT_S = 240  # a backstop for a loaded 2-core machine, not an expectation
HEARTBEAT_S = 5
BARRIER_S = 40  # bounds every wait, so a hang fails the run instead of the suite
# The documented bound (docs/guides/multi-host.md): a survivor is stopped once the runtime
# has missed the dead process's heartbeats for HEARTBEAT_S; the rest is slack for the
# error's propagation and the process's exit on a machine shared by several test runs.
SURVIVOR_BOUND_S = HEARTBEAT_S + 25
FATAL = "Terminating process because the JAX distributed service detected fatal errors"


def complete(root: str) -> list[int]:
    return ms.CheckpointManager(root, handle_signals=False).all_steps()


def leftovers(root: str) -> list[int]:
    return [e.step for e in list_steps(root) if not e.complete]


def restarts(root: str, out: Path) -> None:
    env = {
        "MODELSHARD_HEARTBEAT_TIMEOUT": str(HEARTBEAT_S),
        "MODELSHARD_BARRIER_TIMEOUT": str(BARRIER_S),
    }
    interrupted = None  # the step being written when the last host died
    for run, (kill_at, victim) in enumerate([(3, 1), (6, 0), (9, 1), (None, 0)]):
        for f in [*out.glob("result_*.json"), out / "killed"]:
            f.unlink(missing_ok=True)
        kill = [] if kill_at is None else ["--kill-at", str(kill_at), "--victim", str(victim)]
        t0 = time.time()
        ended, stuck = [0.0, 0.0], []
        codes, outputs = two_processes(
            root,
            str(out),
            "--until",
            "11",
            *kill,
            env=env,
            script=SCRIPT,
            limit_s=LIMIT_S,
            ended=ended,
            stuck=stuck,
        )
        took = [e - t0 if e else float("nan") for e in ended]
        # what happened, kept whole: a run that fails once in a while is known by this
        log = out / f"run_{run}.log"
        header = (
            f"run {run} (kill at {kill_at}, victim {victim}): exit codes {codes}, ended after "
            f"{took[0]:.1f} s and {took[1]:.1f} s; "
            + (f"the backstop killed {stuck} after {LIMIT_S} s" if stuck else "no backstop")
        )
        log.write_text(
            header + "".join(f"\n--- process {i} ---\n{o}" for i, o in enumerate(outputs))
        )
        print(header)
        said = f"{header}; whole outputs in {log}\n" + "\n".join(
            f"--- process {i} ---\n{o[-4000:]}" for i, o in enumerate(outputs)
        )
        assert not stuck, said  # a hang: the stacks of every thread end each output
        if interrupted is not None:  # resumed from the step before, saved it again
            for i in range(2):
                assert f"saved {interrupted - 1}\n" not in outputs[i], said
                assert f"saved {interrupted}\n" in outputs[i], said
        if kill_at is None:
            assert codes == [0, 0], said
            assert leftovers(root) == [], list_steps(root)
            continue
        # the victim died; the survivor was stopped by the runtime, not by the backstop,
        # within the heartbeat bound (docs/guides/multi-host.md)
        assert codes[victim] == -9 and codes[1 - victim] not in (0, -9), said
        assert FATAL in outputs[1 - victim], said
        waited = ended[1 - victim] - float((out / "killed").read_text())
        print(f"  the survivor ended {waited:.1f} s after process {victim} died")
        assert waited < SURVIVOR_BOUND_S, (waited, said)
        # the step being written when the host died is not complete: it left leftovers,
        # which the next run removes before it saves that step again
        assert complete(root)[-1] == kill_at - 1, (complete(root), said)
        assert leftovers(root) == [kill_at], (list_steps(root), said)
        interrupted = kill_at
    results = [json.loads((out / f"result_{i}.json").read_text()) for i in range(2)]
    assert results[0] == results[1], results
    assert results[0]["steps"] == [9, 10, 11], results


def test_restarts_after_a_host_died_on_a_local_disk(tmp_path):
    restarts(str(tmp_path / "run"), tmp_path)


@pytest.mark.slow
def test_restarts_after_a_host_died_on_s3(s3_root, tmp_path):
    restarts(s3_root, tmp_path)


def objects(s3_env: dict[str, str], url: str) -> list[str]:
    """The keys under ``url`` as the server lists them (another client: another process)."""
    import boto3

    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    client = boto3.client("s3", endpoint_url=s3_env["AWS_ENDPOINT_URL"])
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def test_steps_another_process_wrote_or_removed_are_seen_on_s3(s3_root, s3_env):
    """s3fs remembers folder listings for the life of a process: a manager must still see
    at once a step another process wrote or removed, and the leftovers it left."""
    import boto3
    import jax.numpy as jnp

    client = boto3.client("s3", endpoint_url=s3_env["AWS_ENDPOINT_URL"])
    bucket, prefix = s3_root.removeprefix("s3://").split("/", 1)
    with ms.CheckpointManager(s3_root, async_save=False, handle_signals=False) as mngr:
        for step in (0, 1):
            mngr.save(step, {"w": jnp.full((8,), step, jnp.float32)})
        assert mngr.all_steps() == [0, 1]
        for key in objects(s3_env, f"{s3_root}/0"):  # another process writes step 3
            copy = {"Bucket": bucket, "Key": key}
            client.copy_object(Bucket=bucket, Key=key.replace("/0/", "/3/", 1), CopySource=copy)
        assert mngr.all_steps() == [0, 1, 3]
        for key in objects(s3_env, f"{s3_root}/1"):  # and removes step 1
            client.delete_object(Bucket=bucket, Key=key)
        assert mngr.all_steps() == [0, 3]
        # another process died while writing step 4: its leftovers, no commit file
        leftover = f"{prefix}/4/state/ocdbt.process_1/d/leftover"
        client.put_object(Bucket=bucket, Key=leftover, Body=b"partial")
        assert mngr.save(4, {"w": jnp.full((8,), 4, jnp.float32)})
        assert mngr.all_steps() == [0, 3, 4]
        assert leftover not in objects(s3_env, s3_root)
        assert float(mngr.restore(4)["w"][0]) == 4.0


def test_a_reshard_write_failing_on_one_process_fails_on_every_process_at_once(tmp_path):
    """Process 1 cannot write its part (a full disk): both processes raise the same error
    at once, naming process 1, instead of process 0 waiting out the barrier timeout."""
    import numpy as np

    src, dst = tmp_path / "src", tmp_path / "dst"
    ms.save(src, {"w": np.arange(64 * 32, dtype=np.float32).reshape(64, 32)})
    env = {"MODELSHARD_BARRIER_TIMEOUT": "120", "MODELSHARD_HEARTBEAT_TIMEOUT": "10"}
    script = SCRIPTS / "reshard_fails_on_one.py"
    codes, outputs = two_processes(
        str(src), str(dst), str(tmp_path), env=env, script=script, limit_s=200
    )
    said = "\n".join(f"--- process {i} ---\n{o[-3000:]}" for i, o in enumerate(outputs))
    assert codes == [0, 0], said
    results = [json.loads((tmp_path / f"result_{i}.json").read_text()) for i in range(2)]
    staging = staging_dir(dst)  # where reshard writes before the rename
    assert len(results) == 2
    for r in results:
        assert r["raised"] == {
            "type": "CheckpointError",
            "message": f"writing {staging} failed on process 1: OSError: No space left on "
            "device (injected)",
        }, results
        assert r["seconds"] < 60, results  # not the 120 s barrier timeout
    assert not dst.exists() and not staging.exists()


def test_calls_after_one_process_skipped_one_meet_the_right_calls(tmp_path):
    """Process 0 raises before a gather, a barrier and a broadcast that process 1 makes;
    process 1 gives up on each after its timeout. The next call of each name meets the
    other process's next call: the gather returns this call's values (not the abandoned
    one's), the barrier passes, the broadcast carries process 0's value, on both."""
    env = {"MODELSHARD_HEARTBEAT_TIMEOUT": "10"}
    script = SCRIPTS / "out_of_step.py"
    codes, outputs = two_processes(str(tmp_path), env=env, script=script, limit_s=150)
    said = "\n".join(f"--- process {i} ---\n{o[-3000:]}" for i, o in enumerate(outputs))
    assert codes == [0, 0], said
    results = [json.loads((tmp_path / f"result_{i}.json").read_text()) for i in range(2)]
    for kind, name in (("gather", "g"), ("barrier", "b"), ("broadcast", "c")):
        assert results[1][f"{kind} skipped"].startswith(
            f"process 1 of 2: {kind} {name!r} failed after waiting up to 1 s for the other "
            "processes (MODELSHARD_BARRIER_TIMEOUT sets the wait): "
        ), results[1]
    for r in results:
        assert r["gather"] == ["from 0", "from 1"], results
        assert r["barrier"] == "passed"
        assert r["broadcast"] == "from 0", results
        assert r["after"] == [0, 1], results


def test_every_process_lists_the_steps_process_0_lists(tmp_path):
    """Process 1's own listing lags (step 1 not in it yet): ``all_steps``, ``latest_step``
    and ``restore()`` still give process 0's answer on both processes."""
    env = {"MODELSHARD_HEARTBEAT_TIMEOUT": "10", "MODELSHARD_BARRIER_TIMEOUT": "60"}
    script = SCRIPTS / "agreed_steps.py"
    codes, outputs = two_processes(
        str(tmp_path / "run"), str(tmp_path), env=env, script=script, limit_s=150
    )
    said = "\n".join(f"--- process {i} ---\n{o[-3000:]}" for i, o in enumerate(outputs))
    assert codes == [0, 0], said
    results = [json.loads((tmp_path / f"result_{i}.json").read_text()) for i in range(2)]
    assert [r["own listing"] for r in results] == [[0, 1], [0]], results  # they differ
    for r in results:
        assert r["all_steps"] == [0, 1] and r["latest_step"] == 1, results
        assert r["restored"] == 1.0, results
