#!/usr/bin/env bash
# Run pytest from .venv (or $VENV); exit code 5 (no tests collected) is a failure, said out loud.
cd "$(dirname "$0")/.."
# Bytecode written as modules are first imported, whatever the machine's
# PYTHONDONTWRITEBYTECODE says: the suite starts hundreds of processes, and each would
# otherwise compile from source what it imports (the bootstrap wrote the core stack's).
unset PYTHONDONTWRITEBYTECODE
"${VENV:-.venv}"/bin/python -m pytest "$@"
rc=$?
if [[ $rc == 5 ]]; then
  echo "pytest collected no tests: treating as a failure" >&2
  exit 1
fi
exit $rc
