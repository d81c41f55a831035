"""Splitting a container: a state whose arrays hide in an unregistered object is an error,
not an empty plan; objects without arrays are static leaves."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import modelshard as ms


class Opaque:
    """Not registered and not a pytree, but it carries arrays."""

    def __init__(self, w):
        self.w = w


def test_arrays_hidden_in_an_unregistered_object_are_an_error(mesh24) -> None:
    state = {"model": Opaque(jnp.ones((8, 8)))}
    with pytest.raises(ms.AdapterError) as e:
        ms.plan(state, P(), mesh24)
    lines = str(e.value).splitlines()
    assert lines[0] == (
        "tree: no array leaves, but arrays are held by an object modelshard cannot open:"
    )
    assert lines[1] == f"  model: a {__name__}.Opaque holding arrays at w"
    assert lines[2] == (
        "hint: register its type with modelshard.register_container(Opaque, flatten=..., "
        "unflatten=...) (see the custom-container guide), or make it a JAX pytree."
    )


def test_static_objects_without_arrays_are_fine(mesh24) -> None:
    state = {"w": jnp.ones((8, 8)), "cfg": Opaque("not an array")}
    assert [leaf.path for leaf in ms.plan(state, P(), mesh24)] == ["w"]
