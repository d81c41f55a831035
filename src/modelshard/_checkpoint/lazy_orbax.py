"""Orbax is imported lazily, by a restore of a plain Orbax checkpoint (its metadata, its
read spec); what its import changes in JAX is settled when modelshard is imported.

Orbax imports ``jax.extend``, and that import defines JAX options that are part of every
jit cache key (Pallas's trace-context options). Defined after a step was compiled, they
made the step compile again at its next call: a training script that compiled its step,
then read an Orbax checkpoint, compiled it twice (``jax.jit`` and ``shard_jit`` alike;
counted with JAX's compile events by the journey matrix's ``step_compiles_once`` case).
Importing ``jax.extend`` here, with modelshard (about 15 ms), defines them before any step
is compiled, so Orbax's import later changes no cache key. The same holds for modelshard's
own checksum programs: a restore's, compiled before Orbax was imported, compiled again
after it. (A function compiled before ``import modelshard`` still compiles once more:
modelshard's own jit-key contexts, ``ms.logical_rules`` and ``ms.strict_constraints``, are
defined at import.)
"""

from __future__ import annotations

import jax.extend  # noqa: F401  (imported for what it defines; see above)
