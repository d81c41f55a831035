"""s3:// specifics: the Orbax fix in ``_checkpoint/s3.py`` (what Orbax does without it, the
specs it builds, when it stands aside) and the S3 settings TensorStore and botocore share.
The checkpoints themselves are tested on gs:// and s3:// alike in test_storage.py.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import modelshard as ms
from modelshard._checkpoint import s3

ORBAX = f"orbax-checkpoint {version('orbax-checkpoint')}"
AWS = (
    "AWS_ENDPOINT_URL_S3",
    "AWS_ENDPOINT_URL",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
)


@pytest.fixture
def no_aws_env(monkeypatch):
    for name in AWS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def tsu():
    from orbax.checkpoint._src.serialization import tensorstore_utils

    s3.enable()
    return tensorstore_utils


def test_this_orbax_still_mangles_s3_urls(tsu, s3_root, tmp_path, monkeypatch):
    """The reason for the fix. When this fails, Orbax builds s3 kvstores itself: delete
    ``_checkpoint/s3.py`` (``enable`` already stands aside, see the test below)."""
    import orbax.checkpoint as ocp

    original = tsu.build_kvstore_tspec.__wrapped__
    assert original("s3://bkt/x", use_ocdbt=False) == {"driver": "file", "path": "s3:/bkt/x"}
    with pytest.raises(ValueError, match=r"^Checkpoint path should be absolute\. Got s3:/bkt/x$"):
        original("s3://bkt/x")
    assert not s3.orbax_handles_s3()
    # through Orbax alone, a save goes to a local ./s3: folder and fails
    monkeypatch.setattr(tsu, "build_kvstore_tspec", original)
    monkeypatch.chdir(tmp_path)
    mangled = s3_root.replace("s3://", "s3:/")
    with (
        ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr,
        pytest.raises(ValueError, match=f"should be absolute. Got {mangled}"),
    ):
        ckptr.save(s3_root, args=ocp.args.StandardSave({"w": jnp.ones(4)}))
    assert (tmp_path / "s3:").is_dir()


def test_the_s3_spec_is_orbaxs_gs_spec_with_an_s3_kvstore(tsu, no_aws_env):
    no_aws_env.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9/")
    no_aws_env.setenv("AWS_REGION", "eu-west-1")
    kv = {
        "driver": "s3",
        "bucket": "bkt",
        "endpoint": "http://127.0.0.1:9",
        "aws_region": "eu-west-1",
    }
    assert tsu.build_kvstore_tspec("s3://bkt/run/7/state", "a.b", use_ocdbt=False) == {
        **kv,
        "path": "run/7/state/a.b",
    }
    process = tsu.OcdbtProcessSpec(process_id="3")
    spec = tsu.build_kvstore_tspec("s3://bkt/run/7/state", ocdbt_process_spec=process)
    assert spec["driver"] == "ocdbt"
    assert spec["base"] == {**kv, "path": "run/7/state/ocdbt.process_3"}

    def as_s3(spec):  # Orbax's gs:// spec with its gcs kvstore made the s3 one
        if isinstance(spec, dict):
            if spec.get("driver") == "gcs":
                return {**kv, "path": spec["path"]}
            return {k: as_s3(v) for k, v in spec.items()}
        return spec

    original = tsu.build_kvstore_tspec.__wrapped__
    writing = tsu.OcdbtKvStoreWriteOptions(mode=tsu.OcdbtWriteMode.WRITE)
    for kwargs in (
        {},
        {"use_ocdbt": False},
        {"ocdbt_process_spec": process, "ocdbt_write_options": writing},
    ):
        for name in (None, "layers.0.kernel"):
            want = as_s3(original("gs://bkt/run/7/state", name, **kwargs))
            assert tsu.build_kvstore_tspec("s3://bkt/run/7/state", name, **kwargs) == want
    # local paths and gs:// reach Orbax untouched
    for directory in ("/tmp/ck", "gs://bkt/ck"):
        assert tsu.build_kvstore_tspec(directory) == original(directory)


def test_enable_is_idempotent_and_stands_aside_when_orbax_handles_s3(tsu, monkeypatch):
    wrapper = tsu.build_kvstore_tspec
    s3.enable()
    assert tsu.build_kvstore_tspec is wrapper  # not wrapped twice

    def native(directory, name=None, *, use_ocdbt=True, **_):
        bucket, _, path = str(directory).removeprefix("s3://").partition("/")
        kv = {"driver": "s3", "bucket": bucket, "path": path}
        return {"driver": "ocdbt", "base": kv} if use_ocdbt else kv

    assert s3.orbax_handles_s3(native)
    monkeypatch.setattr(s3, "_state", {})  # as in a process where enable() never ran
    monkeypatch.setattr(tsu, "build_kvstore_tspec", native)
    s3.enable()
    assert tsu.build_kvstore_tspec is native and s3._state == {"native": True}


def test_specs_the_fix_cannot_translate_are_refused():
    def url_base(directory, name=None, **_):
        return {"driver": "ocdbt", "base": "gs://bkt/x/"}

    with pytest.raises(ms.CheckpointError) as e:
        s3._wrap(url_base)("s3://bkt/x")
    assert str(e.value) == (
        f"cannot point Orbax ({ORBAX}) at s3://bkt/x: its spec for the same gs:// key, "
        "{'driver': 'ocdbt', 'base': 'gs://bkt/x/'}, has no gcs kvstore to replace by an s3 one."
    )

    def grpc_base(directory, name=None, **_):
        return {"driver": "gcs_grpc", "bucket": "bkt", "path": "x", "endpoint": "g:443"}

    with pytest.raises(ms.CheckpointError) as e:
        s3._wrap(grpc_base)("s3://bkt/x")
    assert str(e.value) == (
        f"cannot point Orbax ({ORBAX}) at s3://bkt/x: its gs:// kvstore spec has fields "
        "modelshard does not translate to S3 (endpoint)."
    )


def test_kvstore_spec_reads_the_environment_as_botocore_does(no_aws_env):
    boto3 = pytest.importorskip("boto3")
    assert s3.kvstore_spec("bkt", "p") == {"driver": "s3", "bucket": "bkt", "path": "p"}
    no_aws_env.setenv("AWS_REGION", "eu-west-1")  # on AWS, TensorStore finds the region
    assert "aws_region" not in s3.kvstore_spec("bkt", "p")
    no_aws_env.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    no_aws_env.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:2/")  # wins, as in botocore
    no_aws_env.setenv("AWS_ACCESS_KEY_ID", "id")
    no_aws_env.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    assert s3.kvstore_spec("bkt", "p") == {
        "driver": "s3",
        "bucket": "bkt",
        "path": "p",
        "endpoint": "http://127.0.0.1:2",
        "aws_region": "eu-west-1",
        "aws_credentials": {"type": "environment"},
    }
    # s3fs (hence etils.epath) talks to S3 through a botocore client: the same endpoint
    client = boto3.session.Session().client("s3")
    assert client.meta.endpoint_url == "http://127.0.0.1:2/"  # the same server
    no_aws_env.delenv("AWS_ENDPOINT_URL_S3")
    assert boto3.session.Session().client("s3").meta.endpoint_url == s3.endpoint()


def test_every_object_lands_on_the_configured_server(s3_root, s3_env, tmp_path, monkeypatch):
    """TensorStore (arrays) and s3fs (metadata) both wrote to the local server: an
    independent client lists every object of the checkpoint there, nothing is local."""
    import boto3

    monkeypatch.chdir(tmp_path)
    bucket, prefix = s3_root.removeprefix("s3://").split("/", 1)
    ms.save(s3_root, {"w": jnp.arange(1024.0)})
    client = boto3.client("s3", endpoint_url=s3_env["AWS_ENDPOINT_URL"])
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/")
    keys = {o["Key"].removeprefix(f"{prefix}/") for o in listed["Contents"]}
    assert {"commit_success.txt", "_CHECKPOINT_METADATA", "modelshard/modelshard.json"} <= keys
    assert any(k.startswith("state/ocdbt.process_0/") for k in keys)  # TensorStore's
    assert list(tmp_path.iterdir()) == []
    assert ms.restore(s3_root)["w"].shape == (1024,)


def test_an_unreachable_server_is_named_with_the_setting_that_chose_it(monkeypatch):
    s3fs = pytest.importorskip("s3fs")
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    for name, value in {
        "AWS_ENDPOINT_URL": url,
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_MAX_ATTEMPTS": "1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    _forget_s3_clients(s3fs)  # epath keeps one s3fs client, made from the environment
    where = f"on the S3 server {url} (from AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL)"
    try:
        for call, target, asked in (
            (lambda: ms.CheckpointManager("s3://nowhere/run", handle_signals=False), "run", "/run"),
            (lambda: ms.save("s3://nowhere/ck", {"w": jnp.ones(2)}), "ck", "/ck"),
            (lambda: ms.restore("s3://nowhere/ck"), "ck", "/ck"),
        ):
            with pytest.raises(ms.CheckpointError) as e:
                call()
            assert str(e.value) == (
                f"cannot reach s3://nowhere/{target} {where}: EndpointConnectionError: Could "
                f'not connect to the endpoint URL: "{url}/nowhere{asked}"'
            )
    finally:
        monkeypatch.undo()
        _forget_s3_clients(s3fs)


def _forget_s3_clients(s3fs):
    from etils import epath

    epath.backend.fsspec_backend._get_filesystem.cache_clear()  # pyright: ignore
    s3fs.S3FileSystem.clear_instance_cache()


def test_a_script_ending_with_a_save_in_flight_finishes_it_on_s3(s3_root):
    """Issue 13's first case, on S3: the script's last save is still being written when
    ``__main__`` ends; the exit guard finishes it, so the step is complete and bit-exact."""
    child = Path(__file__).parent / "manager_scripts" / "exit_child.py"
    # subprocess.run SIGKILLs the child if it outlives the timeout
    done = subprocess.run(
        [sys.executable, str(child), s3_root, "end"], capture_output=True, text=True, timeout=180
    )
    assert (done.returncode, done.stdout.split()) == (0, ["READY"]), done.stderr[-3000:]
    with ms.CheckpointManager(s3_root, handle_signals=False) as mngr:
        assert mngr.all_steps() == [0, 1, 2]
        w = np.asarray(mngr.restore()["w"])
    np.testing.assert_array_equal(w, np.arange(1 << 16, dtype=np.float32) + 2)
