#!/usr/bin/env bash
# Run pytest from .venv (or $VENV); exit code 5 (no tests collected) is a failure, said out loud.
cd "$(dirname "$0")/.."
# modelshard's own bytecode, brought up to date (only changed files are compiled): the suite
# starts hundreds of processes, each of which would otherwise compile it from source.
"${VENV:-.venv}"/bin/python -m compileall -q -j 0 src >/dev/null
"${VENV:-.venv}"/bin/python -m pytest "$@"
rc=$?
if [[ $rc == 5 ]]; then
  echo "pytest collected no tests: treating as a failure" >&2
  exit 1
fi
exit $rc
