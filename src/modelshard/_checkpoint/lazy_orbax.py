"""``jax.extend`` imported with modelshard: Orbax, imported later and lazily, imports it,
and the JAX options it defines are part of every jit cache key; defined after a step was
compiled, they would make the step compile again (the journey matrix's
``step_compiles_once`` case).
"""

from __future__ import annotations

import jax.extend  # noqa: F401  (imported for what it defines; see above)
