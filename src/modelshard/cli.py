"""The ``modelshard`` command line as a function (public module).

``modelshard.cli.main(argv)`` runs the same program as the ``modelshard`` script and
``python -m modelshard``, and returns its exit status instead of exiting.
"""

from ._cli import main as main
