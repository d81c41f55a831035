"""``s3://`` under Orbax: the TensorStore kvstore spec of an S3 checkpoint.

Orbax (0.12.8) builds its TensorStore specs in ``tensorstore_utils.build_kvstore_tspec``,
which knows ``gs://`` and takes anything else for a local path (``s3://b/x`` becomes
``s3:/b/x``). ``enable`` wraps it for ``s3://`` directories only, while this Orbax still
needs it (``orbax_handles_s3``): the spec Orbax gives the same key under ``gs://``, with its
``gcs`` kvstore swapped for an ``s3`` one; a spec it does not recognise is refused.

TensorStore's s3 driver (0.1.86) ignores ``AWS_ENDPOINT_URL``, which botocore (s3fs,
``etils.epath``) reads, so ``kvstore_spec`` passes ``AWS_ENDPOINT_URL_S3`` or
``AWS_ENDPOINT_URL`` on (botocore's order): both clients reach the same server.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from .._base import CheckpointError

_PROBE = "s3://modelshard-probe/x"
_lock = threading.Lock()
_state: dict[str, Any] = {}  # "original", "wrapper" once wrapped; "native" if not needed


def endpoint() -> str | None:
    """The S3 endpoint botocore would use from the environment, or None (AWS itself)."""
    url = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return url.rstrip("/") if url else None


def kvstore_spec(bucket: str, path: str) -> dict[str, Any]:
    """TensorStore's ``s3`` kvstore for ``s3://bucket/path``, configured from the environment
    as botocore is: ``endpoint()``, with it ``AWS_REGION``/``AWS_DEFAULT_REGION``, and, where
    ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY`` are set, those credentials only."""
    spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": path}
    url = endpoint()
    if url is not None:
        spec["endpoint"] = url
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            spec["aws_region"] = region
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        spec["aws_credentials"] = {"type": "environment"}
    return spec


def _orbax() -> str:
    from importlib.metadata import version

    return f"orbax-checkpoint {version('orbax-checkpoint')}"


def _base_driver(spec: Any) -> Any:
    """The driver of the innermost kvstore of a spec from ``build_kvstore_tspec``."""
    while isinstance(spec, dict) and isinstance(spec.get("base"), dict):
        spec = spec["base"]
    return spec.get("driver") if isinstance(spec, dict) else None


def orbax_handles_s3(build: Any = None) -> bool:
    """Whether Orbax's ``build_kvstore_tspec`` (or ``build``) gives an ``s3`` kvstore for
    an ``s3://`` directory, with OCDBT and without."""
    if build is None:
        from .._internals import tensorstore_utils

        build = _state.get("original") or tensorstore_utils.build_kvstore_tspec
    try:
        return all(_base_driver(build(_PROBE, use_ocdbt=o)) == "s3" for o in (True, False))
    except Exception:  # Orbax 0.12.8: ValueError "Checkpoint path should be absolute"
        return False


def _swap(spec: Any, bucket: str, url: str) -> tuple[Any, int]:
    """``spec`` with every ``gcs`` kvstore of ``bucket`` made an ``s3`` one; the count."""
    if isinstance(spec, dict):
        if spec.get("driver") in ("gcs", "gcs_grpc") and spec.get("bucket") == bucket:
            extra = set(spec) - {"driver", "bucket", "path"}
            if extra:
                raise CheckpointError(
                    f"cannot point Orbax ({_orbax()}) at {url}: its gs:// kvstore spec has "
                    f"fields modelshard does not translate to S3 ({', '.join(sorted(extra))})."
                )
            return kvstore_spec(bucket, spec.get("path", "")), 1
        out, count = {}, 0
        for k, v in spec.items():
            out[k], n = _swap(v, bucket, url)
            count += n
        return out, count
    if isinstance(spec, list):
        pairs = [_swap(v, bucket, url) for v in spec]
        return [v for v, _ in pairs], sum(n for _, n in pairs)
    return spec, 0


def _wrap(build: Any) -> Any:
    def build_kvstore_tspec(directory: Any, *args: Any, **kwargs: Any) -> Any:
        text = str(directory)
        if not text.startswith("s3://"):
            return build(directory, *args, **kwargs)
        key = text.removeprefix("s3://")
        bucket = key.split("/", 1)[0]
        spec, count = _swap(build("gs://" + key, *args, **kwargs), bucket, text)
        if count == 0:
            raise CheckpointError(
                f"cannot point Orbax ({_orbax()}) at {text}: its spec for the same gs:// "
                f"key, {spec!r}, has no gcs kvstore to replace by an s3 one."
            )
        return spec

    build_kvstore_tspec.__wrapped__ = build  # pyright: ignore[reportFunctionMemberAccess]
    build_kvstore_tspec.__doc__ = build.__doc__
    return build_kvstore_tspec


def enable() -> None:
    """Make Orbax write and read ``s3://`` through TensorStore's s3 kvstore (idempotent;
    nothing is changed where Orbax does so already)."""
    from .._internals import wrap_build_kvstore_tspec

    with _lock:
        wrap_build_kvstore_tspec(_replacing)


def _replacing(current: Any) -> Any:
    """The wrapper to install over Orbax's ``build_kvstore_tspec`` (``current``), or None
    where it is installed already or Orbax handles ``s3://`` itself."""
    if _state.get("native") or current is _state.get("wrapper"):
        return None
    if orbax_handles_s3(current):
        _state["native"] = True
        return None
    _state.update(original=current, wrapper=_wrap(current))
    return _state["wrapper"]
