"""Every patch modelshard installs on another library (Orbax, TensorStore, Flax), in one place."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from .needs import moved

ORBAX = "orbax-checkpoint"
TENSORSTORE = "tensorstore"
FLAX = "flax"

Wrap = Callable[[Any], Any]
"""Given what is installed now, the replacement to install, or None to leave it."""


def target(
    owner: Any,
    name: str,
    *,
    distribution: str,
    symbol: str,
    used_for: str,
    params: Iterable[str] = (),
) -> Any:
    """``owner.name``, checked: a callable whose signature has each of ``params`` (a signature
    Python cannot read is not checked); an ImportError saying what moved otherwise."""
    current = getattr(owner, name, None)
    if current is None or not callable(current):
        raise ImportError(moved(distribution, symbol, used_for, f"no callable {name!r} there"))
    try:
        signature = inspect.signature(current)
    except (TypeError, ValueError):  # a compiled function (TensorStore's to_json)
        return current
    lacking = [p for p in params if p not in signature.parameters]
    if lacking:
        raise ImportError(
            moved(
                distribution,
                symbol,
                used_for,
                f"its signature {signature} has no parameter {', '.join(map(repr, lacking))}",
            )
        )
    return current


def _install(owner: Any, name: str, wrap: Wrap, **check: Any) -> Any:
    """``wrap(target(owner, name, ...))`` set on ``owner`` unless it is None; returns what
    ``owner.name`` is afterwards."""
    replacement = wrap(target(owner, name, **check))
    if replacement is not None:
        setattr(owner, name, replacement)
    return getattr(owner, name)


# -- Orbax, module level (Orbax's own code looks each up in its module when it calls it)


def replace_raw_bytes(replacement: Callable[..., Any]) -> bool:
    """Replace Orbax's ``tensorstore_utils.get_tensorstore_raw_bytes``: where it exists
    (orbax-checkpoint 0.12.8 has it, 0.12.3 does not), Orbax converts TensorStore's metrics to
    Python around each batch of arrays, for a log line only, and TensorStore's conversion leaks
    every key and value (``_checkpoint/leaks.py``)."""
    from . import orbax

    if not hasattr(orbax.tensorstore_utils, "get_tensorstore_raw_bytes"):
        return False
    _install(
        orbax.tensorstore_utils,
        "get_tensorstore_raw_bytes",
        lambda _: replacement,
        distribution=ORBAX,
        symbol="orbax.checkpoint._src.serialization.tensorstore_utils.get_tensorstore_raw_bytes",
        used_for="not called: its conversion of TensorStore's metrics leaks on every save",
    )
    return True


def wrap_build_array_write_spec(wrap: Wrap) -> Any:
    """Wrap Orbax's ``tensorstore_utils.build_array_write_spec``: Orbax's ``ArrayHandler`` takes
    each array's chunk shape from its local shard, with no option for another, and modelshard's
    own writes are stored in chunks aligned for other splits (``_checkpoint/chunks.py``)."""
    from . import orbax

    return _install(
        orbax.tensorstore_utils,
        "build_array_write_spec",
        wrap,
        distribution=ORBAX,
        symbol="orbax.checkpoint._src.serialization.tensorstore_utils.build_array_write_spec",
        used_for="its chunk shape replaced by one aligned for restores onto other splits",
        params=("info", "arg", "global_shape", "local_shape", "dtype"),
    )


def wrap_build_kvstore_tspec(wrap: Wrap) -> Any:
    """Wrap Orbax's ``tensorstore_utils.build_kvstore_tspec``: Orbax (0.12.8) gives no
    ``s3`` kvstore for an ``s3://`` directory, which TensorStore supports; modelshard's
    wrapper builds the ``gs://`` spec and swaps its kvstore for an ``s3`` one
    (``_checkpoint/s3.py``; not installed where Orbax handles ``s3://`` itself)."""
    from . import orbax

    return _install(
        orbax.tensorstore_utils,
        "build_kvstore_tspec",
        wrap,
        distribution=ORBAX,
        symbol="orbax.checkpoint._src.serialization.tensorstore_utils.build_kvstore_tspec",
        used_for="s3:// checkpoints through TensorStore's s3 kvstore",
        params=("directory", "use_ocdbt"),
    )


def wrap_barrier_sync_fn(wrap: Wrap) -> Any:
    """Wrap Orbax's ``multihost.get_barrier_sync_fn``: each of Orbax's barriers waits a
    timeout Orbax fixes itself (``multihost._DEFAULT_BARRIER_TIMEOUT``, 300 s, in 0.12.8),
    with no option for all of them; modelshard's saves bound theirs by
    ``MODELSHARD_BARRIER_TIMEOUT`` (``_checkpoint/barriers.py``)."""
    from . import orbax

    return _install(
        orbax.multihost,
        "get_barrier_sync_fn",
        wrap,
        distribution=ORBAX,
        symbol="orbax.checkpoint._src.multihost.multihost.get_barrier_sync_fn",
        used_for="every barrier of modelshard's saves bounded by MODELSHARD_BARRIER_TIMEOUT",
        params=("processes",),
    )


# -- Orbax, one object (the handler or checkpointer modelshard made for one save)


def wrap_handler_save(handler: Any, wrap: Wrap) -> Any:
    """Wrap ``handler.save`` (an Orbax checkpoint handler of a synchronous ``Checkpointer``): no
    hook of Orbax runs between a handler's write and the barrier after it, where a failure on one
    process is shared with the others (``_checkpoint/barriers.sharing_failures``)."""
    _install(
        handler,
        "save",
        wrap,
        distribution=ORBAX,
        symbol=f"{type(handler).__qualname__}.save",
        used_for="a failed write shared with every process before Orbax's next barrier",
    )
    return handler


def wrap_handler_async_save(handler: Any, wrap: Wrap) -> Any:
    """Wrap ``handler.async_save`` (the handler of an ``AsyncCheckpointer``): its futures
    are handed to Orbax as one that never raises, so every process still comes to the
    barrier before the commit (``_checkpoint/barriers.carrying_failures``)."""
    _install(
        handler,
        "async_save",
        wrap,
        distribution=ORBAX,
        symbol=f"{type(handler).__qualname__}.async_save",
        used_for="a failed background write carried to every process at Orbax's barrier",
    )
    return handler


def wrap_handler_finalize(handler: Any, finalize: Callable[[Any, Any], None]) -> Any:
    """Replace ``handler.finalize`` (the PyTree handler modelshard saves with) by
    ``finalize(handler, directory)``: Orbax finds the per-process OCDBT databases it merges
    with a glob of the checkpoint's path, which reads ``[``, ``]``, ``*`` and ``?`` as a
    pattern (0.12.8: "Skipping merge"), so the merge is done again without one
    (``_checkpoint/write._finalize``)."""
    _install(
        handler,
        "finalize",
        lambda _: functools.partial(finalize, handler),
        distribution=ORBAX,
        symbol=f"{type(handler).__qualname__}.finalize",
        used_for="the merge of every process's OCDBT database, under any path",
        params=("directory",),
    )
    return handler


def wrap_commit_callback(checkpointer: Any, wrap: Wrap) -> Any:
    """Wrap ``checkpointer._make_on_commit_callback`` (an ``AsyncCheckpointer``): no public
    hook of Orbax runs around a background save's whole commit, and a commit that fails on
    the primary process is carried to every process at the barrier after it
    (``_checkpoint/barriers.carrying_commit``)."""
    _install(
        checkpointer,
        "_make_on_commit_callback",
        wrap,
        distribution=ORBAX,
        symbol=f"{type(checkpointer).__qualname__}._make_on_commit_callback",
        used_for="a failed commit carried to every process at Orbax's barrier after it",
    )
    return checkpointer


# -- TensorStore


def wrap_to_json(cls: Any, wrap: Wrap) -> Any:
    """Wrap ``cls.to_json`` (``tensorstore.Spec``, ``tensorstore.KvStore.Spec``):
    TensorStore's ``JsonToPyObject`` (``python/tensorstore/json_type_caster.cc``, 0.1.86)
    keeps one reference too many to every key and value of every dict it gives Python,
    and Orbax converts a spec on every array of every save and restore
    (``_checkpoint/leaks.py``: installed only where a probe shows the extra reference)."""
    return _install(
        cls,
        "to_json",
        wrap,
        distribution=TENSORSTORE,
        symbol=f"tensorstore.{cls.__qualname__}.to_json",
        used_for="the references its conversion keeps given back: no leak on every save",
    )


# -- Flax linen (installed the first time a linen model is traced under modelshard's rules)


def wrap_linen_unbox(wrap: Wrap) -> Any:
    """Wrap ``flax.linen.spmd.LogicallyPartitioned.unbox``: Flax constrains a box whose
    value an initializer wrapper made flat by its full-rank names, and fails (flax#3676);
    under modelshard's rules such a box is left unconstrained (``_specs/logical.py``)."""
    import flax.linen.spmd as linen_spmd

    return _install(
        linen_spmd.LogicallyPartitioned,
        "unbox",
        wrap,
        distribution=FLAX,
        symbol="flax.linen.spmd.LogicallyPartitioned.unbox",
        used_for="a flat param's box left unconstrained under modelshard's logical rules",
        params=("apply_constraint",),
    )


def wrap_linen_constraint(wrap: Wrap) -> Any:
    """Wrap ``flax.linen.spmd._with_sharding_constraint``: every logical constraint of linen ends
    there as ``jax.lax.with_sharding_constraint``, which only asserts on an Explicit mesh axis;
    under modelshard's rules it reshards as ``constrain`` does (``_specs/logical.py``)."""
    import flax.linen.spmd as linen_spmd

    return _install(
        linen_spmd,
        "_with_sharding_constraint",
        wrap,
        distribution=FLAX,
        symbol="flax.linen.spmd._with_sharding_constraint",
        used_for="linen's logical constraints resharded on Explicit mesh axes",
        params=("x", "axis_resources", "mesh"),
    )
