#!/usr/bin/env bash
# Create a virtual environment with a locked stack and modelshard installed editable.
#   scripts/bootstrap.sh          .venv       requirements/lock.txt  (the newest stack: every tool)
#   scripts/bootstrap.sh floor    .venv-floor requirements/floor.txt (the oldest supported
#                                 versions, pyproject's floors, and pytest: the floor tests)
# Needs only Python (3.12+ preferred; 3.11 falls back to an unpinned resolve) and pip.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-main}" in
  main) VENV=.venv; LOCK=requirements/lock.txt; IN=requirements/lock.in; EXTRAS='.[all,dev]' ;;
  floor) VENV=.venv-floor; LOCK=requirements/floor.txt; IN=requirements/floor.in; EXTRAS='.[all]' ;;
  *) echo "bootstrap: unknown environment '$1' (main or floor)" >&2; exit 2 ;;
esac
STAMP=$VENV/.modelshard-installed
want=$(cat pyproject.toml "$LOCK" | cksum | cut -d' ' -f1)
if [[ -f $STAMP && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi

py=""
for cand in python3.12 python3.13 python3 python; do
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    py=$cand; break
  fi
done
[[ -n $py ]] || { echo "bootstrap: need Python >= 3.11 (3.12 preferred) on PATH" >&2; exit 1; }
echo "bootstrap: creating $VENV with $($py --version)" >&2
rm -rf "$VENV"
"$py" -m venv "$VENV"
vpy=$VENV/bin/python
pinned=1
"$vpy" -c 'import sys; sys.exit(sys.version_info < (3, 12))' || pinned=0
if [[ $pinned == 1 ]]; then
  reqs=(-r "$LOCK")
else
  echo "bootstrap: Python < 3.12: $LOCK needs 3.12, resolving $IN unpinned" >&2
  reqs=(-r "$IN")
fi
if "$vpy" -m pip install -q --disable-pip-version-check uv >/dev/null 2>&1; then
  "$vpy" -m uv pip install -q --python "$vpy" "${reqs[@]}" -e "$EXTRAS"
else
  "$vpy" -m pip install -q --disable-pip-version-check "${reqs[@]}" -e "$EXTRAS"
fi
# Bytecode for what a process of ours imports (the stack and modelshard), written whatever
# PYTHONDONTWRITEBYTECODE says (uv writes none by default): without it every new process
# compiles JAX, Orbax and modelshard from source and starts about three times slower.
# Importing them with bytecode writing on writes exactly their import closure, a fraction
# of what compileall over the whole environment (torch, transformers, ...) would compile.
env -u PYTHONDONTWRITEBYTECODE "$vpy" - <<'EOF'
import importlib, pkgutil
import jax, jax.numpy, optax, equinox, flax.linen, flax.nnx, orbax.checkpoint, modelshard
for m in pkgutil.walk_packages(modelshard.__path__, "modelshard."):  # every module but __main__
    if not m.name.endswith("__main__"):
        importlib.import_module(m.name)
EOF
echo "$want" > "$STAMP"
