"""Other libraries' private names that modelshard needs, each imported once, with its reason.

Import ``modelshard._internals.orbax`` or ``modelshard._internals.jax`` (not this package):
each loads its library, and Orbax is imported only by the code that checkpoints.
"""
