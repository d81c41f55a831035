"""``shard``: place any container by its plan and return the same type."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from .._base import MeshError, is_abstract
from .._specs import SpecLike
from .planning import plan


def place(arrays: Sequence[Any], shardings: Sequence[Any]) -> list[Any]:
    """Put each array on its sharding; abstract leaves get the sharding attached."""
    out: list[Any] = list(arrays)
    todo = []
    for i, (x, s) in enumerate(zip(arrays, shardings, strict=True)):
        if isinstance(x, jax.ShapeDtypeStruct):
            out[i] = jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=s, weak_type=getattr(x, "weak_type", False)
            )
        elif not (isinstance(x, jax.Array) and x.sharding == s):
            todo.append(i)
    if todo:
        todo_x, todo_s = [arrays[i] for i in todo], [shardings[i] for i in todo]
        if is_abstract(todo_s[0].mesh):
            raise MeshError(
                "cannot place concrete arrays on an AbstractMesh; build a real mesh "
                "with modelshard.make_mesh, or pass jax.ShapeDtypeStruct leaves."
            )
        if jax.process_count() > 1:
            todo_x = [_local_to_global(x, s) for x, s in zip(todo_x, todo_s, strict=True)]
        for i, y in zip(todo, jax.device_put(todo_x, todo_s), strict=True):
            out[i] = y
    return out


def _local_to_global(x: Any, s: Any) -> Any:
    """Multi-process: an array committed to this process's devices, as a global array."""
    if not (
        isinstance(x, jax.Array)
        and x.is_fully_addressable
        and x.committed
        and not s.is_fully_addressable
    ):
        return x
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = _local_to_global(jax.random.key_data(x), s)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])


def shard(tree: Any, specs: SpecLike, mesh: Any = None) -> Any:
    """Place every array leaf of ``tree`` by its plan; return the same container type.

    Every array leaf ends up in its planned sharding; static leaves pass through;
    ``jax.ShapeDtypeStruct`` leaves get the sharding attached (a restore target). An NNX
    module is updated in place and returned.

    Args:
        tree: any registered container.
        specs: one spec-like for the whole tree (see [`plan`][modelshard.plan]).
        mesh: a concrete ``jax.sharding.Mesh`` (abstract ones only for abstract leaves);
            default: the mesh set by ``jax.set_mesh``.

    Returns:
        The container, same type, with placed leaves.

    Raises:
        SpecError: listing every leaf that cannot be placed.
        MeshError: ``mesh`` is omitted and no mesh is active.

    Example:
        >>> import jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> import modelshard as ms
        >>> mesh = ms.make_mesh({"data": 8})
        >>> params = ms.shard({"w": jnp.zeros((16, 4)), "b": jnp.zeros(4)}, ms.fsdp("data", min_size=0), mesh)
        >>> params["w"].sharding.spec
        P('data',)
    """
    arg = (p := plan(tree, specs, mesh)).args[0]
    return arg.flat.update_inplace(place(arg.flat.arrays, p.flat_shardings(0)))
