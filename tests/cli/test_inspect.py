"""``modelshard inspect`` (``_cli/inspect.py``): checkpoints, plain Orbax, manager steps and files,
as tables and JSON."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms
from helpers import one_line
from modelshard.cli import main


def test_inspect_table_and_json(ckpt, capsys):
    assert main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "embed/embedding" in out and "P(None, 'data')" in out
    assert "19 array leaves, 11.01 KiB; kind nnx.Module; saved on mesh (data=8)" in out
    assert main(["inspect", str(ckpt), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "nnx.Module" and data["total_bytes"] == 11276
    leaf = next(x for x in data["leaves"] if x["path"] == "mlp/kernel")
    assert (leaf["shape"], leaf["spec"], leaf["bytes"]) == ([16, 32], [None, "data"], 2048)


def test_inspect_plain_orbax_and_missing(tmp_path, capsys):
    with ocp.StandardCheckpointer() as c:
        c.save(str(tmp_path / "plain"), {"a": {"b": jnp.ones((4, 2))}})
    assert main(["inspect", str(tmp_path / "plain"), "--max-rows", "1"]) == 0
    assert "written by orbax" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "nope")]) == 1
    assert capsys.readouterr().err == (
        f"modelshard inspect: error: no checkpoint at {tmp_path / 'nope'}: the directory does not "
        "exist.\n"
    )


def test_inspect_a_regular_file(tmp_path, capsys):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 8)
    assert main(["inspect", str(tmp_path / "weights.bin")]) == 1
    err = one_line(capsys.readouterr().err, "inspect")
    assert "is a file, not a checkpoint directory" in err and "does not exist" not in err


MARKUP_RULES = r"""
[[rules]]
pattern = 'attn/w[qkv]$'
spec = ["none", "model"]

[[rules]]
pattern = 'norm\d?/weight$'
spec = []

[[rules]]
pattern = '\[bold\]'
spec = ["model"]
"""


def test_tables_show_user_text_literally(tmp_path, capsys):
    """Rule patterns, paths and names reach rich tables as written: ``[qkv]`` and ``[bold]``
    are not markup, ``\\d`` is not doubled (plan and inspect tables)."""
    mesh = ms.make_mesh({"data": 2, "model": 4})
    state = {
        "attn": {"wq": jnp.ones((8, 8)), "wk": jnp.ones((8, 8))},
        "norm1": {"weight": jnp.ones((8,))},
        "[bold]emb[/bold]": jnp.ones((16, 8)),
    }
    path = ms.save(tmp_path / "ck[red]pt", ms.shard(state, P(), mesh))
    (tmp_path / "tp.toml").write_text(MARKUP_RULES)
    argv = ["plan", str(path), "--mesh", "data=2,model=4", "--rules", str(tmp_path / "tp.toml")]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[4:8] == [
        r"│ [bold]emb[/bold] │ (16, 8) │ float32 │ P('model')       │      128 B │ rule 2 '\[bold\]'        │",
        "│ attn/wk          │ (8, 8)  │ float32 │ P(None, 'model') │       64 B │ rule 0 'attn/w[qkv]$'    │",
        "│ attn/wq          │ (8, 8)  │ float32 │ P(None, 'model') │       64 B │ rule 0 'attn/w[qkv]$'    │",
        r"│ norm1/weight     │ (8,)    │ float32 │ P()              │       32 B │ rule 1 'norm\d?/weight$' │",
    ]
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    title = "".join(line.strip() for line in out.split("┏")[0].splitlines())
    assert title == str(path)  # the title wraps to the table's width; "[red]" stays
    assert "│ [bold]emb[/bold] │ (16, 8) │ float32 │" in out


def test_inspect_folds_like_plan_in_record_order(tmp_path, capsys):
    """Leaves that differ only in layer numbers share a row, in the order the state
    flattens (the record's order; ``layers/10`` after ``layers/9``); --no-fold lists each."""
    state = {
        "layers": [{"w": jnp.ones((8, 4)), "b": jnp.ones(4)} for _ in range(12)],
        "head": jnp.ones((4, 2)),
    }
    mesh = ms.make_mesh({"data": 8})
    path = ms.save(
        tmp_path / "ck", ms.shard(state, ms.Rules([("w$", P("data")), (".*", P())]), mesh)
    )
    assert main(["inspect", str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[1:8] == [
        "┏━━━━━━━━━━━━━━━━━━┳━━━━━━━━┳━━━━━━━━┳━━━━━━━━━┳━━━━━━━━━━━┳━━━━━━━━━━━━┳━━━━━━━┓",
        "┃ path             ┃ leaves ┃ shape  ┃ dtype   ┃     bytes ┃ saved spec ┃ names ┃",
        "┡━━━━━━━━━━━━━━━━━━╇━━━━━━━━╇━━━━━━━━╇━━━━━━━━━╇━━━━━━━━━━━╇━━━━━━━━━━━━╇━━━━━━━┩",
        "│ head             │      1 │ (4, 2) │ float32 │      32 B │ P()        │ -     │",
        "│ layers/{0..11}/b │     12 │ (4,)   │ float32 │  16 B x12 │ P()        │ -     │",
        "│ layers/{0..11}/w │     12 │ (8, 4) │ float32 │ 128 B x12 │ P('data')  │ -     │",
        "└──────────────────┴────────┴────────┴─────────┴───────────┴────────────┴───────┘",
    ]
    assert main(["inspect", str(path), "--no-fold", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    order = [r["path"] for r in doc["rows"]]
    assert (
        order
        == [leaf["path"] for leaf in doc["leaves"]]
        == [
            "head",
            *[f"layers/{i}/{n}" for i in range(12) for n in ("b", "w")],
        ]
    )
    assert main(["inspect", str(path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows[2] == {
        "path": "layers/{0..11}/w",
        "count": 12,
        "shape": [8, 4],
        "dtype": "float32",
        "spec": ["data"],
        "names": None,
        "bytes": 128,
        "paths": [f"layers/{i}/w" for i in range(12)],
    }
    assert main(["plan", str(path), "--mesh", "data=8", "--no-fold", "--max-rows", "2"]) == 0
    assert "... 23 more rows (23 leaves); run without --max-rows to show all" in (
        capsys.readouterr().out.splitlines()
    )


def test_inspect_of_a_manager_step_names_its_items_and_metrics(tmp_path, capsys):
    with ms.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(2, {"w": jnp.ones((8, 2))}, items={"data": {"pos": 2}}, metrics={"loss": 0.5})
    assert main(["inspect", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().out.splitlines()[-2:] == [
        "items: data (CheckpointManager.items; --json shows them)",
        "metrics: loss=0.5",
    ]


def test_inspect_json_of_a_step_directory_gives_its_step(tmp_path, capsys):
    """A step directory (or its ``state`` item) given itself reports its step, as its root
    does; a checkpoint named by a number is no step."""
    with ms.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(15, {"w": jnp.ones((8, 2))}, items={"data": {"pos": 2}})
    plain = ms.save(tmp_path / "5", {"w": jnp.ones(2)})
    capsys.readouterr()
    for given, step in [("run", 15), ("run/15", 15), ("run/15/state", 15), ("5", None)]:
        assert main(["inspect", str(tmp_path / given), "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert (given, doc["step"], doc.get("items")) == (
            given,
            step,
            None if step is None else {"data": {"pos": 2}},
        )
    assert plain == tmp_path / "5"


def test_inspect_lists_the_python_values(tmp_path, capsys):
    """The values a checkpoint holds beside its arrays are listed, text and JSON."""
    path = ms.save(tmp_path / "c", {"w": jnp.ones(2), "epoch": 3, "name": "run1", "lr": 0.1})
    capsys.readouterr()
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "values: epoch=3, lr=0.1, name='run1'" in out.splitlines()
    assert main(["inspect", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(v["path"], v["type"], v["value"]) for v in data["values"]] == [
        ("epoch", "int", 3),
        ("lr", "float", 0.1),
        ("name", "str", "run1"),
    ]


def _out_of_line(tree_dir, at_least):
    """The one data file holding an array stored out of line (the index keeps values of up
    to 1,024 bytes itself)."""
    (f,) = [f for f in tree_dir.glob("ocdbt.process_*/d/*") if f.stat().st_size >= at_least]
    return f


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_inspect_names_a_lost_data_file_and_its_arrays(tmp_path, capsys, damage):
    """``inspect`` exited 0 on a checkpoint whose data file was deleted or cut short (only
    the restore failed): it stats every file the OCDBT index refers to and names it."""
    path = ms.save(tmp_path / "c", {"embed": jnp.arange(4096.0), "b": jnp.ones(3)})
    f = _out_of_line(path, 16384)
    if damage == "deleted":
        f.unlink()
        what = "missing"
    else:
        with open(f, "r+b") as fh:
            fh.truncate(100)
        # the array's 16,384 bytes, and whatever of the database's own nodes OCDBT put after
        # them in the same file (it varies with the timing of the commits)
        what = r"cut short: 100 bytes, the index needs (\d+)"
    capsys.readouterr()
    assert main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (
        f"modelshard inspect: error: checkpoint {path} is damaged: 1 file of its OCDBT "
        "database is missing or cut short:"
    )
    line = re.fullmatch(rf"  {re.escape(str(f))}: {what}; it holds the array embed", err[1])
    assert line is not None and int(line.groups()[0] if line.groups() else 16384) >= 16384
    assert err[2:] == ["Restore a complete copy of the checkpoint."]
    assert main(["inspect", str(path), "--json"]) == 1
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["type"] == "CheckpointError"
    assert re.search(rf"  {re.escape(str(f))}: {what}; ", error["message"])


def test_inspect_names_a_lost_data_file_of_a_plain_orbax_checkpoint(tmp_path, capsys):
    path = tmp_path / "plain"
    with ocp.StandardCheckpointer() as c:
        c.save(str(path), {"a": {"b": jnp.arange(8192.0)}, "c": jnp.ones(2)})
    f = _out_of_line(path, 1024)
    f.unlink()
    assert main(["inspect", str(path)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"modelshard inspect: error: checkpoint {path} is damaged: 1 file of its OCDBT "
        "database is missing or cut short:",
        f"  {f}: missing; it holds the array a/b",
        "Restore a complete copy of the checkpoint.",
    ]
