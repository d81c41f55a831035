"""``python -m modelshard ...``: the ``modelshard`` command line."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
