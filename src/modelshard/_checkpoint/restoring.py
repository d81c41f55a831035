"""The public ``restore``: a checkpoint read as saved (``read.restore_saved``) or through a
mapping from its leaf paths to another layout's (``mapped.restore_mapped``)."""

from __future__ import annotations

import os
from typing import Any

from .mapped import restore_mapped
from .read import check_cast, restore_saved
from .sources import locate


def restore(
    directory: str | os.PathLike[str],
    *,
    like: Any = None,
    specs: Any = None,
    mesh: Any = None,
    dtype: Any = None,
    partial: bool = False,
    verify: bool = True,
    mapping: Any = None,
) -> Any:
    """Restore a checkpoint, every leaf read directly into its planned sharding.

    Args:
        directory: a checkpoint written by [`save`][modelshard.save], by Orbax's
            ``StandardCheckpointer``, or a step directory of an Orbax ``CheckpointManager``.
            Orbax stores a box (linen ``Partitioned`` / ``LogicallyPartitioned``, optax
            moments of boxed params) and an NNX ``Variable`` (the Flax guide's
            ``nnx.state(model)``) as a node whose only child is ``value``, and records no
            type for it: such a node (not the root; its ``value`` an array) is read as the
            box it was, named by its canonical path (``linear/kernel``, as
            [`plan`][modelshard.plan] shows it, not ``linear/kernel/value``), so it
            restores into the boxed or NNX ``like`` with no mapping. A ``like`` whose own
            paths end in ``value`` (a dict that really has such a leaf) is matched on the
            names as stored. A Python number Orbax stored (64-bit) is read as JAX holds it
            (an int that does not fit int32 without x64 is refused, never wrapped);
            a typed PRNG key Orbax stored as its key data, as the key ``like`` holds there.
        like: a concrete or abstract container (``jax.eval_shape``, ``nnx.eval_shape``)
            giving the type to return; without it a nested dict of arrays is rebuilt from
            the checkpoint's record (or Orbax metadata). The state's Python values (an
            epoch, a name) come from the checkpoint, never from ``like`` (one of another
            type is a changed leaf); functions among the leaves come from ``like``.
        specs: one spec-like for the whole container (``P()``, [`Rules`][modelshard.Rules],
            [`fsdp`][modelshard.fsdp], ...), planned on ``mesh`` by the same pipeline as [`shard`][modelshard.shard].
            Default with a mesh: the specs the checkpoint was saved with.
        mesh: the target mesh (an ``AbstractMesh`` is made concrete). Without a mesh each
            leaf takes ``like``'s sharding, else the saved mesh (its axis types too) if
            this host has exactly its devices, else the first local device.
        dtype: cast floating-point leaves to this floating-point dtype (stored values are
            verified first; an integer dtype is refused).
        partial: restore only the leaves both sides have: extra checkpoint leaves are
            skipped and missing ones keep ``like``'s (concrete) values.
        verify: check each leaf's checksum against the record.
        mapping: a [`WeightMap`][modelshard.WeightMap] (or a path to its TOML file) from the checkpoint's
            leaf paths to ``like``'s: a checkpoint of another layout (linen scanned layers
            into an unscanned NNX model, t5x/MaxText names, a model without the new head).
            Rules match the canonical paths (a mapping written for a plain Orbax
            checkpoint's ``kernel/value`` names still resolves against them).
            Every unmapped or unfitting leaf is reported at once (``MappingError``);
            with a mesh, ``specs`` default to each leaf's saved spec carried through its
            recipe; typed PRNG keys map too; ``partial`` is the mapping's ``keep``.

    Returns:
        The container (same type as ``like``; a nested dict without it).

    Raises:
        CheckpointError: no checkpoint, a structure mismatch (a path-first diff), a damaged
            leaf or a checksum mismatch (naming the leaves).
        SpecError: ``specs`` do not fit the container or the mesh.

    Example:
        >>> import tempfile, jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> import modelshard as ms
        >>> path = ms.save(tempfile.mkdtemp() + "/ckpt", {"w": jnp.ones((8, 2))})
        >>> like = jax.eval_shape(lambda: {"w": jnp.ones((8, 2))})
        >>> out = ms.restore(path, like=like, specs=ms.Rules([("w", P("data"))]),
        ...                  mesh=ms.make_mesh({"data": 8}))
        >>> out["w"].sharding.spec
        P('data',)
    """
    dtype = check_cast(dtype)
    source = locate(directory)
    if mapping is not None:
        return restore_mapped(
            source, like=like, mapping=mapping, specs=specs, mesh=mesh, dtype=dtype, verify=verify
        )
    return restore_saved(
        source, like=like, specs=specs, mesh=mesh, dtype=dtype, partial=partial, verify=verify
    )
