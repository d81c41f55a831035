"""``make_mesh``: sizes, -1, axis types, abstract meshes, and clear errors."""

from __future__ import annotations

import jax
import pytest
from jax.sharding import AbstractMesh, AxisType, Mesh

import modelshard as ms


def test_sizes_and_default_auto():
    mesh = ms.make_mesh({"data": 2, "model": 4})
    assert isinstance(mesh, Mesh)
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)


def test_explicit_and_mixed_axis_types():
    assert ms.make_mesh({"data": 8}, axis_types="explicit").axis_types == (AxisType.Explicit,)
    mixed = ms.make_mesh({"data": 2, "model": 4}, axis_types=("explicit", AxisType.Auto))
    assert mixed.axis_types == (AxisType.Explicit, AxisType.Auto)


def test_minus_one_takes_the_rest():
    assert dict(ms.make_mesh({"data": -1, "model": 2}).shape) == {"data": 4, "model": 2}


def test_smaller_mesh_uses_first_devices():
    mesh = ms.make_mesh({"data": 4})
    assert list(mesh.devices.flat) == jax.devices()[:4]


def test_abstract_mesh_of_any_size():
    mesh = ms.make_mesh({"data": 32, "model": 8}, abstract=True)
    assert isinstance(mesh, AbstractMesh) and mesh.size == 256


@pytest.mark.parametrize(
    ("axes", "kwargs", "message"),
    [
        (
            {"data": 16},
            {},
            "mesh {'data': 16} needs 16 devices but only 8 are available; on CPU, "
            "simulate more with jax.config.update('jax_num_cpu_devices', 16) before any JAX "
            "computation, or pass abstract=True to plan without devices.",
        ),
        (
            {"data": -1, "model": -1},
            {},
            "at most one axis size may be -1, got {'data': -1, 'model': -1}.",
        ),
        (
            {"data": -1, "model": 3},
            {},
            "cannot infer the -1 axis: 8 devices are not divisible by 3 "
            "(the product of the other axes) in {'data': -1, 'model': 3}.",
        ),
        ({"data": 0}, {}, "mesh axis sizes must be positive ints (or one -1): data=0."),
        ({"data": 2.0}, {}, "mesh axis sizes must be positive ints (or one -1): data=2.0."),
        ({}, {}, "make_mesh needs a non-empty mapping of axis name -> size, got {}."),
        (
            {"data": 8},
            {"axis_types": "manual"},
            "axis type 'manual' is not one of 'auto', 'explicit' or a jax AxisType.",
        ),
        ({"data": 8}, {"axis_types": ("auto", "auto")}, "got 2 axis types for 1 mesh axes."),
        (
            {"data": -1},
            {"abstract": True},
            "an abstract mesh needs every size given; -1 needs real devices.",
        ),
    ],
)
def test_errors(axes, kwargs, message):
    with pytest.raises(ms.MeshError) as e:
        ms.make_mesh(axes, **kwargs)
    assert str(e.value) == message
    assert isinstance(e.value, ValueError)
