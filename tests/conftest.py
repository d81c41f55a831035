"""Shared fixtures: meshes (Auto and Explicit), real containers of every kind, and local
object-storage servers (gs:// and s3://) started once per session."""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# The suite's arrays are tiny, so compilation dominates its time: XLA's backend optimisations
# are turned down for this process and every process a test starts (they inherit it), before
# JAX's backend reads the flags. Results are the same; programs compile about a third faster.
os.environ.setdefault(
    "XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
)

import jax
import jax.numpy as jnp
import pytest

import compile_cache
import modelshard as ms
from helpers import KINDS, MAKERS, RULES, Zygote

# pytest-xdist's workers set COLUMNS=80; the command-line output under test is the one a
# pipe gets (160 columns, the tests' tables assume it), whichever way the suite runs.
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)


# ---- one compilation cache for the run's test processes --------------------------------

_CACHE = "MODELSHARD_TESTS_COMPILATION_CACHE"
"""The folder, set by the run's first process (xdist's controller) for its workers."""
_OWNED: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    """The test processes of a run share a JAX compilation cache in a temporary folder:
    tests compile the same programs many times over (a step through ``shard_jit``, then by
    plain ``jax.jit`` to compare; one test's fixture in both workers), and XLA compiles each
    once. Of the processes tests start, the docs' runner alone uses it (test_docs.py).
    ``MODELSHARD_TESTS_COMPILATION_CACHE=`` (empty) runs without it."""
    if _CACHE not in os.environ:
        os.environ[_CACHE] = tempfile.mkdtemp(prefix="modelshard-tests-jax-cache-")
        _OWNED.append(os.environ[_CACHE])
    if os.environ[_CACHE]:
        compile_cache.use(os.environ[_CACHE])


def pytest_unconfigure(config: pytest.Config) -> None:
    for folder in _OWNED:
        shutil.rmtree(folder, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` run only when asked for (``pytest -m slow``, ``make slow``)."""
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="runs with `pytest -m slow`")
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_registry():
    """Every test sees the registry as it was; registrations made in a test are undone."""
    with ms.adapters.registry_snapshot():
        yield


@pytest.fixture(params=["auto", "explicit"])
def axis_type(request) -> str:
    return request.param


@pytest.fixture
def mesh8(axis_type):
    """A (8,) mesh named ``data``."""
    return ms.make_mesh({"data": 8}, axis_types=axis_type)


@pytest.fixture
def mesh24(axis_type):
    """A (2, 4) mesh named ``data``, ``model``."""
    return ms.make_mesh({"data": 2, "model": 4}, axis_types=axis_type)


# ---- containers of every kind --------------------------------------------------------


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture
def container(kind) -> Any:
    """A real container of each kind (pytree, optax, equinox, nnx, linen)."""
    return MAKERS[kind]()


# ---- object storage on localhost: gs:// (GCS emulator) and s3:// (moto) -----------------

BUCKET = "modelshard-test"
"""The bucket both servers hold (S3 names need 3+ characters)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_server(argv: list[str], what: str, wait_s: float) -> Iterator[str]:
    """Start ``python *argv`` (a server on 127.0.0.1; ``{port}`` in argv is a free port),
    wait until it answers HTTP, yield its URL, and stop it at the end (SIGKILL if it does
    not stop)."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, *[a.format(port=port) for a in argv]],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + wait_s
    try:
        while True:
            try:
                urllib.request.urlopen(url, timeout=1)
                break
            except urllib.error.HTTPError:
                break  # it answers
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    pytest.fail(f"{what} did not start")
                time.sleep(0.1)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[dict[str, str]]:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def gcs_env() -> Iterator[dict[str, str]]:
    """A GCS emulator (in memory) holding ``BUCKET``; the environment that points
    etils.epath (gcsfs) and TensorStore at it, set for the session and yielded (for
    child processes)."""
    pytest.importorskip("gcsfs")
    pytest.importorskip("gcp_storage_emulator")
    script = str(Path(__file__).parent / "gcs_emulator.py")  # + GCS's generation headers
    argv = [script, "start", "--port", "{port}", "--in-memory"]
    with local_server([*argv, "--default-bucket", BUCKET], "the GCS emulator", 30) as url:
        env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url}
        with _environ(env):
            yield env


@pytest.fixture(scope="session")
def s3_env() -> Iterator[dict[str, str]]:
    """An S3 server (moto, in memory) holding ``BUCKET``; the environment that points
    botocore (so s3fs and etils.epath) and modelshard's TensorStore s3 spec at it, set
    for the session and yielded (for child processes)."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    boto3 = pytest.importorskip("boto3")
    with local_server(["-m", "moto.server", "-p", "{port}"], "the S3 server (moto)", 60) as url:
        env = {
            "AWS_ENDPOINT_URL": url,
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_REGION": "us-east-1",
        }
        with _environ(env):
            boto3.client("s3", endpoint_url=url).create_bucket(Bucket=BUCKET)
            yield env


@pytest.fixture(params=["gs", "s3"])
def bucket_root(request) -> str:
    """A fresh ``gs://`` or ``s3://`` folder on the local servers above."""
    request.getfixturevalue(f"{'gcs' if request.param == 'gs' else 's3'}_env")
    return f"{request.param}://{BUCKET}/{uuid.uuid4().hex[:8]}"


@pytest.fixture
def s3_root(s3_env) -> str:
    """A fresh ``s3://`` folder on the local S3 server."""
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"


# ---- counting XLA compilations --------------------------------------------------------

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def counting_compiles() -> Iterator[collections.Counter[str]]:
    """XLA compilations while the block runs, by function name (``n["jit(step)"]``).

    Counts JAX's own ``/jax/core/compile/backend_compile_duration`` monitoring event, whose
    ``fun_name`` names the compiled function (``jit(step)``, ``jit(<lambda>)``). The listener
    is unregistered on exit where this JAX can (``unregister_event_duration_listener``, or
    the private ``_unregister_event_duration_listener_by_callback`` of older versions);
    where it cannot, it stays registered but counts nothing once the block has ended.
    """
    counts: collections.Counter[str] = collections.Counter()
    active = [True]

    def listener(event: str, duration_secs: float, **kwargs: Any) -> None:
        if active[0] and event == COMPILE_EVENT:
            counts[str(kwargs.get("fun_name"))] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield counts
    finally:
        active[0] = False
        from jax._src import monitoring as _monitoring

        unregister = getattr(jax.monitoring, "unregister_event_duration_listener", None) or getattr(
            _monitoring, "_unregister_event_duration_listener_by_callback", None
        )
        if unregister is not None:
            with contextlib.suppress(AssertionError, ValueError):
                unregister(listener)


@pytest.fixture
def datasynced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths ``os.fdatasync`` is called on, in order, from any thread (the real calls
    are made; needs ``/proc/self/fd``)."""
    return _synced(monkeypatch, "fdatasync")


@pytest.fixture
def fsynced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths ``os.fsync`` is called on, in order (the real calls are made)."""
    return _synced(monkeypatch, "fsync")


def _synced(monkeypatch: pytest.MonkeyPatch, name: str) -> list[str]:
    seen: list[str] = []
    real = getattr(os, name)

    def spy(fd: int) -> None:
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, name, spy)
    return seen


@pytest.fixture
def count_compiles() -> Callable[[], contextlib.AbstractContextManager[collections.Counter[str]]]:
    """``counting_compiles``: ``with count_compiles() as n: ...`` then ``n["jit(step)"]``."""
    return counting_compiles


# ---- a checkpoint for the command-line tests ---------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """An NNX model saved with fsdp over 8 devices, ``rules.toml`` (``RULES``) beside it: what
    the CLI tests inspect, plan and reshard."""
    root = tmp_path_factory.mktemp("cli")
    mesh = ms.make_mesh({"data": 8})
    model = ms.shard(MAKERS["nnx"](), ms.fsdp("data", min_size=0), mesh)
    path = ms.save(root / "ckpt", model)
    (root / "rules.toml").write_text(RULES)
    return path


# ---- checkpoints under crashes and damage -----------------------------------------------


@pytest.fixture(scope="module")
def zygote():
    """A ``Zygote`` (``ckpt_scripts/save_loop.py``: imports once, forks a saver per start)."""
    z = Zygote(timeout_s=120)
    try:
        yield z
    finally:
        z.close()


@pytest.fixture
def small_ckpt(tmp_path):
    """A saved checkpoint and its record as a dict: (path, record)."""
    import json

    state = {"w": jnp.arange(12.0).reshape(3, 4), "k": jax.random.key(1), "n": {"i": jnp.arange(5)}}
    path = ms.save(tmp_path / "c", state)
    return path, json.loads((path / "modelshard.json").read_text())
