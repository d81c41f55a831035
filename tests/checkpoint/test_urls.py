"""Object-storage failures read as the same ``CheckpointError`` whichever client etils.epath
uses: fsspec (gcsfs, s3fs) or, when TensorFlow is importable, TensorFlow's file system.

TensorFlow is not a test dependency. Its client is stood in for by a module named
``tensorflow`` whose ``io.gfile`` fails the way TensorFlow's does (``FailedPreconditionError``
from ``tensorflow.python.framework.errors_impl`` for a host it cannot resolve,
``NotFoundError`` for a missing object), and etils.epath is told TensorFlow is installed: the
calls then go through etils' real TensorFlow backend, as they do on a machine with the
gemma package or tensorflow-datasets installed.
"""

from __future__ import annotations

import sys
import types

import jax.numpy as jnp
import pytest

import modelshard as ms

pytest.importorskip("gcsfs")
pytest.importorskip("s3fs")

ERRORS_MODULE = "tensorflow.python.framework.errors_impl"
RESOLVE = (
    "Error executing an HTTP request: libcurl code 6 meaning 'Couldn't resolve host name', "
    "error details: Could not resolve host: storage.googleapis.com"
)


def _tf_error(name: str, base: type) -> type:
    return type(name, (base,), {"__module__": ERRORS_MODULE})


def fake_tensorflow(*, reachable: bool) -> types.ModuleType:
    """A ``tensorflow`` module with the parts etils.epath's TensorFlow backend uses."""
    op_error = _tf_error("OpError", Exception)
    errors = types.SimpleNamespace(
        OpError=op_error,
        NotFoundError=_tf_error("NotFoundError", op_error),
        FailedPreconditionError=_tf_error("FailedPreconditionError", op_error),
        AlreadyExistsError=_tf_error("AlreadyExistsError", op_error),
        PermissionDeniedError=_tf_error("PermissionDeniedError", op_error),
    )

    def unreachable(*args, **kwargs):
        raise errors.FailedPreconditionError(RESOLVE)

    def missing(path, *args, **kwargs):
        raise errors.NotFoundError(f"{path} not found")

    if reachable:  # a bucket that exists and holds nothing
        gfile = types.SimpleNamespace(
            exists=lambda p: p.rstrip("/").count("/") <= 2,  # gs://bucket only
            isdir=lambda p: p.rstrip("/").count("/") <= 2,
            listdir=missing,
            GFile=missing,
            stat=missing,
        )
    else:
        gfile = types.SimpleNamespace(exists=unreachable, isdir=unreachable, listdir=unreachable)
    tf = types.ModuleType("tensorflow")
    tf.errors = errors  # type: ignore[attr-defined]
    tf.io = types.SimpleNamespace(gfile=gfile)  # type: ignore[attr-defined]
    return tf


@pytest.fixture
def tensorflow_backend(monkeypatch):
    """etils.epath believes TensorFlow is importable (as with EPATH_USE_TF unset and the
    package installed); ``install(reachable=...)`` puts the stand-in in place."""
    from etils.epath import gpath

    monkeypatch.setattr(gpath, "_is_tf_installed", lambda: True)
    monkeypatch.setattr(gpath, "_is_zonal_gcs_bucket", lambda bucket: False, raising=False)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9023")

    def install(*, reachable: bool) -> None:
        monkeypatch.setitem(sys.modules, "tensorflow", fake_tensorflow(reachable=reachable))

    return install


def test_an_unreachable_server_through_tensorflow_is_a_checkpoint_error(tensorflow_backend):
    tensorflow_backend(reachable=False)
    server = (
        "Google Cloud Storage through TensorFlow's file system (etils.epath uses it because "
        "TensorFlow is importable and EPATH_USE_TF is not false; it does not read "
        "STORAGE_EMULATOR_HOST: set EPATH_USE_TF=false to go through gcsfs)"
    )
    for url, call in (
        ("gs://my-bucket/run", lambda u: ms.CheckpointManager(u, handle_signals=False)),
        ("gs://my-bucket/ck", lambda u: ms.save(u, {"w": jnp.ones(2)})),
        ("gs://my-bucket/ck", lambda u: ms.restore(u)),
    ):
        with pytest.raises(ms.CheckpointError) as e:
            call(url)
        assert str(e.value) == f"cannot reach {url} on {server}: FailedPreconditionError: {RESOLVE}"
        assert type(e.value.__cause__).__module__ == ERRORS_MODULE


def test_s3_through_tensorflow_names_the_variables_it_ignores(tensorflow_backend):
    tensorflow_backend(reachable=False)
    with pytest.raises(ms.CheckpointError) as e:
        ms.CheckpointManager("s3://my-bucket/run", handle_signals=False)
    assert str(e.value) == (
        "cannot reach s3://my-bucket/run on S3 through TensorFlow's file system (etils.epath "
        "uses it because TensorFlow is importable and EPATH_USE_TF is not false; it does not "
        "read AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL: set EPATH_USE_TF=false to go through "
        f"s3fs): FailedPreconditionError: {RESOLVE}"
    )


def test_tensorflows_not_found_is_a_missing_folder(tensorflow_backend):
    """A manager root with nothing in it yet: TensorFlow's listing raises its NotFoundError
    (etils passes it on), which reads as no steps, as gcsfs's FileNotFoundError does."""
    tensorflow_backend(reachable=True)
    mngr = ms.CheckpointManager("gs://my-bucket/run", handle_signals=False)
    assert mngr.all_steps() == []
    assert mngr.latest_step() is None
    with pytest.raises(ms.CheckpointError) as e:
        mngr.restore()
    assert str(e.value) == "no checkpoint in gs://my-bucket/run: no step was saved yet."
    mngr.close()


def test_other_errors_pass_unchanged(tmp_path):
    from modelshard._checkpoint.urls import client_failure, location, reaching

    boom = type("InvalidArgumentError", (Exception,), {"__module__": "numpy.linalg"})
    with pytest.raises(boom), reaching(location("gs://my-bucket/x")):
        raise boom("not a storage client's")
    tf_error = _tf_error("FailedPreconditionError", Exception)
    with pytest.raises(tf_error), reaching(tmp_path):  # a local path: nothing to translate
        raise tf_error("local")
    assert client_failure(tf_error("x")) == "tensorflow"
    assert client_failure(type("ClientError", (Exception,), {"__module__": "botocore.x"})()) == (
        "fsspec"
    )
    assert client_failure(ValueError("x")) is None
