#!/usr/bin/env bash
# Create .venv with the pinned stack and modelshard installed editable.
# Needs only Python (3.12+ preferred; 3.11 falls back to an unpinned resolve) and pip.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
STAMP=$VENV/.modelshard-installed
want=$(cat pyproject.toml requirements/lock.txt | cksum | cut -d' ' -f1)
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
  reqs=(-r requirements/lock.txt)
else
  echo "bootstrap: Python < 3.12: the lock needs 3.12, resolving unpinned (older jax)" >&2
  reqs=(-r requirements/lock.in)
fi
if "$vpy" -m pip install -q --disable-pip-version-check uv >/dev/null 2>&1; then
  "$vpy" -m uv pip install -q --python "$vpy" "${reqs[@]}" -e '.[all,dev]'
else
  "$vpy" -m pip install -q --disable-pip-version-check "${reqs[@]}" -e '.[all,dev]'
fi
echo "$want" > "$STAMP"
