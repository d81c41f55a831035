"""Root conftest: 8 simulated CPU devices, set once before any JAX computation."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)
