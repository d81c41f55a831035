"""``modelshard reshard`` (``_cli/reshard.py``): in process, its usage errors, and every way the
destination can fail."""

from __future__ import annotations

import errno
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms
from helpers import CONVERT_MAP, assert_bit_exact, boxed_train_state, guide_mlp, one_line
from modelshard.cli import main


def test_reshard_in_process(ckpt, tmp_path, capsys):
    dst = tmp_path / "out"
    rules = str(ckpt.parent / "rules.toml")
    argv = [
        "reshard",
        str(ckpt),
        str(dst),
        "--mesh",
        "data=2,model=4",
        "--rules",
        rules,
        "--dtype",
        "bfloat16",
        "--chunk-mb",
        "0.001",
        "--json",
    ]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary == {
        "schema": 1,
        "command": "reshard",
        "ok": True,
        "source": str(ckpt),
        "step": None,
        "destination": str(dst),
        "mesh": {"data": 2, "model": 4},
        "leaves": 19,
        "bytes": 5644,
        "dropped": {"items": [], "metrics": []},
    }
    out = ms.restore(dst)
    assert out["mlp"]["kernel"].dtype == jnp.bfloat16
    assert out["mlp"]["kernel"].sharding.spec == P(None, "model")
    original = ms.restore(ckpt)
    # streamed into one OCDBT store (this process's), merged by Orbax's finalize
    assert sorted(p.name for p in dst.glob("ocdbt.process_*")) == ["ocdbt.process_0"]
    plain = ocp.StandardCheckpointer().restore(str(dst))
    np.testing.assert_array_equal(plain["mlp"]["kernel"], out["mlp"]["kernel"])
    np.testing.assert_array_equal(
        out["embed"]["embedding"], original["embed"]["embedding"].astype(jnp.bfloat16)
    )
    assert main(argv[:-1]) == 1
    err = capsys.readouterr().err
    assert err.startswith("modelshard reshard: error: ") and err.count("\n") == 1
    assert "already exists; pass --overwrite to replace it" in err
    assert main(["reshard", str(ckpt), str(tmp_path / "x"), "--mesh", "data=16"]) == 1
    assert capsys.readouterr().err == (
        "modelshard reshard: error: the target mesh needs 16 devices but JAX already started "
        "with 8; run modelshard reshard in a fresh process.\n"
    )


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        (
            "--dtype",
            "bogus",
            "argument --dtype: 'bogus' is not a dtype name; choose e.g. bfloat16, float16 or "
            "float32",
        ),
        ("--dtype", "bf16", "argument --dtype: 'bf16' is not a dtype name; did you mean bfloat16?"),
        ("--dtype", "FP16", "argument --dtype: 'FP16' is not a dtype name; did you mean float16?"),
        (
            "--dtype",
            "float8",
            "argument --dtype: 'float8' is not a dtype name; did you mean float8_e4m3fn?",
        ),
        (
            "--dtype",
            "bfloat61",
            "argument --dtype: 'bfloat61' is not a dtype name; did you mean bfloat16?",
        ),
        ("--dtype", "int8", "argument --dtype: 'int8' is not a floating-point dtype"),
        ("--chunk-mb", "nan", "argument --chunk-mb: 'nan' is not a finite number above 0"),
        ("--chunk-mb", "-1", "argument --chunk-mb: '-1' is not a finite number above 0"),
        ("--mesh", "data=0", "argument --mesh: 'data=0' is not name=size"),
    ],
)
def test_bad_reshard_values_are_usage_errors(ckpt, tmp_path, capsys, flag, value, says):
    argv = ["reshard", str(ckpt), str(tmp_path / "out"), "--mesh", "data=2", flag, value]
    assert main(argv) == 2
    err = one_line(capsys.readouterr().err, "reshard")
    assert says in err and err.endswith("(see 'modelshard reshard --help')\n")
    assert not (tmp_path / "out").exists()


def test_destination_below_a_regular_file(ckpt, tmp_path, capsys):
    (tmp_path / "afile").write_text("not a directory")
    for dst in (tmp_path / "afile" / "sub", tmp_path / "afile" / "a" / "b"):
        assert main(["reshard", str(ckpt), str(dst), "--mesh", "data=2"]) == 1
        err = one_line(capsys.readouterr().err, "reshard")
        assert f"{tmp_path / 'afile'} is a regular file, not a directory" in err
    assert (tmp_path / "afile").read_text() == "not a directory"


@pytest.mark.parametrize(
    ("code", "says"),
    [
        (errno.EROFS, "Read-only file system (the file system is read-only; choose a writable"),
        (errno.ENOSPC, "No space left on device (the disk is full; free space or choose"),
        (errno.EACCES, "Permission denied"),
    ],
)
def test_destination_os_errors(ckpt, tmp_path, capsys, monkeypatch, code, says):
    """A read-only mount or a full disk (simulated: the writer fails as the OS would)."""
    import modelshard._checkpoint as reshard_module  # the CLI calls the façade's reshard

    dst = tmp_path / "out"

    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code), str(dst))

    monkeypatch.setattr(reshard_module, "reshard", fail)
    for extra in ([], ["--json"]):
        assert main(["reshard", str(ckpt), str(dst), "--mesh", "data=2", *extra]) == 1
        captured = capsys.readouterr()
        err = captured.err
        if extra:
            error = json.loads(captured.out)["error"]
            assert err.endswith(", exit status 1 (the JSON on stdout says what and where)\n")
            assert (error["type"], error["errno"]) == (type(OSError(code, "")).__name__, code)
            assert says in error["message"]
        else:
            assert says in one_line(err, "reshard") and str(dst) in err


def test_full_disk_reported_by_tensorstore(ckpt, tmp_path, capsys, monkeypatch):
    """TensorStore reports a failed write as ValueError with the OS error code inside (the
    text below is what a real 64 KiB tmpfs produced)."""
    import modelshard._checkpoint as reshard_module  # the CLI calls the façade's reshard

    target = tmp_path / "..out.modelshard-tmp.pieces/merged/manifest.ocdbt"

    def fail(*args, **kwargs):
        raise ValueError(
            f'RESOURCE_EXHAUSTED: Error writing local file "{target}": Failed writing: '
            f'"{target}.__lock": Failed to write 113 bytes to file 8: No space left on device '
            "[os_error_code='28']"
        )

    monkeypatch.setattr(reshard_module, "reshard", fail)
    assert main(["reshard", str(ckpt), str(tmp_path / "out"), "--mesh", "data=2"]) == 1
    assert capsys.readouterr().err == (
        f"modelshard reshard: error: {target}: No space left on device (the disk is full; "
        "free space or choose another destination)\n"
    )
    # any other ValueError from the library is a bug: it is not disguised as a user error
    monkeypatch.setattr(reshard_module, "reshard", lambda *a, **k: int("x"))
    with pytest.raises(ValueError, match="invalid literal"):
        main(["reshard", str(ckpt), str(tmp_path / "out"), "--mesh", "data=2"])


def test_reshard_of_a_manager_step_never_drops_items_silently(tmp_path, capsys):
    """A CheckpointManager step's items and metrics cannot ride along in a resharded
    checkpoint: the reshard is refused, naming them, unless told to drop them (then the
    output says what was dropped)."""
    root = tmp_path / "run"
    with ms.CheckpointManager(root) as mngr:
        mngr.save(
            3,
            {"w": jnp.ones((8, 2))},
            items={"config": {"lr": 0.1}, "rng": jax.random.key(0)},
            metrics={"loss": 0.5},
        )
    step = root / "3"
    refused = (
        f"{step} is step 3 of a CheckpointManager and holds items (config, rng) and metrics "
        "(loss) beside its arrays; a resharded checkpoint holds arrays only, so they would be "
        f"lost. Keep them: read CheckpointManager({str(root)!r}).items(3) and .metrics(3) and "
        "save them with the resharded state; or pass {} to reshard the arrays without them."
    )
    mesh = ms.make_mesh({"data": 8})
    with pytest.raises(ms.CheckpointError) as e:
        ms.reshard(step, tmp_path / "py", specs=P("data"), mesh=mesh)
    assert str(e.value) == refused.format("drop_items=True")
    assert not (tmp_path / "py").exists()
    # the command line: the root means its latest step; the flag is named as typed
    argv = ["reshard", str(root), str(tmp_path / "cli"), "--mesh", "data=8"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.endswith(f"modelshard reshard: error: {refused.format('--drop-items')}\n")
    assert not (tmp_path / "cli").exists()
    assert main([*argv, "--drop-items"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == (
        f"dropped the step's items (config, rng) and metrics (loss) (--drop-items): "
        f"{tmp_path / 'cli'} holds the arrays only"
    )
    assert main([*argv[:2], str(tmp_path / "cli2"), *argv[3:], "--drop-items", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["dropped"] == {"items": ["config", "rng"], "metrics": ["loss"]}
    # a plain checkpoint has nothing to drop
    assert (
        main(["reshard", str(tmp_path / "cli"), str(tmp_path / "p"), "--mesh", "data=8", "--json"])
        == 0
    )
    assert json.loads(capsys.readouterr().out)["dropped"] == {"items": [], "metrics": []}


def test_printed_lines_show_paths_literally(ckpt, tmp_path, capsys):
    """'wrote ...' lines of reshard and convert print the path as it is, ``[red]`` included,
    on one line."""
    from safetensors.numpy import save_file

    dst = tmp_path / "[red]out[/red]"
    assert main(["reshard", str(ckpt), str(dst), "--mesh", "data=8"]) == 0
    assert capsys.readouterr().out == f"wrote {dst}: 19 leaves, 11.01 KiB, mesh data=8\n"
    st = tmp_path / "model.safetensors"
    save_file({"norm.weight": np.ones(16, np.float32), "l.0.up.weight": np.ones((24, 16))}, str(st))
    (tmp_path / "map.toml").write_text(CONVERT_MAP)
    conv = tmp_path / "[bold]conv"
    argv = ["convert", str(st), str(conv), "--mapping", str(tmp_path / "map.toml")]
    assert main([*argv, "--mesh", "data=8"]) == 0
    assert capsys.readouterr().out == f"wrote {conv}: 2 leaves, 3.06 KiB, mesh data=8\n"


@pytest.mark.parametrize("state", ["nnx guide", "linen TrainState"])
def test_orbaxs_checkpoint_of_a_boxed_state_under_the_paths_plan_shows(tmp_path, capsys, state):
    """A plain Orbax checkpoint of a boxed state (the Flax NNX guide's ``nnx.state``, a
    linen ``TrainState`` with boxed params and adamw moments): ``inspect`` and ``plan``
    show the paths ``ms.plan`` shows for the model (``linear1/kernel``, not
    ``linear1/kernel/value``), and ``reshard`` with rules written for them lays it out."""
    from flax import nnx

    if state == "nnx guide":
        model = guide_mlp(seed=0)
        saved, make = nnx.state(model), lambda: guide_mlp(seed=1)
    else:
        model = saved = boxed_train_state(seed=0, step=5)
        make = lambda: boxed_train_state(seed=1)  # noqa: E731
    src, dst = tmp_path / "state", tmp_path / "out"
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(str(src), saved)
    want = [
        leaf.path for leaf in ms.plan(model, P(), ms.make_mesh({"data": 8}, abstract=True)).leaves
    ]
    assert main(["inspect", str(src), "--json"]) == 0
    assert sorted(x["path"] for x in json.loads(capsys.readouterr().out)["leaves"]) == sorted(want)
    rules = tmp_path / "rules.toml"
    rules.write_text(
        "[[rules]]\npattern = 'kernel$'\nspec = ['none', 'data']\n"
        "[[rules]]\npattern = '.*'\nspec = []\n"
    )
    assert main(["plan", str(src), "--mesh", "data=8", "--rules", str(rules), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert sorted(p for row in rows for p in row["paths"]) == sorted(want)
    kernels = [p for row in rows if row["spec"] == [None, "data"] for p in row["paths"]]
    assert kernels and all(p.endswith("kernel") for p in kernels)
    assert main(["reshard", str(src), str(dst), "--mesh", "data=8", "--rules", str(rules)]) == 0
    capsys.readouterr()
    like = jax.eval_shape(make) if state != "nnx guide" else nnx.eval_shape(make)
    out = ms.restore(dst, like=like)
    if state == "nnx guide":
        assert out.linear2.kernel[...].sharding.spec == P(None, "data")
        assert_bit_exact(saved, nnx.state(out))
    else:
        assert out.opt_state[0].mu["Dense_1"]["kernel"].value.sharding.spec == P(None, "data")
        assert_bit_exact(model.replace(step=jnp.asarray(5)), out)
