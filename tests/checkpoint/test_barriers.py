"""The waits of modelshard's saves, with two real JAX processes (``scripts/``): a stuck peer
named after ``MODELSHARD_BARRIER_TIMEOUT``, and a part of a save failing on one process
failing on every process at once (``distributed.raise_shared`` in ``shards``, ``write``,
``remote`` and ``step_writer``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import two_processes
from modelshard._checkpoint.storage import staging_dir

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.mark.multiprocess
@pytest.mark.skipif(sys.platform != "linux", reason="multi-process tests run on Linux")
def test_a_background_step_waits_the_barrier_timeout_and_names_its_wait(tmp_path):
    """Process 1 is stuck before its step: process 0's background step waits for it for
    ``MODELSHARD_BARRIER_TIMEOUT`` and ``wait_until_finished`` raises modelshard's
    ``DistributedError``, naming the wait and the variable."""
    env = {"MODELSHARD_BARRIER_TIMEOUT": "6", "MODELSHARD_HEARTBEAT_TIMEOUT": "5"}
    root = tmp_path / "run"
    # process 0 exits right after its result, which the runtime then tells process 1
    codes, outputs = two_processes(
        str(root), str(tmp_path), env=env, script=SCRIPTS / "stuck_peer.py", limit_s=90
    )
    said = "\n".join(f"--- process {i} ---\n{o[-3000:]}" for i, o in enumerate(outputs))
    assert codes[0] == 0, said
    result = json.loads((tmp_path / "result_0.json").read_text())
    assert result["raised"] is not None, said
    assert result["raised"]["type"] == "DistributedError", result
    message = result["raised"]["message"]
    key = "modelshard:manager:step:arrays"
    assert message.startswith(
        f"process 0 of 2: gather {key!r} failed after waiting up to 6 s for the other "
        "processes (MODELSHARD_BARRIER_TIMEOUT sets the wait): "
    ), message
    assert message.endswith(
        "Another process died, is stuck, or took another path through the program (every "
        "process must make the same calls in the same order)."
    ), message
    assert 6 <= result["seconds"] < 6 + 20, result
    assert not (root / "0").exists()


@pytest.mark.multiprocess
@pytest.mark.skipif(sys.platform != "linux", reason="multi-process tests run on Linux")
def test_a_save_failing_on_one_process_fails_on_every_process_at_once(tmp_path, s3_root):
    """``ms.save`` (and a ``CheckpointManager``'s save, synchronous or in the background)
    where one process's part fails (its arrays on a full disk, process 0's rename on a
    read-only one, an object store refusing one process): both processes raise
    the same error at once, naming the process, instead of the other one waiting at the
    next barrier for the barrier timeout; nothing is left behind, and the next save of both
    processes works."""
    root = tmp_path / "saves"
    env = {"MODELSHARD_BARRIER_TIMEOUT": "120", "MODELSHARD_HEARTBEAT_TIMEOUT": "10"}
    script = SCRIPTS / "save_fails_on_one.py"
    codes, outputs = two_processes(
        str(root), str(tmp_path), s3_root, env=env, script=script, limit_s=200
    )
    said = "\n".join(f"--- process {i} ---\n{o[-3000:]}" for i, o in enumerate(outputs))
    assert codes == [0, 0], said
    results = [json.loads((tmp_path / f"result_{i}.json").read_text()) for i in range(2)]
    full = "OSError: No space left on device (injected)"
    io = "OSError: Input/output error (injected)"
    want = {
        "arrays": f"writing {staging_dir(root / 'arrays')} failed on process 1: {full}",
        "commit": f"committing {root / 'commit'} failed on process 0: OSError: Read-only file "
        "system (injected)",
        "s3": f"writing {s3_root}/arrays/state failed on process 1: {full}",
        "manager": f"step 0 was not saved to {root / 'manager'}: CheckpointError: writing "
        f"{root / 'manager' / '0.orbax-checkpoint-tmp' / 'state'} failed on process 1: {full}",
        "background": f"step 0 was not saved to {root / 'background'}: CheckpointError: "
        f"writing {root / 'background' / '0.orbax-checkpoint-tmp' / 'state'} failed on "
        f"process 1: {full}. Steps on disk: none.",
        # process 1's summing failed: both processes raise its error
        "background checksums": f"step 0 was not saved to {root / 'background_checksums'}: "
        f"CheckpointError: summing the checksums failed on process 1: {io}. Steps on disk: none.",
        "manager checksums": f"step 0 was not saved to {root / 'manager_checksums'}: "
        f"CheckpointError: summing the checksums failed on process 1: {io}",
    }
    for r in results:
        for case, message in want.items():
            assert r[case]["raised"] == {"type": "CheckpointError", "message": message}, r
            assert r[case]["seconds"] < 60, r  # not the 120 s barrier timeout
        assert r["after"]["raised"] is None and r["after"]["bit_exact"] is True, r
        assert r["manager"]["steps after"] == [1], r  # in step: the next save worked
        assert r["background started"] is True, r  # the failure came after save returned
        assert r["background"]["steps after"] == [1], r
    for case in ("arrays", "commit"):
        assert not (root / case).exists() and not staging_dir(root / case).exists()
    assert sorted(p.name for p in root.iterdir()) == [
        "after",
        "background",
        "background_checksums",
        "manager",
        "manager_checksums",
    ]
