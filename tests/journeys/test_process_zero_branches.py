"""The rule of issue 31, checked on the source: nothing that needs every process runs in a
branch only process 0 takes.

A collective (a device computation over an array spanning processes, an Orbax call with
barriers, ``distributed.barrier``/``broadcast``/``gather``) entered by process 0 alone hangs
or aborts the run; ``ms.save`` hung so (the record's checksums, collectives, taken while
process 0 wrote it). Every ``if`` in ``src`` whose condition asks which process this is may
call only what is listed here as local work (files, locks, JSON), each checked not to call a
collective itself. A new call in such a branch fails this test until it is known to be
local: compute what every process must compute before the branch, then branch.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from pathlib import Path

SRC = Path(__file__).parents[2] / "src" / "modelshard"

# Conditions that single out processes.
PROCESS_TESTS = ("process_index", "_primary", "primary", "is_main_process", "process == 0")

# What a collective is called by (modelshard's, JAX's, Orbax's).
COLLECTIVES = {
    "barrier", "broadcast", "gather", "to_host", "process_allgather", "sync_global_devices",
    "broadcast_one_to_all", "reached_preemption_sync_point", "resolve", "collect",
    "checksums", "held_sums", "device_get", "block_until_ready", "wait_until_finished",
    "Checkpointer", "AsyncCheckpointer", "save", "restore", "jit",
}  # fmt: skip

# Plain local work: the file system, locks, JSON, text.
LOCAL = {
    "mkdir", "exists", "is_dir", "iterdir", "rename", "rmtree", "unlink", "write_text",
    "open", "close", "flock", "dumps", "time_ns", "format", "range", "len", "type", "pop",
    "keep", "metrics", "CheckpointError", "ForeignStepError", "to_json", "sorted",
}  # fmt: skip

# modelshard's own functions called in those branches: local work, checked one level down.
OURS = {
    "remove_leftovers", "_exchange", "fsync_dir", "write_durable", "_make_room",
    "complete_steps", "reaching", "remove_partial", "delete_step", "_finalize",
    "tree_metadata", "sharding_file", "marked_metadata",
    "kvstore", "merge", "orbax_name", "_commit", "foreign_steps", "refusal",
    "remove_numbered", "purge_rotated", "adopted_steps", "warn_foreign", "_write_adapter",
}  # fmt: skip


def _name(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _calls(nodes: Sequence[ast.AST]) -> set[str]:
    return {n for b in nodes for c in ast.walk(b) if isinstance(c, ast.Call) if (n := _name(c))}


def _branches() -> list[tuple[str, str, list[ast.AST]]]:
    """Every ``if`` statement and ``a if ... else b`` whose condition singles out
    processes: (where, condition, what runs on either side)."""
    out = []
    for f in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.If | ast.IfExp):
                test = ast.unparse(node.test)
                if any(t in test for t in PROCESS_TESTS):
                    sides = [*node.body, *node.orelse] if isinstance(node, ast.If) else [
                        node.body, node.orelse
                    ]  # fmt: skip
                    out.append((f"{f.relative_to(SRC)}:{node.lineno}", test, sides))
    return out


def _defs() -> dict[str, list[ast.FunctionDef]]:
    out: dict[str, list[ast.FunctionDef]] = {}
    for f in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name in OURS:
                out.setdefault(node.name, []).append(node)
    return out


def test_branches_that_single_out_processes_call_only_local_work():
    branches = _branches()
    assert len(branches) >= 10  # the scan sees the save, manager and stream branches
    bad = []
    for where, test, sides in branches:
        for name in sorted(_calls(sides)):
            if name in COLLECTIVES or name not in LOCAL | OURS:
                bad.append(f"{where}: if {test}: calls {name}")
    assert bad == [], "\n".join(bad)


def test_the_local_functions_they_call_call_no_collective():
    defs = _defs()
    assert sorted(defs) == sorted(OURS)  # each name is still a function of ours
    bad = [
        f"{name} calls {c}"
        for name, nodes in defs.items()
        for node in nodes
        for c in sorted(_calls(node.body) & COLLECTIVES)
    ]
    assert bad == [], "\n".join(bad)


def test_a_record_is_written_only_once_resolved():
    """Writing a record never resolves it (a collective) where it is written: process 0's
    branch. An unresolved record refuses instead."""
    import jax
    import jax.numpy as jnp
    import pytest

    from modelshard._checkpoint.shards import held_sums, take
    from modelshard._checkpoint.write import prepare

    arrays, record = prepare({"w": jnp.arange(8.0), "k": jax.random.key(0)})
    keys = [leaf.key for leaf in record.leaves]
    record.pending = held_sums(keys, take(arrays, copy=False), "test")
    with pytest.raises(RuntimeError, match="call resolve\\(\\) on every process"):
        record.dumps()
    record.resolve()
    assert '"checksum"' in record.dumps()
